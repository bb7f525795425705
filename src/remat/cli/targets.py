"""Resolve a command-line TARGET into (model, example_inputs, loss_fn).

TARGET is one of:

* a built-in example name: ``gpt`` or ``unet`` (``remat.examples``), sized by options;
* ``path/to/file.py:function`` or ``package.module:function``: a function taking no required
  arguments (it may accept ``device=``, and ``batch_size=``/``seq_len=`` given on the command line) that returns
  ``(model, example_inputs)``, ``(model, example_inputs, loss_fn)`` or, for a target planned with ``--device GPU
  --world N``, ``(model, example_inputs, loss_fn, parallelize)`` (``parallelize(model, mesh)`` applies the run's
  FSDP2/TP). See ``examples/custom_target.py``;
* a Hugging Face ``config.json`` (or a folder holding one): the model built from it on the meta device by
  ``AutoModelForCausalLM.from_config`` (no weights, no download), a batch of ``input_ids`` and ``labels``;
* ``torchtitan:NAME:FLAVOR`` (``torchtitan:llama3:8B``): torchtitan's model from the installed package's registry
  (``remat.integrations.torchtitan.models``), its loss, and its own FSDP2 wrapping for ``--world``.
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


def resolve_target(target: str, *, device: torch.device, options: dict[str, Any] | None = None,
                   with_parallelize: bool = False) -> tuple:
    """Build the target's model and batch on ``device``. Returns (model, inputs, loss_fn, description), and the
    target's ``parallelize`` (or None) last with ``with_parallelize``.

    ``options`` are the size options of a built-in example (layers, batch_size, seq_len, ...), also passed to a
    function target that takes them; unset (None) ones keep the defaults."""
    options = {k: v for k, v in (options or {}).items() if v is not None}
    if target.startswith(TORCHTITAN):
        built = _torchtitan(target, device, options)
    elif _hf_config(target) is not None:
        built = (*hf_from_config(_hf_config(target), device, options), None)
    elif target in EXAMPLES:
        make = EXAMPLES[target]
        accepted = inspect.signature(make).parameters
        used = {k: v for k, v in options.items() if k in accepted}
        model, inputs, loss_fn = make(device=device, **used)
        built = (model, inputs, loss_fn, target + "".join(f" {k}={v}" for k, v in sorted(used.items())), None)
    else:
        built = _from_function(target, device, options)
    return built if with_parallelize else built[:4]


#: the prefix of a torchtitan model target: ``torchtitan:NAME:FLAVOR``
TORCHTITAN = "torchtitan:"


def _torchtitan(target: str, device: torch.device, options: dict[str, Any]) -> tuple:
    """torchtitan's model NAME in FLAVOR (the installed package's registry), batch ``batch_size`` x ``seq_len``
    (default 1 x 2048)."""
    parts = target.split(":")
    if len(parts) != 3 or not all(parts[1:]):
        raise InvalidInputError(f"a torchtitan target is torchtitan:NAME:FLAVOR (e.g. torchtitan:llama3:8B), got "
                                f"{target!r}")
    try:
        from remat.integrations.torchtitan.models import titan_target
    except ImportError as e:
        from remat.errors import MissingDependencyError
        raise MissingDependencyError(f"{target} needs torchtitan: pip install 'remat[torchtitan]' ({e})") from e
    return titan_target(parts[1], parts[2], device=device, batch_size=options.get("batch_size") or 1,
                        seq_len=options.get("seq_len") or 2048)


def _from_function(target: str, device: torch.device, options: dict[str, Any]) -> tuple:
    """A function target's (model, inputs, loss_fn, description, parallelize): ``batch_size``/``seq_len`` passed
    when it takes them."""
    fn = _load_function(target)
    accepted = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in {"device": device, **options}.items() if k in accepted}
    result = fn(**kwargs)
    if not isinstance(result, tuple) or len(result) not in (2, 3, 4) or not isinstance(result[0], nn.Module):
        raise InvalidInputError(
            f"{target} must return (model, example_inputs), (model, example_inputs, loss_fn) or (model, "
            f"example_inputs, loss_fn, parallelize) with an nn.Module first; it returned {type(result).__name__}")
    model, inputs, loss_fn, parallelize = (*result, None, None)[:4]
    if loss_fn is not None and not callable(loss_fn):
        raise InvalidInputError(f"{target}: the third value it returns must be a loss function")
    inputs = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, inputs)
    return model.to(device).train(), inputs, loss_fn, target, parallelize


def _hf_config(target: str) -> Path | None:
    """The config.json ``target`` names (the file, or a folder holding one), or None."""
    path = Path(target)
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    return path if path.is_file() and path.suffix == ".json" else None


def hf_from_config(config_json: Path, device: torch.device, options: dict[str, Any]) -> tuple:
    """A causal language model built from a Hugging Face config (on the meta device, no weights, for a target that
    is not here; else initialised on the CPU and moved to ``device``), and a batch of ``batch_size`` x ``seq_len``
    token ids with their labels (default 1 x the config's context, at most 4096)."""
    try:
        import transformers
    except ImportError:
        from remat.errors import MissingDependencyError
        raise MissingDependencyError("a Hugging Face config as TARGET needs transformers: pip install 'remat[hf]'") \
            from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(config_json.parent if config_json.name == "config.json"
                                                             else config_json))
    except Exception as e:  # noqa: BLE001 - transformers' own message says what is wrong
        raise InvalidInputError(f"{config_json} is not a config transformers can read ({type(e).__name__}: {e})") \
            from e
    with torch.device("meta" if device.type == "meta" else "cpu"):  # no weights for a target not here
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError as e:
            if "Unrecognized configuration class" not in str(e):
                raise
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
            raise InvalidInputError(
                f"{config_json}: a {config.model_type!r} config ({', '.join(getattr(config, 'architectures', None) or [])}"
                f") has no causal language model in transformers {transformers.__version__}, and a config.json target is "
                f"trained as one (token ids in, next-token loss). It builds {len(causal)} model types, among them "
                f"{', '.join(t for t in _FAMILIAR if t in causal)}. For an "
                "encoder-decoder, a vision model or another task, write a function target returning (model, "
                "example_inputs, loss_fn): docs/cli.md") from None
    context = getattr(config, "max_position_embeddings", None) or 4096
    batch, seq = options.get("batch_size") or 1, options.get("seq_len") or min(context, 4096)
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    desc = f"{config.model_type} from {config_json} batch_size={batch} seq_len={seq}"
    return model.to(device).train(), {"input_ids": ids, "labels": ids}, None, desc


#: model types named first when a config without a causal language model is refused
_FAMILIAR = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gpt2", "phi3",
             "deepseek_v3", "olmo2")


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
