"""Checkpoint chosen units in place, and undo it.

A unit is a submodule by qualified name (``h.3``, ``h.3.mlp``) or a *segment*: a contiguous run of
the children of an ``nn.Sequential`` (``blocks[0:4]``, ``[2:5]`` for a Sequential root), checkpointed
as one piece as ``torch.utils.checkpoint.checkpoint_sequential`` does, or a *region* of a module's
forward between two of its submodule calls (``up.2[conv1:conv2]``, ``up.2[conv2:]``; Note [Regions] in
remat.capture). A module unit with the suffix
``@ops<k>`` (``h.3.mlp@ops2``) is checkpointed *selectively*, with its own policy.

Note [Selective checkpointing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A selective unit (``h.3@ops2``) is checkpointed with a *policy*: the operators of its forward
whose outputs are kept (``saved_ops``, keys like ``aten.addmm.default#1``: the second ``addmm``
of the unit's forward). Kept outputs are cached in forward and handed back during the
recomputation instead of computing them again; every other operator runs again, as in plain
checkpointing. Megatron-LM's selective recomputation is one such policy (keep the matmuls,
recompute the attention core, softmax, dropout, norms); remat profiles several per unit, at
different memory levels (``remat.profile.units``: Note [Policy menus]), and the ILP picks at most one
option per unit. It uses ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` under
non-reentrant checkpoint with the RNG state preserved; the policy never keeps the output of an
operator that draws random numbers (``draws_random``), so every random operator runs again, in
order, from the restored RNG state and draws the same values (skipping one would shift the draws
of those after it; under torch.compile it keeps every one instead: Note [Random operators under compile]).
Operators are named by position, so the unit's operator sequence must be the
same at every step: remat offers selective options only for models it captured as a graph (fx or
export), not for those with data-dependent control flow (the ``hooks`` path). In-place ops and views are recomputed (they allocate nothing to keep), and
an output that a later operator of the unit modifies in place is never kept (the cache would
refuse it).

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

Note [Buffers replay]
~~~~~~~~~~~~~~~~~~~~~
Recomputation runs the forward a second time, so a module that updates buffers in its
forward (BatchNorm's running statistics, counters) would update them twice and, worse,
recompute with the already-updated values. The wrapper snapshots the buffers the unit
mutates before the first forward; during recomputation it sets them back to that snapshot
and, afterwards, to the values the first forward left. Plain and checkpointed steps then
end with identical buffers. Which buffers a unit mutates is measured while profiling
(``Plan.mutated_buffers``, an entry per checkpointed unit: a unit that mutates none replays none);
when unknown (a unit checkpointed by hand), every buffer of the unit is snapshotted. In a selective
unit the replay's clones and copies run outside the dispatch modes (selective checkpointing's cache
refuses, during the recomputation, operators the forward did not run: the crash of a selective unit
on a module that merely owned a read-only buffer).

Note [Under torch.compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Dynamo turns ``checkpoint`` into a higher-order operator whose body must be free of Python side effects,
and accepts as ``context_fn`` only a function or a ``functools.partial``. So when the installed forward
runs under compilation (``torch.compiler.is_compiling()``: the whole model compiled, or each block after
checkpointing, torchtitan's order) it calls ``checkpoint`` on the module's own forward: no call counter,
no buffer replay, and the selective policy as ``functools.partial(keep_ops_contexts, saved_ops)``, which
counts operators afresh on each call (each trace). Compile needs no replay: the recomputation is part of
the compiled backward graph, a pure function of the forward's inputs, and buffer updates are applied once,
in the forward graph. Random operators are the exception, and under compile remat keeps their outputs
(Note [Random operators under compile]).
What compile keeps is decided by its partitioner from these tags. It traces some operators otherwise than
eager does (dropout as one ``native_dropout`` where eager CPU runs four operators); selective policies name
operators so that they keep the same ones under compile (Note [Operators named alike under compile]), and
plans for a compiled loop are measured on compiled steps (Note [Compiled steps] in remat.solve.calibrated).

Note [Random operators under compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Left to torch, a random operator inside a checkpoint under torch.compile is recomputed: AOTAutograd's
partitioner wraps it in ``run_and_save_rng_state`` in the forward (the generator's state, then the operator)
and ``run_with_rng_state`` in the backward, and inductor runs both as fallback kernels on torch's generator
(torch 2.13, CPU, with or without ``fallback_random``; issue #36). Such a step draws other numbers than the
plain compiled step, and its recomputation is not bound to draw its forward's:
- inductor does not hold a wrapped operator's input to the layout eager gives it, as it does for the plain
  operator's fallback: a ``native_dropout`` after a convolution ran on the channels-last buffer of the
  convolution, and CPU dropout draws its mask in memory order, so the mask differed from the plain step's
  (a U-Net's loss 0.72287 against 0.72533). The backward's replay gets whatever layout the backward program
  chose: the same here, by no rule;
- inductor schedules a plain random kernel that reads no activation (``Dropout2d``'s ``bernoulli_`` on a
  fresh ``[batch, channels, 1, 1]`` tensor) early, with the others, and the wrapped one where it stands, so
  the draws came in another order (0.72289 against 0.72129).
So under compile remat's policy keeps (``CheckpointPolicy.MUST_SAVE``) the output of every operator that
draws random numbers inside a checkpointed unit, whole or selective: it runs once, lowered as in the plain
program, and nothing is drawn again. Its recomputation cannot draw differently, and the compiled planned step
draws what the plain compiled step draws as far as inductor schedules the two programs' random kernels alike
(tests/slow/test_compiled_dropout.py: whole and per block, ``fallback_random``; with inductor's defaults the
U-Net's plain program drew its masks in the order 1, 4, 5, 2, 3 and one plan's in order: Note [Compiled plans
are proved] in remat.check.verify says what remat checks then). What it costs is measured, not assumed: the kept outputs are in the
programs remat reads and measures for every compiled plan (Note [Compiled steps] in remat.solve.calibrated).
Measured (benchmarks/compiled_least.py, whole steps with AdamW) on benchmarks/compiled.py's GPT (4 x 128,
dropout 0.1, batch 8 x 128), every block checkpointed: with inductor's own random numbers (the default)
37.55 MiB kept against 37.78 MiB by hand (torch's replay); with ``fallback_random``, where ``native_dropout``
stays one kernel whose kept output is the dropped-out activation, 37.44 MiB against 33.62 MiB. Eager steps keep replaying from the restored generator state
(Note [Selective checkpointing]), which draws exactly the forward's numbers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections import defaultdict
from typing import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat._compat import (argument, cacheable_context_fn, compiled_call, module_compile_compiles_nothing, set_compiled_call, outside_dispatch_modes, storage_key, tree_flatten,
                           uncompiled, written_arguments)
from remat.capture import RegionProgram
from remat.costs.unit_costs import SELECTIVE, is_selective, op_key, parse_region, parse_segment, region_name, segment_name
from remat.errors import InvalidInputError, PlanMismatchError
from remat.solve.plan import Plan

log = logging.getLogger(__name__)

def draws_random(func, args: tuple, kwargs: dict) -> bool:
    """Whether operator ``func`` draws from the RNG with these arguments: it is tagged
    ``nondeterministic_seeded`` and is not an attention kernel called with ``dropout_p=0``."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    missing = object()
    p = argument(func, args, kwargs, "dropout_p", missing)
    return p is missing or p is None or float(p) != 0.0


