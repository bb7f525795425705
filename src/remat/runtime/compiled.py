"""Compiled training loops: how the loop compiles the model, and running one step the way it will.

remat profiles the eager step (its recorder is a dispatch mode, which compiled code bypasses) and plans
for the compiled one by measuring compiled steps (Note [Compiled steps] in remat.solve.calibrated). This
module says which compiled step that is and runs it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from remat._compat import (COMPILED_FLOOR, COMPILED_FLOOR_WHY, compile_fn, compile_settings, compiled_call, module_call,
                           require_torch, compiled_submodules, module_compile_compiles_nothing, set_compiled_call,
                           submodules_called, uncompiled)
from remat.errors import InvalidInputError

#: the torch.compile arguments a ``compile={...}`` dict may set
COMPILE_KEYS = ("backend", "mode", "options", "fullgraph", "dynamic")


@dataclass(frozen=True)
class CompiledLoop:
    """How the training loop compiles the model: the whole model (``torch.compile(model)``) or, in place,
    some of its submodules (``block.compile()`` per block: torchtitan's order, checkpoint then compile), with
    ``torch.compile``'s settings."""

    #: the submodules compiled in place (qualified names); empty: the whole model is compiled
    blocks: tuple[str, ...] = ()
    #: the ``torch.compile`` keyword arguments, as (name, value) pairs
    settings: tuple[tuple[str, Any], ...] = ()
    #: how remat learned that the loop compiles
    source: str = "compile=True"

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.settings) or "default settings"
        what = "the whole model" if not self.blocks else "the whole model in place" if self.blocks == ("",) else (
            f"{len(self.blocks)} submodules in place ({', '.join(self.blocks[:3])}{' ...' if len(self.blocks) > 3 else ''})")
        return f"torch.compile of {what}, {opts}; {self.source}"

    @contextlib.contextmanager
    def step(self, model: nn.Module) -> Iterator[Callable[..., Any]]:
        """Within the block, a callable that runs ``model``'s forward compiled as the loop compiles it, freshly
        compiled for the model as it is now (its checkpointing included), in a compile region of remat's own
        (``remat._compat.compile_fn``). Compiled submodules get their own compiled calls back afterwards."""
        settings = dict(self.settings)
        if not self.blocks:
            yield compile_fn(model, settings)
            return
        with submodules_called(model, list(self.blocks), lambda m: compile_fn(module_call(m), settings)):
            yield model



@dataclass(frozen=True)
class DetectedCompile:
    """How a framework compiles the model, found by remat's integration for it (Lightning's ``_compiler_ctx``):
    passed as ``compile`` to plan for it, with where it was found for the plan's ``compiled`` field."""

    #: the ``torch.compile`` settings read, or None where they could not be read (torch.compile's defaults)
    settings: dict | None
    #: where they were found, e.g. "Lightning compiled the module"
    source: str


def compiled_loop(model: nn.Module, inner: nn.Module, compile: bool | dict | DetectedCompile | None) -> CompiledLoop | None:
    """How the loop compiles ``model`` (as the user passed it; ``inner``: the module it wraps, if compiled):
    ``compile`` True or a dict of ``torch.compile`` settings says so; None detects it (a model wrapped by
    ``torch.compile``, or submodules compiled in place with ``Module.compile()``); False plans the eager
    step. Returns None for an eager loop. A compiled loop on a torch older than ``COMPILED_FLOOR`` is refused
    (UnsupportedError): remat reads the programs inductor compiled through APIs of later releases."""
    loop = _compiled_loop(model, inner, compile)
    if loop is not None:
        require_torch(f"planning a torch.compile'd training step ({loop.source})", COMPILED_FLOOR, COMPILED_FLOOR_WHY)
    return loop


