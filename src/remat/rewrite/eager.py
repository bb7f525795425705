"""The blocks ``Module.compile()`` leaves eager: their compiled calls set aside while remat's forwards are
installed under them (Note [Blocks Module.compile() leaves eager] in remat.runtime.compiled, which holds them), and
the eager call remat's profiles and checks make of a model's compiled submodules (part of :mod:`remat.rewrite`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from remat._compat import compiled_call, compiled_submodules, module_compile_compiles_nothing, submodules_called, \
    uncompiled
from remat.rewrite.forwards import _RematForward
from remat.runtime.compiled import hold_aside, left_eager, set_aside


def keep_compiled_nothing_eager(model: nn.Module) -> None:
    """Set aside the compiled call of every block of ``model`` that ``Module.compile()`` compiles nothing for and
    that holds a forward of remat's (Note [Blocks Module.compile() leaves eager] in remat.runtime.compiled;
    mutates ``model``)."""
    for m in uncompiled(model).modules():
        if set_aside(m) is not None or compiled_call(m) is None:
            continue
        if any(isinstance(sub.__dict__.get("forward"), _RematForward) for sub in m.modules()) \
                and module_compile_compiles_nothing(m):
            hold_aside(m)


def compiled_nothing(model: nn.Module) -> list[str]:
    """The submodules of ``model`` (qualified names) on which ``Module.compile()`` was called but compiles nothing
    in this torch (Note [Blocks Module.compile() leaves eager] in remat.runtime.compiled), set aside by remat or not."""
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
            "remat's checkpointing keeps them eager (Note [Blocks Module.compile() leaves eager] in remat.runtime.compiled). "
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
