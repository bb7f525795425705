"""The ``forward`` callables remat installs on a checkpointed module (whole or selective), on an
``nn.Sequential`` (segments) and on a module cut into regions; each knows how to be undone (part of
:mod:`remat.rewrite`).

Note [Checkpoint the forward, not the module]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Wrapper modules (``CheckpointWrapper(block)``) add a path component to every parameter
name, which breaks ``state_dict`` keys, optimizer parameter groups and saved checkpoints.
Instead remat sets an instance attribute ``forward`` on the chosen module (or, for
segments, on the Sequential): a picklable callable object that runs the class's forward
under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, preserve_rng_state=True)``.
``Module.__call__`` still runs the module's hooks outside the checkpoint, parameters are
untouched, and ``copy.deepcopy``/``torch.save`` copy the callable with the module (it
refers to its module, which the copy's memo maps to the copy's module).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from remat.capture import RegionProgram
from remat.costs.unit_costs import region_name, segment_name
from remat.rewrite.call import _checkpointed_call
from remat.rewrite.policy import unit_policy


class _RematForward:
    """Base of the ``forward`` callables remat installs; knows how to be undone."""

    module: nn.Module
    previous: object

    def _original(self):
        if self.previous is not None:
            return self.previous
        return type(self.module).forward.__get__(self.module)

    def unit_names(self, name: str) -> list[str]:
        raise NotImplementedError


class CheckpointedForward(_RematForward):
    """The ``forward`` remat installs on a checkpointed module (see Note [Checkpoint the forward, not the module])."""

    def __init__(
        self, module: nn.Module, *, preserve_rng_state: bool = True, buffers: Iterable[str] | None = None,
        saved_ops: Iterable[str] | None = None, policy: str = "", random: str = "keep",
    ) -> None:
        self.module = module
        self.preserve_rng_state = preserve_rng_state
        #: checkpoint selectively, keeping these operators' outputs (Note [Selective checkpointing]);
        #: None: checkpoint the whole forward
        self.saved_ops = None if saved_ops is None else tuple(saved_ops)
        #: the policy's name in the unit name (``"@ops2"``), for selective units
        self.policy = policy
        #: names (relative to the module) of the buffers to replay; None: all of them
        self.buffers = None if buffers is None else tuple(buffers)
        #: the instance attribute ``forward`` the module had before, if any (restored on removal)
        self.previous = module.__dict__.get("forward")
        #: a context-manager factory wrapped around each recomputation (set by the profiler only)
        self.recompute_timer = None
        #: the policy under torch.compile: what it keeps, random operators' outputs kept or recomputed (Note [Random
        #: operators under compile]; ``Plan.compiled_random``)
        self.compiled = unit_policy(self.saved_ops, random)

    def __call__(self, *args, **kwargs):
        original = self._original()
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return _checkpointed_call(original, args, kwargs, _buffers(self.module, self.buffers),
                                  self.preserve_rng_state, self.recompute_timer, self.saved_ops,
                                  self.__dict__.get("compiled"))  # (None: pickled before it had one)

    def unit_names(self, name: str) -> list[str]:
        return [name + self.policy]

    def __reduce__(self):
        return (_rebuild, (CheckpointedForward, dict(
            module=self.module, preserve_rng_state=self.preserve_rng_state, previous=self.previous,
            buffers=self.buffers, recompute_timer=None, saved_ops=self.saved_ops, policy=self.policy,
            compiled=self.__dict__.get("compiled"))))


class SegmentedForward(_RematForward):
    """The ``forward`` remat installs on an ``nn.Sequential`` to checkpoint runs of its children."""

    def __init__(self, module: nn.Sequential, segments: Iterable[tuple[int, int]], *,
                 preserve_rng_state: bool = True,
                 buffers: dict[tuple[int, int], tuple[str, ...] | None] | None = None, random: str = "keep") -> None:
        self.module = module
        self.segments = tuple(sorted(segments))
        self.preserve_rng_state = preserve_rng_state
        self.compiled = unit_policy(None, random)  # under torch.compile (as CheckpointedForward's)
        #: per segment, names (relative to the Sequential) of the buffers to replay; None: all of them
        self.buffers = dict(buffers or {})
        self.previous = module.__dict__.get("forward")

    def __call__(self, input):
        if not torch.is_grad_enabled():
            return self._original()(input)
        children = list(self.module._modules.values())
        starts = dict(self.segments)
        k, x = 0, input
        while k < len(children):
            stop = starts.get(k)
            if stop is None:
                x = children[k](x)
                k += 1
                continue

            def run(y, members=children[k:stop]):
                for child in members:
                    y = child(y)
                return y

            names = self.buffers.get((k, stop))
            if names is None:
                bufs = [b for c in children[k:stop] for b in c.buffers() if b is not None]
            else:
                bufs = _buffers(self.module, names)
            x = _checkpointed_call(run, (x,), {}, bufs, self.preserve_rng_state, None,
                                   compiled=self.__dict__.get("compiled"))
            k = stop
        return x

    def unit_names(self, name: str) -> list[str]:
        return [segment_name(name, i, j) for i, j in self.segments]

    def __reduce__(self):
        return (_rebuild, (SegmentedForward, dict(
            module=self.module, segments=self.segments, preserve_rng_state=self.preserve_rng_state,
            buffers=self.buffers, previous=self.previous, compiled=self.__dict__.get("compiled"))))


class RegionForward(_RematForward):
    """The ``forward`` remat installs on a module to checkpoint regions of its forward (Note [Regions] in
    remat.capture): it runs the module's traced graph, node by node as the forward would (each value
    dropped after its last use), with each chosen region under checkpoint; under torch.compile it checkpoints the
    module's whole forward instead (Note [Regions under torch.compile]).

    Note [Regions under torch.compile]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    remat offers regions only for eager loops (a plan for a compiled loop has none), but nothing stops a user from
    compiling a model that an eager plan checkpointed (issue #62: a 6-block GPT, two budgets of three). Dynamo cannot
    trace the region's program (``torch.fx.Node`` is on its skip list), so it broke the graph there, the region's
    checkpoint ran eagerly with the compiled policy (which keeps random operators' outputs: Note [Random operators
    under compile] in remat.rewrite.policy), and eager dropout's kept mask, scaled in place, failed the first
    backward inside torch (``Tensor cached during selective activation checkpoint has been mutated``). Refusing
    there does not work: an exception raised while Dynamo traces makes it run the frame eagerly, where nothing is
    compiling, and the step goes on. So under compile the module is checkpointed whole, as a module unit is
    (``_checkpointed_call``'s compiled path, no graph break): it saves the module's input and recomputes its whole
    forward, where the plan recomputed the regions only; the compiled step computes what the plain compiled step
    computes (tests/integration/test_edges.py), and what it saves is compile's partitioner's, not the eager plan's
    promise (the plan's notes say to plan with ``compile=True``). Eager steps keep the regions planned."""

    def __init__(self, module: nn.Module, regions: Iterable[tuple[str, str | None]], *,
                 preserve_rng_state: bool = True,
                 buffers: dict[tuple[str, str | None], tuple[str, ...] | None] | None = None,
                 random: str = "keep") -> None:
        self.module = module
        self.regions = tuple(regions)
        self.preserve_rng_state = preserve_rng_state
        self.compiled = unit_policy(None, random)  # under torch.compile (as CheckpointedForward's)
        #: per region, names (relative to the module) of the buffers to replay; None: all of its submodules'
        self.buffers = dict(buffers or {})
        self.previous = module.__dict__.get("forward")
        self._programs: dict[bool, RegionProgram] = {}

    def program(self) -> RegionProgram:
        """The traced graph for the module's current training mode (traced again when it changes)."""
        key = bool(self.module.training)
        if key not in self._programs:
            self._programs[key] = RegionProgram(self.module, self.regions)
        return self._programs[key]

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled() or len(args) + len(kwargs) != 1:
            return self._original()(*args, **kwargs)
        if torch.compiler.is_compiling():  # Note [Regions under torch.compile]
            return _checkpointed_call(self._original(), args, kwargs, [], self.preserve_rng_state, None,
                                      compiled=self.__dict__.get("compiled"))
        (x,) = (*args, *kwargs.values())
        return self.program().run(x, self._checkpointed)

    def _checkpointed(self, region: tuple[str, str | None], fn: Callable, x, submodules: list[nn.Module]):
        names = self.buffers.get(region)
        bufs = _buffers(self.module, names) if names is not None else \
            [b for m in submodules for b in m.buffers() if b is not None]
        return _checkpointed_call(fn, (x,), {}, bufs, self.preserve_rng_state, None,
                                  compiled=self.__dict__.get("compiled"))

    def unit_names(self, name: str) -> list[str]:
        return [region_name(name, a, b) for a, b in self.regions]

    def __reduce__(self):
        return (_rebuild, (RegionForward, dict(
            module=self.module, regions=self.regions, preserve_rng_state=self.preserve_rng_state,
            buffers=self.buffers, previous=self.previous, _programs={}, compiled=self.__dict__.get("compiled"))))


def _rebuild(cls, state):
    f = cls.__new__(cls)
    f.__dict__.update(state)
    return f


def _buffers(module: nn.Module, names: tuple[str, ...] | None) -> list[torch.Tensor]:
    if names is None:
        return [b for b in module.buffers() if b is not None]
    own = dict(module.named_buffers())
    return [own[n] for n in names if own.get(n) is not None]


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _RematForward)
