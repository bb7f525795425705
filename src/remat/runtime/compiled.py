"""Compiled training loops: how the loop compiles the model, and running one step the way it will.

remat profiles the eager step (its recorder is a dispatch mode, which compiled code bypasses) and plans
for the compiled one by measuring compiled steps (Note [Compiled steps] in remat.solve.calibrated). This
module says which compiled step that is and runs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from remat._compat import (COMPILED_FLOOR, COMPILED_FLOOR_WHY, compile_fn, compile_settings, compiled_call, module_call,
                           require_torch, compiled_submodules, module_compile_compiles_nothing,
                           submodules_called)
from remat.errors import InvalidInputError
from remat.rewrite import keep_compiled_nothing_eager, left_eager

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


def compiled_nothing(model: nn.Module) -> list[str]:
    """The submodules of ``model`` (qualified names) on which ``Module.compile()`` was called but compiles nothing
    in this torch (Note [Blocks Module.compile() leaves eager] in remat.rewrite), set aside by remat or not."""
    mods = dict(model.named_modules())
    return sorted(set(left_eager(model)) | {b for b in compiled_submodules(model)
                                            if module_compile_compiles_nothing(mods[b])})


def compiled_nothing_note(model: nn.Module) -> str | None:
    """The plan's note on the blocks ``Module.compile()`` compiles nothing for, or None where there are none."""
    names = compiled_nothing(model)
    if not names:
        return None
    kinds = sorted({type(m).__name__ for n, m in model.named_modules() if n in names})
    return (f"Module.compile() was called on {', '.join(repr(n) for n in names[:4])}{' ...' if len(names) > 4 else ''} "
            f"({', '.join(kinds)}), but in this torch it compiles nothing for them: Dynamo skips Module._call_impl "
            "and torch.nn's own forwards (pytorch#150915), so they run eagerly, and are planned for the eager step; "
            "remat's checkpointing keeps them eager (Note [Blocks Module.compile() leaves eager] in remat.rewrite). "
            "To compile such a block, compile a module of your own class around it, or the whole model")


@contextlib.contextmanager
def eager_submodules(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s submodules compiled in place (``Module.compile()``) run eagerly: remat's
    recorder is a dispatch mode, which compiled code bypasses, so profiling and eager checks run them
    eagerly, whether or not the plan is made for the compiled step; their compiled calls are back afterwards
    (those of blocks that compile nothing set aside again where remat's forwards are under them)."""
    try:
        with submodules_called(model, compiled_submodules(model), None):
            yield
    finally:
        keep_compiled_nothing_eager(model)