class PolicyNames:
    """Note [Operators named alike under compile]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A selective policy names the operators it keeps by overload and call count within the unit
    (``aten.addmm.default#1``), counted where the recorder sees the eager forward and again where the policy
    runs: eagerly, or under torch.compile, where it sees the operators AOTAutograd traces. The two sequences
    differ in one way that matters (checked on the built-in GPT and a Hugging Face Llama block, CPU, torch
    2.13): eager CPU dropout runs ``empty_like``, ``bernoulli_``, ``div_`` and ``mul.Tensor`` (input times
    mask), compile runs one ``native_dropout``. So the mask's product would shift every later ``mul.Tensor``'s
    count, and a policy keeping it would keep nothing under compile. The product of a random operator's
    output (its ``mul``) is therefore not named and never kept: it is part of the random operator, which is
    recomputed anyway. (Views differ too, ``_unsafe_view`` for ``view``; they allocate nothing and are never
    kept. Other decompositions are not known to differ; a policy whose operators compile does not run keeps
    fewer, and the compiled step's memory is measured either way: Note [Compiled steps].)

    One instance counts one pass over a unit's forward: ``key`` names each operator call in order."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)
        #: storages written by random operators in place (the eager dropout's mask)
        self.noise: set[int] = set()

    def key(self, func, args: tuple, kwargs: dict) -> str | None:
        """This call's name, or None for the product of a random operator's output (not named, never kept)."""
        if draws_random(func, args, kwargs):
            self.noise.update(storage_key(t) for t in tree_flatten(written_arguments(func, args, kwargs))[0]
                              if isinstance(t, torch.Tensor))
        elif self.noise and func is torch.ops.aten.mul.Tensor and any(
                isinstance(t, torch.Tensor) and storage_key(t) in self.noise for t in args):
            return None
        name = str(func)
        k = self.counts[name]
        self.counts[name] = k + 1
        return op_key(name, k)


def keep_ops_contexts(saved_ops: tuple[str, ...], keep_random: bool = False):
    """The ``context_fn`` of a selective checkpoint, bound as ``functools.partial(keep_ops_contexts, saved_ops)``:
    keep the outputs of the operators in ``saved_ops`` (``"aten.addmm.default#1"``: the 2nd call of that
    overload in the unit's forward), recompute the rest; with ``keep_random`` (under torch.compile) also keep
    every random operator's output (Note [Random operators under compile]). Each call (one per checkpointed call of the unit,
    or one per trace under torch.compile) counts its operators from 0 (Note [Under torch.compile])."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep, names = frozenset(saved_ops), defaultdict(PolicyNames)

    def policy(ctx, func, *args, **kwargs):
        # older torch versions also ask the policy during the recomputation (ctx.is_recompute), which
        # must count its operators from 0 again; torch 2.13 asks only in forward
        key = names[bool(getattr(ctx, "is_recompute", False))].key(func, args, kwargs)
        if draws_random(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE if keep_random else CheckpointPolicy.PREFER_RECOMPUTE
        if key in keep:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _policy_code() -> str:
    """A digest of the code that decides what a policy keeps (it keys compiled policies in AOTAutograd's cache)."""
    import hashlib
    import inspect

    code = "".join(inspect.getsource(f) for f in (keep_ops_contexts, PolicyNames, draws_random))
    return hashlib.sha256(code.encode()).hexdigest()[:16]


_POLICY_CODE = _policy_code()


def compiled_policy(saved_ops: tuple[str, ...]) -> Callable:
    """The ``context_fn`` under torch.compile: keep ``saved_ops`` and every random operator's output (Note
    [Random operators under compile]), keyed for AOTAutograd's cache by what it keeps and the code deciding it
    (``remat._compat.cacheable_context_fn``). Made when a forward is installed, not while Dynamo traces it."""
    return cacheable_context_fn(functools.partial(keep_ops_contexts, saved_ops, True),
                                f"remat-policy:{_POLICY_CODE}:{','.join(saved_ops)}:keep-random")


#: the policy of whole units, segments and regions under torch.compile: every random operator's output kept
KEEP_RANDOM = compiled_policy(())


def keep_ops(saved_ops: Iterable[str]) -> Callable:
    """The ``context_fn`` that keeps ``saved_ops`` (a function, as torch.compile requires)."""
    return functools.partial(keep_ops_contexts, tuple(saved_ops))


def parse_unit(name: str) -> tuple[str, tuple[int, int] | None]:
    """``"blocks[0:2]"`` -> ``("blocks", (0, 2))``; ``"h.3"`` and ``"h.3@ops2"`` -> ``("h.3", None)``."""
    name = name.partition(SELECTIVE)[0]
    seg = parse_segment(name)
    return (name, None) if seg is None else seg


def _checkpointed_call(fn: Callable, args: tuple, kwargs: dict, buffers: list[torch.Tensor],
                       preserve_rng_state: bool, timer, saved_ops: tuple[str, ...] | None = None,
                       compiled: Callable | None = None) -> object:
    """``fn(*args, **kwargs)`` under non-reentrant checkpoint, replaying ``buffers`` (Note [Buffers replay]);
    under torch.compile with the policy ``compiled`` (:func:`compiled_policy`; None: ``KEEP_RANDOM``)."""
    if torch.compiler.is_compiling():  # Note [Under torch.compile], Note [Random operators under compile]
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                          context_fn=compiled if compiled is not None else KEEP_RANDOM, **kwargs)
    options = {} if saved_ops is None else {"context_fn": keep_ops(saved_ops)}
    before = [b.detach().clone() for b in buffers]
    calls = 0
    # a selective recomputation runs under its cache's dispatch mode, which refuses operators the forward
    # did not run: the replay's clones and copies must not reach it (Note [Buffers replay])
    unseen = outside_dispatch_modes if saved_ops is not None else contextlib.nullcontext

    def replay(*a, **kw):
        if not buffers:
            return fn(*a, **kw)
        with torch.no_grad(), unseen():
            after = [b.detach().clone() for b in buffers]
            for b, v in zip(buffers, before):
                b.copy_(v)
        try:
            return fn(*a, **kw)
        finally:
            with torch.no_grad(), unseen():
                for b, v in zip(buffers, after):
                    b.copy_(v)

    def run(*a, **kw):
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*a, **kw)
        if timer is not None:
            with timer():
                return replay(*a, **kw)
        return replay(*a, **kw)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **options, **kwargs)


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
        saved_ops: Iterable[str] | None = None, policy: str = "",
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
        #: the policy under torch.compile (Note [Random operators under compile])
        self.compiled = None if self.saved_ops is None else compiled_policy(self.saved_ops)

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
            compiled=self.compiled)))