def _compiled_loop(model: nn.Module, inner: nn.Module, compile: bool | dict | DetectedCompile | None) -> CompiledLoop | None:
    if compile is False:
        return None
    if isinstance(compile, DetectedCompile):
        mods = dict(inner.named_modules())
        blocks = tuple(b for b in compiled_submodules(inner) if not module_compile_compiles_nothing(mods[b]))
        source = compile.source + (" (its settings read from it)" if compile.settings is not None else
                                   " (its settings could not be read: measured with torch.compile's defaults; pass "
                                   "compile={...} to set them)")
        return CompiledLoop(blocks=blocks, settings=tuple((compile.settings or {}).items()), source=source)
    if compile is not None and compile is not True and not isinstance(compile, dict):
        raise InvalidInputError(
            f"compile must be True, False, None (detect) or a dict of torch.compile settings ({', '.join(COMPILE_KEYS)}), "
            f"got {type(compile).__name__}")
    settings: dict = dict(compile) if isinstance(compile, dict) else {}
    unknown = sorted(set(settings) - set(COMPILE_KEYS))
    if unknown:
        raise InvalidInputError(f"compile={{...}} takes the torch.compile settings {list(COMPILE_KEYS)}; got {unknown}")
    mods = dict(inner.named_modules())
    blocks = tuple(b for b in compiled_submodules(inner) if not module_compile_compiles_nothing(mods[b]))
    wrapped = model is not inner
    if compile is None and not wrapped and not blocks:
        return None
    if compile is None:  # detected: its settings are read from the compiled objects where torch keeps them
        if wrapped:
            source, read = "the model is wrapped by torch.compile", compile_settings(model)
        else:
            source = f"Module.compile() was called on {len(blocks)} submodules"
            found = [compile_settings(compiled_call(mods[b])) for b in blocks]
            read = found[0] if all(f is not None and f == found[0] for f in found) else None
        if read is None:
            source += (" (its settings could not be read" + ("" if wrapped else ", or differ between them") +
                       ": measured with torch.compile's defaults; pass compile={...} to set them)")
        else:
            settings = read
            source += " (its settings read from it)" if wrapped else " (their settings read from them)"
    else:
        source = "compile=True" if compile is True else "compile={...}"
    return CompiledLoop(blocks=blocks, settings=tuple(settings.items()), source=source)


#: Note [Blocks Module.compile() leaves eager]
#: ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
#: ``Module.compile()`` on one of torch.nn's own modules (an ``nn.Sequential`` of layers, an
#: ``nn.TransformerEncoderLayer``) compiles nothing in torch 2.13: Dynamo skips ``Module._call_impl`` and those
#: forwards (pytorch#150915), so the loop runs the block eagerly. The forward remat installs is code Dynamo does
#: capture: a checkpointed unit inside such a block would start compiling, and the step would be another program
#: than the one planned (and than the user's). So while remat's forwards are installed under such a block, its
#: compiled call is set aside (``_compiled_call_impl`` None: the eager call it was in effect) and given back by
#: remove_checkpointing (remat.rewrite.eager decides which blocks). Kept here by module, weakly: the user's compiled
#: call of each block set aside, the one state of it a snapshot (remat.runtime.state) takes and gives back.
_LEFT_EAGER: "weakref.WeakKeyDictionary[nn.Module, Callable]" = weakref.WeakKeyDictionary()


def hold_aside(m: nn.Module) -> None:
    """Set ``m``'s compiled call aside (the block then runs its eager call) until :func:`give_back`."""
    if m not in _LEFT_EAGER and compiled_call(m) is not None:
        _LEFT_EAGER[m] = compiled_call(m)
        set_compiled_call(m, None)


def give_back(m: nn.Module) -> None:
    """Give ``m`` the compiled call set aside for it, if any."""
    if m in _LEFT_EAGER:
        set_compiled_call(m, _LEFT_EAGER.pop(m))


def set_aside(m: nn.Module) -> Callable | None:
    """The compiled call remat set aside for module ``m``, None where none (for a snapshot: remat.runtime.state)."""
    return _LEFT_EAGER.get(m)


def restore_set_aside(m: nn.Module, impl: Callable | None) -> None:
    """Make ``impl`` the compiled call remat holds set aside for ``m`` (None: none), as a snapshot had it."""
    if impl is None:
        _LEFT_EAGER.pop(m, None)
    else:
        _LEFT_EAGER[m] = impl


def left_eager(model: nn.Module) -> list[str]:
    """The blocks of ``model`` whose compiled call remat has set aside (qualified names)."""
    return [name for name, m in uncompiled(model).named_modules() if m in _LEFT_EAGER]
