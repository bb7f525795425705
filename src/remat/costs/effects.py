"""What checkpointing each unit does to memory and time, derived from a Recording (no torch).

``unit_costs(recording, specs, ...)`` is the one place where a unit's memory effects are decided:
which saved storages it frees and until when (``Drop``), which inputs it holds longer (``Keep``),
where its recomputation runs and how much it adds (Note [Memory model] in ``remat.costs.simulate``).
The profiler only records; the simulator only adds up.
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from remat.costs.unit_costs import CallSpan, Drop, Keep, Made, UnitCost, recompute_growth
from remat.costs.recording import CheckpointOverhead, Recording, SavedTensor, UnitTimes
from remat.costs.peak_breakdown import largest_tensors  # noqa: F401 - re-exported

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnitSpec:
    """A unit to cost: a module (members = itself), a segment of a Sequential (members = its children) or a
    region of a module's forward (members = the submodules it calls; Note [Regions] in remat.capture),
    optionally selective (a policy that keeps some operators' outputs)."""

    name: str
    members: tuple[str, ...]
    #: the closest enclosing unit, or None
    parent: str | None
    #: prefix of buffer names relative to the unit's module (the Sequential's for a segment)
    scope: str
    #: for a selective unit (``h.3@ops2``), the forward operators (timeline indices) whose outputs its
    #: policy keeps (Note [Selective checkpointing] in remat.rewrite); None for a whole unit
    keep: frozenset[int] | None = None
    #: the same operators as the rewrite names them (``aten.addmm.default#1``)
    saved_ops: tuple[str, ...] = ()
    #: for a region, its forward operators (first and last timeline index); it holds what they saved
    region: tuple[int, int] | None = None

    @property
    def selective(self) -> bool:
        return self.keep is not None

    @property
    def segment(self) -> bool:
        return self.members != (self.name,) and not self.selective


@dataclass(frozen=True)
class _CallEffects:
    """What checkpointing one forward call of a unit does to memory."""

    recompute_at: int | None
    drops: tuple[Drop, ...]
    keeps: tuple[Keep, ...]
    #: first timeline index at which the checkpoint no longer holds the call's inputs
    release: int
    #: last forward operator the recomputation runs (Note [Early stop])
    recompute_end: int
    recompute_peak_bytes: int
    saved: frozenset[int]
    saved_count: int
    #: (index, bytes) of storages made before the call and freed during its recomputed stretch
    freed_outside: tuple[tuple[int, int], ...] = ()
    #: what the call makes that outlives it, and the last backward operator reading what it saved
    made: tuple[Made, ...] = ()
    backward_end: int | None = None


def unit_costs(
    rec: Recording, specs: Sequence[UnitSpec], *, times: UnitTimes | None = None,
    overhead: CheckpointOverhead | None = None, buffer_bytes: Mapping[str, int] | None = None,
) -> tuple[UnitCost, ...]:
    """The cost of checkpointing each unit of ``specs``: memory effects from ``rec``; times from
    ``times`` (measured per module) and ``overhead`` (checkpoint's bookkeeping), zero when not given;
    ``buffer_bytes`` (qualified buffer name -> bytes) sizes the buffer snapshots a checkpoint holds.

    Note [Reused modules]: a module called more than once per forward (a shared MLP, ALBERT's one
    layer) is checkpointed call by call (each call is its own checkpoint, recomputed when backward
    first reads a tensor saved by that call, with its own RNG state). Its cost is the sum of its
    calls': each call frees its own saved tensors until its own recomputation (``Drop.until_index``),
    keeps its own inputs, and adds its own recomputation row (``UnitCost.later_calls``)."""
    live = rec.timeline()
    saved_as: dict[int, list[SavedTensor]] = defaultdict(list)
    for t in rec.saved:
        if t.storage is not None:
            saved_as[t.storage].append(t)
    created_by = rec.created_by()
    frees = sorted((s.free_index, s.alloc_index, k, s.nbytes) for k, s in enumerate(rec.storages)
                   if s.free_index is not None)
    allocs = sorted((s.alloc_index, k) for k, s in enumerate(rec.storages))
    return tuple(_unit_cost(rec, spec, live, saved_as, created_by, times, overhead, buffer_bytes or {}, frees, allocs)
                 for spec in specs)


def _unit_cost(rec: Recording, spec: UnitSpec, live: tuple[int, ...], saved_as: dict[int, list[SavedTensor]],
               created_by: dict[int, int], times: UnitTimes | None, overhead: CheckpointOverhead | None,
               buffer_bytes: Mapping[str, int], frees: list[tuple[int, int, int, int]],
               allocs: list[tuple[int, int]]) -> UnitCost:
    members = spec.members
    first = members[0]
    member_set = frozenset(members)

    region = spec.region

    def inside(stack: tuple[str, ...], at: int) -> bool:
        if not member_set.isdisjoint(stack):
            return True
        # a region also holds what its module's own operators between its submodule calls did (a functional
        # ReLU); ``at``, the operator's index, is exact for those (a submodule call starts and ends a region)
        return region is not None and bool(stack) and stack[-1] == spec.parent and region[0] <= at <= region[1]

    forward_calls = len(rec.spans[first])
    calls = max(rec.calls[m] for m in members)
    if region is not None:
        spans = [region]
    elif len(members) == 1:
        spans = list(rec.spans[first])
    else:
        spans = [(rec.first_span(first)[0], rec.first_span(members[-1])[1])]

    def in_call(t: SavedTensor, c: int) -> bool:
        if not inside(t.stack, t.at - 1):  # a module's own operator saves once it has run: ``at`` is the next
            return False
        return len(spans) == 1 or t.calls[t.stack.index(first)] == c + 1

    inputs = rec.inputs.get(first, ())
    effects = [_call_effects(rec, spec, lambda t, c=c: in_call(t, c), start, end,
                             inputs[c] if c < len(inputs) else (),
                             live, saved_as, created_by, frees, allocs, until=len(spans) > 1)
               for c, (start, end) in enumerate(spans)]
    head = effects[0]
    start, end = spans[0]
    excluded, mutated = _exclusion(rec, spec, inside, start, calls, forward_calls)
    keeps = tuple(k for e in effects for k in e.keeps)
    forward_s, recompute_s, backward_s = _unit_times(rec, spec, times, start, end, head, mutated)
    # what the checkpoint itself holds per call (Note [Checkpoint holds its inputs]): the snapshot of the
    # buffers it replays (Note [Buffers replay] in remat.rewrite) and the RNG state it saves (the CPU's, 5 KB,
    # on a CPU device: made outside the dispatcher, counted by the CPU measurement through
    # remat._compat.rng_states_reported)
    held = sum(buffer_bytes.get(spec.scope + b, 0) for b in mutated)
    if held:
        keeps += (Keep(held, start, head.release),)
    if overhead is not None and overhead.held_bytes:  # one RNG state per checkpointed call
        keeps += tuple(Keep(overhead.held_bytes, s, e.release) for e, (s, _) in zip(effects, spans))
    # Note [Recomputation transients]: while a unit recomputes, checkpoint holds one more copy of the RNG state
    # (``fork_rng`` around the replay) and the replay holds the buffers' values to put back (Note [Buffers
    # replay] in remat.rewrite): on the ResNet zoo model, 5344 bytes missing from every recomputation's peak.
    # Not added for selective units, whose recomputation rows already count a policy's cached output twice
    # around the kept operators (tests/integration/test_buffers.py's BatchNorm blocks: +4.6% before, a known
    # over-estimate)
    extra = 0 if spec.selective else held + (overhead.held_bytes if overhead is not None else 0)
    overhead_s = _overhead_s(spec, overhead, effects, forward_calls, start, end)
    saved = frozenset(s for e in effects for s in e.saved)
    ends = [head.recompute_end if head.recompute_end is not None else end, *(b for _, b in spans[1:])]
    comm = _recomputed_collectives(rec, spec, spans, ends)
    return UnitCost(
        name=spec.name, parent=spec.parent, forward_s=forward_s, recompute_s=recompute_s, backward_s=backward_s,
        flops=sum(rec.flops.get(m, 0) for m in members), forward_start=start, forward_end=end,
        recompute_at=head.recompute_at, drops=tuple(d for e in effects for d in e.drops),
        recompute_peak_bytes=head.recompute_peak_bytes, saved_bytes=sum(rec.storages[s].nbytes for s in saved),
        excluded=excluded, mutated_buffers=tuple(sorted(mutated)), members=members if spec.segment else (),
        keeps=keeps, overhead_s=overhead_s, saved_ops=spec.saved_ops, recompute_end=head.recompute_end,
        recompute_extra_bytes=extra, recomputed_collectives=comm, freed_outside=head.freed_outside,
        later_calls=tuple(CallSpan(sp[0], sp[1], e.recompute_at, e.recompute_peak_bytes)
                          for sp, e in zip(spans[1:], effects[1:])),
        made=head.made, backward_end=head.backward_end,
        draws_random=any(op.random for a, b in spans for op in rec.forward_ops[a:b + 1]),
    )


def _exclusion(rec: Recording, spec: UnitSpec, inside, start: int, calls: int,
               forward_calls: int) -> tuple[str | None, set[str]]:
    """Why the unit may not be checkpointed (None: it may), and the buffers (relative to ``spec.scope``) its
    forward writes in place; ``inside(stack, at)`` says whether an operator ran inside the unit."""
    members = spec.members
    excluded = None
    if calls != forward_calls:
        excluded = f"called {calls} times per step, {forward_calls} in forward"
    elif forward_calls > 1 and spec.selective:
        excluded = "selective policies are per call sequence: not offered for a module called more than once"
    mutated: set[str] = set()
    for w in rec.writes:
        if not inside(w.stack, w.at):
            continue
        if w.preexisting is not None and w.preexisting[0] == "buffer" and \
                any(w.preexisting[1].startswith(m + ".") for m in members):
            mutated.add(w.preexisting[1][len(spec.scope):])
        elif w.preexisting is not None:
            excluded = excluded or f"modifies a tensor from outside the unit in place ({w.preexisting[0]} " \
                                   f"{w.preexisting[1]}, {w.op})"
        elif w.storage is not None and rec.storages[w.storage].alloc_index < start:
            excluded = excluded or f"modifies its input in place ({w.op})"
    if excluded and not spec.segment and not spec.selective:
        log.info("unit %s cannot be checkpointed: %s", spec.name, excluded)
    return excluded, mutated


def _unit_times(rec: Recording, spec: UnitSpec, times: UnitTimes | None, start: int, end: int,
               head: _CallEffects, mutated: set[str]) -> tuple[float, float, float | None]:
    """The unit's forward, recompute and backward times (seconds; zero, zero and None without ``times``);
    adds to ``mutated`` the buffers its members' forwards changed without an in-place write."""
    members = spec.members
    region = spec.region
    forward_s = recompute_s = 0.0
    backward_s = None
    if times is not None:
        # buffers a member's first forward changed without an in-place write in its schema (native_batch_norm)
        mutated |= {f"{m[len(spec.scope):]}.{b}" if spec.segment else b
                    for m in members for b in times.mutated_buffers.get(m, ())}
        forward_s = sum(times.forward_s.get(m, 0.0) for m in members)
        # a unit not recomputed while timing (nested, or a segment's members) recomputes as it runs forward
        recompute_s = sum(times.recompute_s.get(m, times.forward_s.get(m, 0.0)) for m in members)
        if region is not None:  # its operators' measured times (the functional ones between its submodules too)
            forward_s = recompute_s = sum(rec.forward_ops[i].seconds for i in range(start, end + 1))
            # the buffers its module's forward changed that belong to its submodules
            mutated |= {b for b in times.mutated_buffers.get(spec.parent, ())
                        if any(b.startswith(m[len(spec.scope):] + ".") for m in members)}
        if spec.keep is not None:
            # only the operators it does not keep run again: their share of the unit's measured op time
            recompute_s *= _recompute_share(rec, start, head.recompute_end, spec.keep)
        backward_s = None if spec.segment else times.backward_s.get(spec.name)
    return forward_s, recompute_s, backward_s


def _overhead_s(spec: UnitSpec, overhead: CheckpointOverhead | None, effects: Sequence[_CallEffects],
                forward_calls: int, start: int, end: int) -> float:
    """Checkpoint's measured bookkeeping for the unit, beyond the recompute (seconds; 0 without ``overhead``)."""
    overhead_s = 0.0
    if overhead is not None:
        overhead_s = overhead.per_call_s * forward_calls + \
            overhead.per_saved_tensor_s * sum(e.saved_count for e in effects)
        if spec.selective:
            overhead_s += overhead.per_selective_op_s * (end - start + 1)
    return overhead_s


def _recomputed_collectives(rec: Recording, spec: UnitSpec, spans: Sequence[tuple[int, int]],
                            ends: Sequence[int]) -> tuple[tuple[str, int], ...]:
    """The collectives the unit's recomputations run again (Note [Recomputed communication]), as (operator,
    bytes it makes), over each call from its first operator to ``ends`` (where its recomputation stops)."""
    comm = tuple((rec.forward_ops[i].name, sum(rec.storages[c].nbytes for c in rec.forward_ops[i].created
                                                if c is not None))
                 for (a, _), b in zip(spans, ends) for i in range(a, min(b, len(rec.forward_ops) - 1) + 1)
                 if is_collective(rec.forward_ops[i].name) and (spec.keep is None or i not in spec.keep))
    return comm


def _call_effects(rec: Recording, spec: UnitSpec, in_call, start: int, end: int, inputs: tuple[int, ...],
                  live: tuple[int, ...], saved_as: dict[int, list[SavedTensor]], created_by: dict[int, int],
                  frees: list[tuple[int, int, int, int]], allocs: list[tuple[int, int]], until: bool) -> _CallEffects:
    """What checkpointing one forward call ``start..end`` of a unit does to memory (Note [Memory model]
    in remat.costs.simulate); ``in_call(t)`` says whether saved tensor ``t`` was saved by that call. ``until``:
    the unit runs more than once, so each drop says when its own call is recomputed (Note [Reused
    modules])."""
    n = rec.n_ops
    mine = [t for t in rec.saved if in_call(t)]
    unpacks = [t.unpacked_at for t in mine if t.unpacked_at is not None]
    r_at = min(unpacks) if unpacks else None
    saved = frozenset(t.storage for t in mine if t.storage is not None)
    names = {} if until else rec.op_names(start, end)
    drops = []
    for s in sorted(saved):
        st = rec.storages[s]
        if st.is_grad or not (start <= st.alloc_index <= end) or r_at is None:
            continue
        # Note [Held storages]: a storage the plain step never frees is held by something besides
        # autograd (the output, the autocast cache's casts of the weights, a module attribute):
        # checkpointing does not free it either.
        if st.free_index is None or st.free_index >= n:
            continue
        # Note [Shared saved storages]: a storage that operators outside the unit also save
        # dies, once the unit is checkpointed, when the last of those releases it (just after
        # its backward operator first reads it); one that is never read back stays.
        outside = [t.unpacked_at for t in saved_as[s] if not in_call(t)]
        if any(t is None for t in outside):
            continue
        free_from = max(end + 1, rec.last_use.get(s, -1) + 1, max(outside, default=-1) + 1)
        if free_from >= r_at or st.free_index <= r_at:
            continue
        if spec.keep is not None and created_by.get(s) in spec.keep:
            continue  # a selective checkpoint keeps it
        drops.append(Drop(st.nbytes, free_from, r_at if until else None, storage=s, op=names.get(created_by.get(s))))
    # Note [Checkpoint holds its inputs]: non-reentrant checkpoint keeps the unit's inputs in its
    # recompute closure, alive while any tensor saved inside the unit waits to be read back: until
    # the unit's backward is done, or, when some saved tensor is never read (a node that no
    # gradient reaches), until the graph is released at the end of the step. Inputs the plain
    # step frees earlier are kept that long.
    release = max(unpacks) + 1 if unpacks and all(t.unpacked_at is not None for t in mine) else n
    keeps = tuple(
        Keep(rec.storages[s].nbytes, rec.storages[s].free_index, release)
        for s in dict.fromkeys(inputs)
        if r_at is not None and rec.storages[s].free_index is not None and rec.storages[s].free_index < release
    )
    kept_storages = [] if spec.keep is None else [s for s in range(len(rec.storages)) if created_by.get(s) in spec.keep]
    if spec.keep is not None and r_at is not None:
        # the selective checkpoint caches every output of a kept operator until the recomputation
        # reads it back, also those the plain step frees early (Note [Selective checkpointing])
        keeps += tuple(
            Keep(rec.storages[s].nbytes, rec.storages[s].free_index, r_at) for s in kept_storages
            if rec.storages[s].free_index is not None and rec.storages[s].free_index < r_at
        )
    # Note [Early stop]: non-reentrant checkpoint stops recomputing once the last tensor saved
    # inside the unit exists again, so what the unit allocates after that is not recomputed.
    end_rec = min(end, max((t.at - 1 for t in mine if t.at - 1 >= start), default=end))
    outside = freed_outside(frees, start, end_rec, exclude=frozenset(inputs))
    grown = recompute_growth(live, start, end_rec, outside)
    if spec.keep is not None:
        # a selective recomputation reuses the cached outputs of kept operators: they add nothing
        cached = [rec.storages[s] for s in kept_storages]
        grown = [g - sum(c.nbytes for c in cached if c.alloc_index <= i and (c.free_index is None or i < c.free_index))
                 for i, g in zip(range(start, end_rec + 1), grown)]
    peak_inc = max(grown, default=0)
    made = _made(rec, start, end, saved, saved_as, in_call, allocs)
    backward_end = max(unpacks) if unpacks and all(t.unpacked_at is not None for t in mine) else None
    return _CallEffects(r_at, tuple(drops), keeps, release, end_rec, max(peak_inc, 0), saved, len(mine), outside,
                        made, backward_end)


def _made(rec: Recording, start: int, end: int, saved: frozenset[int], saved_as: dict[int, list[SavedTensor]],
          in_call, allocs: list[tuple[int, int]]) -> tuple[Made, ...]:
    """The storages the call ``start..end`` makes that outlive it in the plain step (``UnitCost.made``): for
    each, whether the call saved it and what outside the call holds it (a later forward operator's use, a
    later operator's saved tensor until backward reads it back)."""
    out = []
    for _, s in allocs[bisect.bisect_left(allocs, (start, -1)):bisect.bisect_right(allocs, (end, len(rec.storages)))]:
        st = rec.storages[s]
        if st.is_grad or (st.free_index is not None and st.free_index <= end + 1):
            continue
        last = rec.last_use.get(s, -1)
        outside = tuple((t.stack, t.unpacked_at) for t in saved_as.get(s, ()) if not in_call(t))
        out.append(Made(st.nbytes, st.free_index, s in saved, last if last > end else None, outside))
    return tuple(out)


def freed_outside(frees: list[tuple[int, int, int, int]], start: int, end: int,
                  exclude: frozenset[int] = frozenset()) -> tuple[tuple[int, int], ...]:
    """Note [Growth of a recomputation]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A recomputation grows memory by what the replayed operators make and still hold, read off the plain
    forward as ``live[i] - live[start - 1]``. But the plain forward also frees, during the unit's forward,
    storages made before it: the previous residual's addends die as the next layer norm runs (``x = x +
    mlp(...)`` drops the old ``x`` when the next operator starts). A recomputation in backward frees none of
    them (they are long gone, or held by the checkpoint as its inputs), so those frees must not lower its
    growth. A module unit usually starts one operator after such a free; a region of a transformer block,
    ``h.2[ln_1:ln_2]``, starts at it: its recomputation was predicted 8,192 bytes low, one activation of the
    test zoo's GPT (issue #24.3; tests/integration/test_regions.py). The unit's own inputs are not among
    them: the checkpoint holds those, counted already (Note [Checkpoint holds its inputs]). ``frees``: (free
    index, alloc index, storage, bytes) of every freed storage, sorted; ``exclude``: the inputs' storages; the
    result: (free index, bytes) of the others made before ``start`` and freed from ``start`` to ``end``."""
    lo = bisect.bisect_left(frees, (start, -1, -1, -1))
    out = []
    for f, a, s, b in frees[lo:]:
        if f > end:
            break
        if a < start and s not in exclude:
            out.append((f, b))
    return tuple(out)


# Note [Recomputed communication]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under tensor parallelism a block's forward communicates (RowwiseParallel's all_reduce; under sequence
# parallelism all_gather and reduce_scatter), and recomputing the block in backward runs those collectives
# again: extra communication, not only extra FLOPs. The recording sees them (functional collectives,
# ``_c10d_functional.*``, with the bytes they make); each unit lists those its recomputation would run again
# (not a selective policy's kept operators), the plan says which units recompute communication and how many
# bytes, and the time is already in the unit's recompute cost: profiling times each recomputation for real,
# collectives and their waits included, so the ILP weighs communication as it weighs FLOPs, and a selective
# option that keeps a collective's output (as torchtitan's policy keeps reduce_scatter's) is costed without it.
_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def is_collective(op_name: str) -> bool:
    """Whether an operator (``_c10d_functional.all_reduce.default``) is a collective that communicates."""
    return op_name.startswith(("_c10d_functional.", "c10d.")) and any(c in op_name for c in _COLLECTIVES)


def _recompute_share(rec: Recording, start: int, end: int, keep: frozenset[int]) -> float:
    """Share of the measured forward time of operators ``start..end`` spent in operators a selective
    checkpoint runs again (those not in ``keep``); operators without a time count as 1 us."""
    total = again = 0.0
    for i in range(start, end + 1):
        t = rec.forward_ops[i].seconds if i < len(rec.forward_ops) and rec.forward_ops[i].seconds else 1e-6
        total += t
        if i not in keep:
            again += t
    return again / total if total > 0 else 1.0

