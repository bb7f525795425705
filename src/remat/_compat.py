"""Private torch APIs remat relies on, in one place.

Each entry names the torch versions it was checked on. When a new torch moves one of them, it
breaks here with a message that says which, instead of deep inside a stage.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

#: torch versions the entries below were run on
CHECKED_ON = ("2.11", "2.13")


def default_foreach(params: list[torch.Tensor], differentiable: bool) -> bool:
    """Whether ``torch.optim`` picks its foreach (multi-tensor) implementation for ``params`` when a
    group leaves ``foreach`` and ``fused`` unset. ``torch.optim.optimizer._default_to_fused_or_foreach``
    (checked on 2.11, 2.13)."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # a torch that moved it: assume the per-tensor loop (its temporaries are the smaller)
        return False
    return bool(_default_to_fused_or_foreach(params, differentiable, False)[1])


@contextlib.contextmanager
def global_optimizer_hooks_paused() -> Iterator[None]:
    """Run ``torch.optim`` steps without the hooks registered for *every* optimizer
    (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook``): remat's own
    steps on shadow copies must not reach the user's hooks. ``_global_optimizer_pre_hooks`` and
    ``_global_optimizer_post_hooks`` (checked on 2.11, 2.13)."""
    import torch.optim.optimizer as optim_module

    tables = [getattr(optim_module, n, None) for n in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")]
    saved = [dict(t) if t is not None else None for t in tables]
    for t in tables:
        if t is not None:
            t.clear()
    try:
        yield
    finally:
        for t, s in zip(tables, saved):
            if t is not None:
                t.clear()
                t.update(s)


@contextlib.contextmanager
def outside_dispatch_modes() -> Iterator[None]:
    """Run a few operators unseen by the active ``TorchDispatchMode``s, e.g. selective checkpointing's
    caching mode during a recomputation, which refuses operators the forward did not run.
    ``torch.utils._python_dispatch._disable_current_modes`` (checked on 2.11, 2.13)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield
