"""Resolve a command-line TARGET into (model, example_inputs, loss_fn).

TARGET is one of:

* a built-in example name: ``gpt`` or ``unet`` (``remat.examples``), sized by options;
* ``path/to/file.py:function`` or ``package.module:function``: a function taking no required
  arguments (it may accept ``device=``) that returns ``(model, example_inputs)`` or
  ``(model, example_inputs, loss_fn)``. See ``examples/custom_target.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from remat._compat import tree_map

from remat.errors import InvalidInputError
from remat.examples import EXAMPLES

LossFn = Callable[[Any], torch.Tensor]


class _PathEntry(str):
    """A ``sys.path`` entry of remat's own: a string like any other, found again by identity."""


def _load_function(target: str) -> Callable[..., Any]:
    where, sep, func = target.rpartition(":")
    if not sep or not where or not func:
        known = ", ".join(sorted(EXAMPLES))
        raise InvalidInputError(
            f"unknown target {target!r}: use a built-in example ({known}), path/to/file.py:function "
            "or package.module:function"
        )
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise InvalidInputError(f"target file {where} does not exist")
        name = f"remat_target_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise InvalidInputError(f"cannot load {where} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        # the file's folder, for its own imports; removed afterwards by identity, not position: a file that puts
        # a folder of its own first (sys.path.insert(0, ...)) keeps it (issue #36)
        entry = _PathEntry(path.resolve().parent)
        sys.path.insert(0, entry)
        try:
            spec.loader.exec_module(module)
        finally:
            for i, p in enumerate(sys.path):
                if p is entry:
                    del sys.path[i]
                    break
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise InvalidInputError(f"cannot import module {where!r} for target {target!r}: {e}") from e
    fn = getattr(module, func, None)
    if not callable(fn):
        raise InvalidInputError(f"{where} has no function {func!r}")
    return fn


def resolve_target(target: str, *, device: torch.device, options: dict[str, Any] | None = None
                   ) -> tuple[nn.Module, Any, LossFn | None, str]:
    """Build the target's model and batch on ``device``. Returns (model, inputs, loss_fn, description).

    ``options`` are the size options of a built-in example (layers, batch_size, seq_len, ...);
    unset (None) ones keep the example's defaults."""
    options = {k: v for k, v in (options or {}).items() if v is not None}
    if target in EXAMPLES:
        make = EXAMPLES[target]
        accepted = inspect.signature(make).parameters
        used = {k: v for k, v in options.items() if k in accepted}
        model, inputs, loss_fn = make(device=device, **used)
        desc = target + "".join(f" {k}={v}" for k, v in sorted(used.items()))
        return model, inputs, loss_fn, desc
    fn = _load_function(target)
    kwargs = {"device": device} if "device" in inspect.signature(fn).parameters else {}
    result = fn(**kwargs)
    if not isinstance(result, tuple) or len(result) not in (2, 3) or not isinstance(result[0], nn.Module):
        raise InvalidInputError(
            f"{target} must return (model, example_inputs) or (model, example_inputs, loss_fn) with an "
            f"nn.Module first; it returned {type(result).__name__}"
        )
    model, inputs = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if loss_fn is not None and not callable(loss_fn):
        raise InvalidInputError(f"{target}: the third value it returns must be a loss function")
    inputs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)
    return model.to(device).train(), inputs, loss_fn, target


def sized_batches(target: str, key: str, *, device: torch.device, options: dict[str, Any] | None = None
                  ) -> Callable[[int], tuple[Any, LossFn | None]]:
    """For ``remat maxbatch``: a function from a size ``n`` to the target's ``(example_inputs, loss_fn)`` built
    with ``key=n`` (``batch_size`` or ``seq_len``); the target's function must accept that keyword."""
    if target not in EXAMPLES:
        fn = _load_function(target)
        if key not in inspect.signature(fn).parameters:
            raise InvalidInputError(f"{target} takes no {key}= argument: remat maxbatch builds batches of every "
                                    f"size it tries by calling it with {key}=n")

    def make(n: int) -> tuple[Any, LossFn | None]:
        if target in EXAMPLES:
            _, inputs, loss_fn, _ = resolve_target(target, device=device, options={**(options or {}), key: n})
            return inputs, loss_fn
        kwargs = {"device": device} if "device" in inspect.signature(fn).parameters else {}
        result = fn(**kwargs, **{key: n})
        inputs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, result[1])
        return inputs, result[2] if len(result) == 3 else None
    return make
