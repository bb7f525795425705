"""torch.optim's private APIs remat relies on (part of remat._compat: see its docstring)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def default_foreach(params: list[torch.Tensor], differentiable: bool) -> bool:
    """Whether ``torch.optim`` picks its foreach (multi-tensor) implementation for ``params`` when a
    group leaves ``foreach`` and ``fused`` unset. ``torch.optim.optimizer._default_to_fused_or_foreach``
    (checked on 2.8, 2.11, 2.13, 2.15)."""
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
    ``_global_optimizer_post_hooks`` (checked on 2.8, 2.11, 2.13, 2.15)."""
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
