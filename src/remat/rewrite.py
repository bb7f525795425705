"""Checkpoint chosen submodules in place, and undo it.

Note [Checkpoint the forward, not the module]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Wrapper modules (``CheckpointWrapper(block)``) add a path component to every parameter
name, which breaks ``state_dict`` keys, optimizer parameter groups and saved checkpoints.
Instead remat sets an instance attribute ``forward`` on the chosen module: a picklable
callable object that runs the class's forward under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, preserve_rng_state=True)``.
``Module.__call__`` still runs the module's hooks outside the checkpoint, parameters are
untouched, and ``copy.deepcopy``/``torch.save`` copy the callable with the module (it
refers to its module, which the copy's memo maps to the copy's module).

Note [Buffers replay]
~~~~~~~~~~~~~~~~~~~~~
Recomputation runs the forward a second time, so a module that updates buffers in its
forward (BatchNorm's running statistics, counters) would update them twice and, worse,
recompute with the already-updated values. The wrapper snapshots the buffers the unit
mutates before the first forward; during recomputation it sets them back to that snapshot
and, afterwards, to the values the first forward left. Plain and checkpointed steps then
end with identical buffers. Which buffers a unit mutates is measured while profiling
(``Plan.mutated_buffers``); when unknown, every buffer of the unit is snapshotted.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)


class CheckpointedForward:
    """The ``forward`` remat installs on a checkpointed module (see Note [Checkpoint the forward, not the module])."""

    def __init__(
        self, module: nn.Module, *, preserve_rng_state: bool = True, buffers: Iterable[str] | None = None
    ) -> None:
        self.module = module
        self.preserve_rng_state = preserve_rng_state
        #: names (relative to the module) of the buffers to replay; None: all of them
        self.buffers = None if buffers is None else tuple(buffers)
        #: the instance attribute ``forward`` the module had before, if any (restored on removal)
        self.previous = module.__dict__.get("forward")
        #: a context-manager factory wrapped around each recomputation (set by the profiler only)
        self.recompute_timer = None

    def _original(self):
        if self.previous is not None:
            return self.previous
        return type(self.module).forward.__get__(self.module)

    def __call__(self, *args, **kwargs):
        module = self.module
        original = self._original()
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if self.buffers is None:
            buffers = [b for b in module.buffers() if b is not None]
        else:
            own = dict(module.named_buffers())
            buffers = [own[n] for n in self.buffers if own.get(n) is not None]
        before = [b.detach().clone() for b in buffers]
        calls = 0

        def run(*a, **kw):
            nonlocal calls
            calls += 1
            if calls == 1:
                return original(*a, **kw)
            if self.recompute_timer is not None:
                with self.recompute_timer():
                    return self._replay(original, buffers, before, a, kw)
            return self._replay(original, buffers, before, a, kw)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=self.preserve_rng_state, **kwargs)

    @staticmethod
    def _replay(original, buffers, before, a, kw):
        if not buffers:
            return original(*a, **kw)
        # recomputation: replay from the buffers' values before the first forward (Note [Buffers replay])
        with torch.no_grad():
            after = [b.detach().clone() for b in buffers]
            for b, v in zip(buffers, before):
                b.copy_(v)
        try:
            return original(*a, **kw)
        finally:
            with torch.no_grad():
                for b, v in zip(buffers, after):
                    b.copy_(v)

    def __reduce__(self):
        return (_rebuild, (self.module, self.preserve_rng_state, self.previous, self.buffers))


def _rebuild(module, preserve_rng_state, previous, buffers):
    f = CheckpointedForward.__new__(CheckpointedForward)
    f.module, f.preserve_rng_state, f.previous, f.buffers = module, preserve_rng_state, previous, buffers
    f.recompute_timer = None
    return f


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Qualified names of the modules remat has checkpointed in ``model``, in registration order."""
    return [name for name, m in model.named_modules() if is_checkpointed(m)]


def checkpoint_modules(
    model: nn.Module,
    names: Iterable[str],
    *,
    preserve_rng_state: bool = True,
    mutated_buffers: dict[str, Iterable[str]] | None = None,
) -> None:
    """Checkpoint the named submodules of ``model`` in place (mutates ``model``).

    ``mutated_buffers`` maps a unit to the names (relative to it) of the buffers its forward
    mutates (Note [Buffers replay]); units not in it replay all their buffers.
    Parameter names, ``state_dict`` keys, parameter identity and module hooks are unchanged."""
    mods = dict(model.named_modules())
    names = list(names)
    missing = [n for n in names if n not in mods]
    if missing:
        raise KeyError(f"no submodule named {missing} in {type(model).__name__}")
    for n in names:
        m = mods[n]
        if not is_checkpointed(m):
            bufs = None if mutated_buffers is None or n not in mutated_buffers else mutated_buffers[n]
            m.forward = CheckpointedForward(m, preserve_rng_state=preserve_rng_state, buffers=bufs)


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undo remat's checkpointing everywhere in ``model`` (mutates it). Returns the names it undid."""
    undone = []
    for name, m in model.named_modules():
        f = m.__dict__.get("forward")
        if isinstance(f, CheckpointedForward):
            if f.previous is not None:
                m.forward = f.previous
            else:
                del m.forward
            undone.append(name)
    return undone