class SegmentedForward(_RematForward):
    """The ``forward`` remat installs on an ``nn.Sequential`` to checkpoint runs of its children."""

    def __init__(self, module: nn.Sequential, segments: Iterable[tuple[int, int]], *,
                 preserve_rng_state: bool = True,
                 buffers: dict[tuple[int, int], tuple[str, ...] | None] | None = None) -> None:
        self.module = module
        self.segments = tuple(sorted(segments))
        self.preserve_rng_state = preserve_rng_state
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
            x = _checkpointed_call(run, (x,), {}, bufs, self.preserve_rng_state, None)
            k = stop
        return x

    def unit_names(self, name: str) -> list[str]:
        return [segment_name(name, i, j) for i, j in self.segments]

    def __reduce__(self):
        return (_rebuild, (SegmentedForward, dict(
            module=self.module, segments=self.segments, preserve_rng_state=self.preserve_rng_state,
            buffers=self.buffers, previous=self.previous)))


class RegionForward(_RematForward):
    """The ``forward`` remat installs on a module to checkpoint regions of its forward (Note [Regions] in
    remat.capture): it runs the module's traced graph, node by node as the forward would (each value
    dropped after its last use), with each chosen region under checkpoint."""

    def __init__(self, module: nn.Module, regions: Iterable[tuple[str, str | None]], *,
                 preserve_rng_state: bool = True,
                 buffers: dict[tuple[str, str | None], tuple[str, ...] | None] | None = None) -> None:
        self.module = module
        self.regions = tuple(regions)
        self.preserve_rng_state = preserve_rng_state
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
        (x,) = (*args, *kwargs.values())
        return self.program().run(x, self._checkpointed)

    def _checkpointed(self, region: tuple[str, str | None], fn: Callable, x, submodules: list[nn.Module]):
        names = self.buffers.get(region)
        bufs = _buffers(self.module, names) if names is not None else \
            [b for m in submodules for b in m.buffers() if b is not None]
        return _checkpointed_call(fn, (x,), {}, bufs, self.preserve_rng_state, None)

    def unit_names(self, name: str) -> list[str]:
        return [region_name(name, a, b) for a, b in self.regions]

    def __reduce__(self):
        return (_rebuild, (RegionForward, dict(
            module=self.module, regions=self.regions, preserve_rng_state=self.preserve_rng_state,
            buffers=self.buffers, previous=self.previous, _programs={})))


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


