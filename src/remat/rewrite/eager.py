"""The blocks ``Module.compile()`` leaves eager: their compiled calls set aside while remat's forwards are
installed under them, and given back (part of :mod:`remat.rewrite`)."""

from __future__ import annotations

import weakref
from typing import Callable

from torch import nn

from remat._compat import compiled_call, module_compile_compiles_nothing, set_compiled_call, uncompiled
from remat.rewrite.forwards import _RematForward


#: Note [Blocks Module.compile() leaves eager]
#: ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
#: ``Module.compile()`` on one of torch.nn's own modules (an ``nn.Sequential`` of layers, an
#: ``nn.TransformerEncoderLayer``) compiles nothing in torch 2.13: Dynamo skips ``Module._call_impl`` and those
#: forwards (pytorch#150915), so the loop runs the block eagerly. The forward remat installs is code Dynamo does
#: capture: a checkpointed unit inside such a block would start compiling, and the step would be another program
#: than the one planned (and than the user's). So while remat's forwards are installed under such a block, its
#: compiled call is set aside (``_compiled_call_impl`` None: the eager call it was in effect) and given back by
#: remove_checkpointing. Kept here by module, weakly: the user's compiled call of each block set aside.
_LEFT_EAGER: "weakref.WeakKeyDictionary[nn.Module, Callable]" = weakref.WeakKeyDictionary()


def keep_compiled_nothing_eager(model: nn.Module) -> None:
    """Set aside the compiled call of every block of ``model`` that ``Module.compile()`` compiles nothing for and
    that holds a forward of remat's (Note [Blocks Module.compile() leaves eager]; mutates ``model``)."""
    for m in uncompiled(model).modules():
        if m in _LEFT_EAGER or compiled_call(m) is None:
            continue
        if any(isinstance(sub.__dict__.get("forward"), _RematForward) for sub in m.modules()) \
                and module_compile_compiles_nothing(m):
            _LEFT_EAGER[m] = compiled_call(m)
            set_compiled_call(m, None)


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