def checkpointed_modules(model: nn.Module) -> list[str]:
    """The units remat has checkpointed in ``model`` (module names and segments), in module order."""
    out = []
    for name, m in uncompiled(model).named_modules():
        f = m.__dict__.get("forward")
        while isinstance(f, _RematForward):  # a whole Sequential around its segments: both
            out += f.unit_names(name)
            f = f.previous
    return out


def check_units(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The names among ``names`` that are not units of ``model`` (missing modules, bad segments)."""
    mods = dict(model.named_modules())
    bad = []
    for n in names:
        region = parse_region(n)
        if region is not None:
            if is_selective(n) or region[0] not in mods or isinstance(mods[region[0]], nn.Sequential):
                bad.append(n)
            continue
        container, seg = parse_unit(n)
        if is_selective(n) and seg is not None:
            bad.append(n)
            continue
        m = mods.get(container)
        if m is None:
            bad.append(n)
        elif seg is not None and (not isinstance(m, nn.Sequential) or not 0 <= seg[0] < seg[1] <= len(m)):
            bad.append(n)
    return bad


def checkpoint_modules(
    model: nn.Module,
    names: Iterable[str],
    *,
    preserve_rng_state: bool = True,
    mutated_buffers: dict[str, Iterable[str]] | None = None,
    saved_ops: dict[str, Iterable[str]] | None = None,
) -> None:
    """Checkpoint the named units of ``model`` in place (mutates ``model``).

    A selective unit (``h.3@ops2``) needs its policy in ``saved_ops``: the operators whose outputs
    it keeps (Note [Selective checkpointing]; ``Plan.saved_ops``).

    ``mutated_buffers`` maps a unit to the names (relative to its module, or for a segment to its
    Sequential) of the buffers its forward mutates (Note [Buffers replay]); units not in it replay
    all their buffers. Parameter names, ``state_dict`` keys, parameter identity and module hooks
    are unchanged."""
    names = list(names)
    bad = check_units(model, names)
    if bad:
        raise PlanMismatchError(f"{type(model).__name__} has no unit named {bad}: name submodules by their "
                                "qualified names (model.named_modules()), segments as 'container[i:j]' and "
                                "regions as 'module[first_call:next_call]'")
    policies = saved_ops or {}
    missing = [n for n in names if is_selective(n) and n not in policies]
    if missing:
        raise InvalidInputError(f"selective units {missing} need their policy: pass saved_ops={{unit: operators "
                                "to keep}} (a Plan carries it in plan.saved_ops)")
    mods = dict(model.named_modules())
    mutated = mutated_buffers or {}
    segments: dict[str, list[tuple[int, int]]] = {}
    regions: dict[str, list[tuple[str, str | None]]] = {}
    for n in names:
        if (region := parse_region(n)) is not None:
            regions.setdefault(region[0], []).append(region[1:])
            continue
        container, seg = parse_unit(n)
        if seg is not None:
            segments.setdefault(container, []).append(seg)
    # regions first, like segments (Note [Regions] in remat.capture); all of them built, and so checked,
    # before any is installed
    region_forwards = {}
    for module, regs in regions.items():
        m = mods[module]
        if m.__dict__.get("forward") is not None:
            raise InvalidInputError(f"{module!r} already has a forward of its own on the instance "
                                    f"({type(m.__dict__['forward']).__name__}); cannot checkpoint regions of it "
                                    f"({[region_name(module, *r) for r in regs]}): call remove_checkpointing first")
        bufs = {r: (tuple(mutated[region_name(module, *r)]) if region_name(module, *r) in mutated else None)
                for r in regs}
        region_forwards[module] = RegionForward(m, regs, preserve_rng_state=preserve_rng_state, buffers=bufs)
        region_forwards[module].program()  # refuses a region the module's forward cannot be cut into
    for module, f in region_forwards.items():
        mods[module].forward = f
    # segments first: a Sequential checkpointed as a whole with segments nested inside (Note [Nested
    # checkpoints] in remat.costs.simulate) wraps its SegmentedForward
    for container, segs in segments.items():
        m = mods[container]
        if is_checkpointed(m):
            raise InvalidInputError(f"{container!r} is already checkpointed; cannot also checkpoint segments of "
                                    f"it ({segs}) around that: call remove_checkpointing first")
        bufs = {s: (tuple(mutated[segment_name(container, *s)]) if segment_name(container, *s) in mutated
                    else None) for s in segs}
        m.forward = SegmentedForward(m, segs, preserve_rng_state=preserve_rng_state, buffers=bufs)
    for n in names:
        container, seg = parse_unit(n)
        if parse_region(n) is not None:
            continue
        m = mods[container]
        if seg is None and not isinstance(m.__dict__.get("forward"), CheckpointedForward):
            bufs = tuple(mutated[n]) if n in mutated else None
            policy = n[len(container):]
            m.forward = CheckpointedForward(m, preserve_rng_state=preserve_rng_state, buffers=bufs,
                                            saved_ops=policies[n] if policy else None, policy=policy)
    keep_compiled_nothing_eager(model)


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


def checkpoint_plan(model: nn.Module, plan: Plan) -> None:
    """Checkpoint ``model`` in place as ``plan`` says: its units, with the buffers each replays and the
    policy of each selective unit (mutates ``model``; no compatibility check: see ``remat.apply_plan``)."""
    checkpoint_modules(model, plan.checkpointed, mutated_buffers=dict(plan.mutated_buffers),
                       saved_ops=dict(plan.saved_ops))


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undo remat's checkpointing everywhere in ``model`` (mutates it). Returns the units it undid."""
    undone = []
    for name, m in uncompiled(model).named_modules():
        f = m.__dict__.get("forward")
        while isinstance(f, _RematForward):
            if f.previous is not None:
                m.forward = f.previous
            else:
                del m.forward
            undone += f.unit_names(name)
            f = m.__dict__.get("forward")
        if m in _LEFT_EAGER:
            set_compiled_call(m, _LEFT_EAGER.pop(m))
    return undone
