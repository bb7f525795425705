"""The one memory simulator: the predicted peak of any plan, from a Profile (no torch).

Note [Memory model]
~~~~~~~~~~~~~~~~~~~
The profile records, after every operator of one plain training step, the bytes
allocated during the step that are still alive (``live_bytes``). Parameters,
buffers, the batch and the optimizer state are alive throughout (``fixed_bytes``).
Checkpointing a unit ``u`` changes that timeline in exactly two ways:

* every storage saved for backward *only* by operators inside ``u`` and created
  during ``u``'s forward (``u.drops``) dies once nothing in the forward uses it
  any more (``drop.free_from``) instead of living until ``u``'s backward
  (``u.recompute_at``). The unit's inputs stay alive: checkpoint keeps them.
* its inputs stay alive, held by the checkpoint, until the autograd graph is released (through
  the optimizer step), even where the plain step would have freed them earlier (``u.keeps``),
  and so do the RNG state and buffer snapshots the checkpoint takes.
* just before ``u``'s backward, its forward runs again, growing memory by
  ``u.recompute_peak_bytes`` (measured during the original forward) on top of
  what is alive then.

A module called more than once per step is checkpointed call by call: each call's drops last
until its own recomputation (``Drop.until_index``) and each call adds its own recompute row
(Note [Reused modules] in remat.costs.effects).

Units chosen together either are disjoint or nest (Note [Nested checkpoints]); either way their
effects add up: the predicted memory at every timeline index is a *linear* function of the 0/1
choices, one per unit checkpointed at the top level and one per (outer, inner) pair. This module
turns that function into a list of :class:`Row` (constant + coefficients); the
simulator takes their maximum for one plan and the ILP requires each to stay
within the budget, so both agree by construction. Between two consecutive
breakpoints (a ``free_from`` or a ``recompute_at``) the active drops are the same,
so only the largest ``live_bytes`` of each such segment needs a row.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from dataclasses import dataclass
from typing import Iterable, Mapping

from remat.costs.unit_costs import Profile, UnitCost, inner_unit, is_selective, nest_key, recompute_growth
from remat.errors import InvalidInputError

# Note [Nested checkpoints]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Non-reentrant checkpoints nest: a unit ``v`` checkpointed inside a checkpointed unit ``u`` saves its
# inputs through ``u``'s hooks (torch's ``_NoopSaveInputs``), so in the forward ``u`` drops everything
# either would (``v``'s drops are among ``u``'s). When ``u``'s backward starts, ``u``'s forward runs again,
# and inside it ``v`` is a checkpoint again: ``v``'s saved tensors are dropped once more as that
# recomputation passes ``v``, and come back only when ``v``'s own backward recomputes ``v`` (recomputation
# within recomputation, each level with its own early stop). So a nested pair ``u/v`` (``nest_key``)
# is one more 0/1 variable, allowed only with ``u`` chosen, whose effect is
#
# * during ``u``'s forward: what ``v`` alone does (``u`` drops its saved tensors once its forward is done,
#   ``v`` once its own is: a block's attention's before the block's MLP runs);
# * from the end of ``u``'s forward to ``u``'s recomputation: nothing beyond ``u``'s, except what ``v``'s
#   checkpoint itself holds (``v.keeps``: counted, an over-estimate of a few bytes);
# * from ``u``'s recomputation to ``v``'s: ``v``'s drops stay absent (what the unit alone would do
#   from its forward on);
# * during ``u``'s recomputation: the replayed forward grows memory by ``live[t] - live[start - 1]``
#   at each replayed operator ``t``, less ``v``'s drops already freed at ``t`` (a row per segment of
#   ``u``'s forward, instead of one row at ``u.recompute_peak_bytes``);
# * at ``v``'s recomputation: ``v.recompute_peak_bytes`` on top, and when ``v``'s backward is where
#   ``u``'s starts (``v`` ends ``u``), ``u``'s recomputed tensors are back already.
#
# Two levels: a unit is checkpointed at the top level or inside one top-level unit. Recompute time adds
# up per level (``v`` runs in ``u``'s recomputation and again in its own); ``u``'s early stop before a
# nested ``v`` at its end is not credited (time and memory predicted high, never low).


@dataclass(frozen=True)
class Row:
    """Predicted memory at one point of the step: ``const_bytes + sum(coef_bytes[u] for u in plan)``."""

    name: str
    #: "forward", "backward", "recompute" or "optimizer"
    phase: str
    #: timeline index the row describes
    index: int
    const_bytes: int
    #: per-unit change in bytes when that unit is checkpointed (negative: freed, positive: recompute)
    coef_bytes: Mapping[str, int]
    #: for a recompute row, the unit being recomputed
    unit: str | None = None


@dataclass(frozen=True)
class HeldTensor:
    """Something alive at a plan's predicted peak (Note [What holds the peak])."""

    #: "parameters", "gradients", "optimizer state" (the whole category), or "tensor" (one storage)
    kind: str
    nbytes: int
    #: a tensor's shape and dtype, the operator and innermost module that made it ("" for a category)
    shape: tuple[int, ...] = ()
    dtype: str = ""
    op: str = ""
    module: str = ""
    #: some plan could free it (saved inside a candidate unit); False: no checkpointing plan can
    freeable: bool = False
    #: why no plan frees it, or which units would
    why: str = ""

    def __str__(self) -> str:
        if self.kind != "tensor":
            return f"{self.kind}: {fmt_bytes(self.nbytes)} (no checkpointing plan frees them)"
        op = self.op.removeprefix("aten.").removesuffix(".default")
        made = f"{op} in {self.module}" if op and self.module else (op or "backward")
        return (f"{fmt_bytes(self.nbytes)} {self.dtype} {list(self.shape)} ({made}): "
                f"{'freeable' if self.freeable else 'no plan frees it'}, {self.why}")


def fmt_bytes(n: int | float) -> str:
    """Human-readable bytes (GiB above 1 GiB, else MiB); ``remat.solve.plan.fmt_bytes`` for the public one."""
    return f"{n / 2**30:.3f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


#: how many tensors the breakdown names (Note [What holds the peak])
HELD_TENSORS = 5


@dataclass(frozen=True)
class PeakBreakdown:
    """Where the bytes of a predicted peak go. All fields in bytes except ``phase``/``index``."""

    #: the predicted peak (bytes): the sum of the parts below
    total_bytes: int
    #: parameters
    params_bytes: int
    #: gradients alive at the peak
    grads_bytes: int
    #: the optimizer's state
    optimizer_state_bytes: int
    #: buffers
    buffers_bytes: int
    #: the batch
    inputs_bytes: int
    #: activations saved for backward and alive at the peak
    saved_activations_bytes: int
    #: everything else alive at the peak (outputs, gradients of activations, recomputed tensors)
    temporaries_bytes: int
    #: where in the step the peak happens, e.g. "backward" or "recompute of h.3"
    phase: str
    #: the timeline index (operator) of the peak
    index: int
    #: what holds the peak, largest first: parameters, gradients, optimizer state and the largest tensors
    #: alive then, each saying whether a plan could free it (Note [What holds the peak]); empty when the
    #: profile has no tensor list
    largest: tuple[HeldTensor, ...] = ()

    @property
    def unfreeable_bytes(self) -> int:
        """Bytes of ``largest`` (not of the whole peak) that no checkpointing plan frees."""
        return sum(h.nbytes for h in self.largest if not h.freeable)


class MemoryModel:
    """Predicted memory of every plan over one step, built once from a :class:`Profile`."""

    def __init__(self, profile: Profile, candidates: Iterable[str] | None = None, *, nesting: bool = False) -> None:
        """``nesting``: also offer units checkpointed inside a checkpointed unit (Note [Nested checkpoints])."""
        self.profile = profile
        names = [u.name for u in profile.candidates()] if candidates is None else list(candidates)
        self.units: dict[str, UnitCost] = {n: profile.unit(n) for n in names}
        #: per unit, the units that may be checkpointed inside it when it is checkpointed (Note [Nested
        #: checkpoints]); empty without nesting
        self.inner: dict[str, tuple[str, ...]] = self._inner_units() if nesting else {}
        #: the 0/1 choices of a plan: a unit checkpointed at the top level (its name) or inside another
        #: (``nest_key(outer, inner)``)
        self.variables: tuple[str, ...] = tuple(names) + tuple(
            nest_key(u, v) for u, inner in self.inner.items() for v in inner)
        #: per unit, per recomputation index (``until``): sorted ``free_from`` and prefix sums of bytes
        self._drops: dict[str, list[tuple[int, list[int], list[int]]]] = {}
        for name, u in self.units.items():
            by_until: dict[int, list] = {}
            for d in u.drops:
                until = u.drop_until(d)
                if until is not None:
                    by_until.setdefault(until, []).append(d)
            groups = []
            for until, drops in sorted(by_until.items()):
                drops.sort(key=lambda d: d.free_from)
                acc = [0]
                for d in drops:
                    acc.append(acc[-1] + d.nbytes)
                groups.append((until, [d.free_from for d in drops], acc))
            self._drops[name] = groups
        self.rows: tuple[Row, ...] = tuple(self._build_rows())

    # -- per unit ---------------------------------------------------------------------------
    def dropped_bytes(self, unit: str, index: int) -> int:
        """Bytes that checkpointing ``unit`` removes from memory at timeline ``index``."""
        return sum(prefix[bisect.bisect_right(free_from, index)]
                   for until, free_from, prefix in self._drops[unit] if index < until)

    def kept_bytes(self, unit: str, index: int) -> int:
        """Bytes that checkpointing ``unit`` keeps alive at timeline ``index`` beyond the plain step."""
        return sum(k.nbytes for k in self.units[unit].keeps if k.from_index <= index < k.until_index)

    def effect_bytes(self, unit: str, index: int) -> int:
        """Change in bytes at timeline ``index`` when ``unit`` is checkpointed at the top level."""
        return self.kept_bytes(unit, index) - self.dropped_bytes(unit, index)

    def _coefs(self, index: int) -> dict[str, int]:
        out = {}
        for name in self.units:
            b = self.effect_bytes(name, index)
            if b:
                out[name] = b
        for outer, inner in self.inner.items():
            u = self.units[outer]
            covered = u.forward_end < index < u.recompute_at  # Note [Nested checkpoints]
            for v in inner:
                b = self.kept_bytes(v, index) if covered else self.effect_bytes(v, index)
                if b:
                    out[nest_key(outer, v)] = b
        return out

    # -- nesting ------------------------------------------------------------------------------
    def _inner_units(self) -> dict[str, tuple[str, ...]]:
        """Per unit checkpointed once per step, the whole units called once whose forward lies strictly
        inside its forward, one level down: what may be checkpointed inside it."""
        def nestable(u: UnitCost) -> bool:
            return not is_selective(u.name) and u.calls == 1 and u.recompute_at is not None

        def container(u: UnitCost) -> str | None:
            return u.name.rpartition("[")[0] if u.is_segment else None

        def inside(v: UnitCost, u: UnitCost) -> bool:
            return u.forward_start <= v.forward_start and v.forward_end <= u.forward_end and \
                (v.forward_start, v.forward_end) != (u.forward_start, u.forward_end)

        out = {}
        for u in self.units.values():
            if not nestable(u):
                continue
            # a segment inside a segment of the same Sequential: one SegmentedForward runs both, it cannot nest
            allowed = [v for v in self.units.values() if nestable(v) and v.name != u.name and inside(v, u)
                       and (container(u) is None or container(u) != container(v))]
            # one level down only: the units inside ``u`` and inside no other of them (a block's attention and
            # MLP, a segment's blocks). Every deeper pair too made the MobileNet-style zoo model's problem 763
            # variables (97 without nesting) that CBC did not solve within its time limit
            # (regions of one module are siblings, not levels: one RegionForward runs them all, so a region
            # inside another one of the same module does not hide it)
            inner = tuple(v.name for v in allowed if not any(inside(v, w) for w in allowed if not w.is_region))
            if inner:
                out[u.name] = inner
        return out

    def outer_of(self, plan: Iterable[str]) -> dict[str, str]:
        """For a plan (unit names), each unit checkpointed inside another and that other unit. Raises
        InvalidInputError for units that overlap without nesting, or nest more than two levels deep."""
        chosen = frozenset(plan)
        self._check_known(chosen)
        out = {}
        for v in chosen:
            outers = [u for u in chosen if v in self.inner.get(u, ())]
            if len(outers) > 1 or (outers and any(outers[0] in self.inner.get(w, ()) for w in chosen)):
                raise InvalidInputError(f"plan nests {v!r} more than two levels deep (inside {sorted(outers)}); "
                                        "remat plans nest at most one unit level inside another")
            if outers:
                out[v] = outers[0]
        top = sorted(chosen - out.keys())
        groups: dict[str | None, list[str]] = {None: top}
        for v, u in out.items():
            groups.setdefault(u, []).append(v)
        for members in groups.values():
            members.sort()
            for i, a in enumerate(members):
                for b in members[i + 1:]:
                    if self.conflicts(a, b):
                        how = "nest more than one level deep or " if self.inner else ""
                        raise InvalidInputError(f"plan checkpoints {a!r} and {b!r}, which overlap; units must not "
                                                f"{how}overlap: keep one of them")
        return out

    def assignment(self, plan: Iterable[str]) -> frozenset[str]:
        """The variables (``self.variables``) a plan of unit names sets to 1."""
        outer = self.outer_of(plan)
        return frozenset(nest_key(outer[u], u) if u in outer else u for u in frozenset(plan))

    def units_of(self, variables: Iterable[str]) -> frozenset[str]:
        """The unit names a set of chosen variables checkpoints (inverse of ``assignment``)."""
        return frozenset(inner_unit(v) for v in variables)

    def cost_s(self, variable: str) -> float:
        """Predicted extra time of one variable: its unit's recompute and bookkeeping (seconds)."""
        return self.units[inner_unit(variable)].cost_s

    def inner_cliques(self, outer: str) -> list[list[str]]:
        """Sets of ``outer``'s inner units of which at most one may be checkpointed inside it."""
        inner = self.inner.get(outer, ())
        seen, out = set(), []
        for v in inner:
            start = self.units[v].forward_start
            group = frozenset(w for w in inner if self.units[w].forward_start <= start <= self.units[w].forward_end)
            if len(group) > 1 and group not in seen:
                seen.add(group)
                out.append(sorted(group))
        return out

    # -- rows ---------------------------------------------------------------------------------
    def _build_rows(self) -> list[Row]:
        p = self.profile
        live = p.live_bytes
        n = len(live)
        fixed = p.fixed_bytes
        rows: list[Row] = []
        if n == 0:
            return [Row("start", "forward", 0, fixed, {})]
        cuts = {0, n, p.backward_start}
        for u in self.units.values():
            cuts.update(at for at, _ in u.recomputations)
            cuts.update(d.free_from for d in u.drops if d.free_from < n and u.drop_until(d) is not None)
            for k in u.keeps:
                cuts.update((k.from_index, k.until_index))
        bounds = sorted(c for c in cuts if 0 <= c <= n)
        for lo, hi in zip(bounds, bounds[1:]):
            if hi <= lo:
                continue
            i = max(range(lo, hi), key=live.__getitem__)
            phase = "forward" if i < p.backward_start else "backward"
            rows.append(Row(f"{phase}_t{i}", phase, i, fixed + live[i], self._coefs(i)))
        outers: dict[str, list[str]] = {}
        for u, inner in self.inner.items():
            for v in inner:
                outers.setdefault(v, []).append(u)
        for name, u in self.units.items():
            for k, (at, peak) in enumerate(u.recomputations):
                i = max(at - 1, 0)
                coefs = self._coefs(i)
                suffix = f"_call{k + 1}" if u.later_calls else ""
                # the recomputation runs when operator ``at`` reads the unit's saved tensors, before it runs:
                # after the frees that follow operator ``at - 1`` (its transient gradients, e.g. the two
                # addends of a residual's gradient): the U-Net's least-memory plan was predicted 0.44% high
                base = live[i] if p.before_bytes is None or at >= n else min(live[i], p.before_bytes[at])
                for outer in outers.get(name, ()):  # Note [Nested checkpoints]: at the inner unit's recomputation
                    back = self.dropped_bytes(outer, i) - self.dropped_bytes(name, i) \
                        if i < self.units[outer].recompute_at else 0
                    key = nest_key(outer, name)
                    coefs[key] = coefs.get(key, 0) + peak + u.recompute_extra_bytes + back
                if name in self.inner:
                    rows += self._nested_recompute_rows(u, i, fixed + base, coefs)
                    continue
                coefs[name] = coefs.get(name, 0) + peak + u.recompute_extra_bytes
                rows.append(Row(f"recompute_{name}{suffix}", "recompute", i, fixed + base, coefs, unit=name))
        kept = {u: self.kept_bytes(u, n - 1) for u in self.units}
        kept.update({nest_key(u, v): self.kept_bytes(v, n - 1) for u, inner in self.inner.items() for v in inner})
        after = live[n - 1] if p.after_backward_bytes is None else p.after_backward_bytes
        rows.append(Row("optimizer_step", "optimizer", n - 1, fixed + after + p.optimizer_step_bytes,
                        {u: b for u, b in kept.items() if b}))
        return rows

    def _nested_recompute_rows(self, u: UnitCost, index: int, const_bytes: int,
                               coefs: dict[str, int]) -> list[Row]:
        """The rows of ``u``'s recomputation when units may be checkpointed inside it: one per stretch of
        its replayed forward between the points where an inner unit's drops or keeps change, each at the
        stretch's largest growth over the memory before ``u`` (Note [Nested checkpoints])."""
        live = self.profile.live_bytes
        start, end = u.forward_start, u.recompute_end if u.recompute_end is not None else u.forward_end
        inner = self.inner[u.name]
        cuts = {start, end + 1}
        for v in inner:
            cuts.update(d.free_from for d in self.units[v].drops)
            cuts.update(b for k in self.units[v].keeps for b in (k.from_index, k.until_index))
        bounds = sorted(c for c in cuts if start <= c <= end + 1)
        grown = recompute_growth(live, start, end, u.freed_outside)  # Note [Growth of a recomputation]
        rows = []
        for lo, hi in zip(bounds, bounds[1:]):
            t = max(range(lo, hi), key=lambda t: grown[t - start])
            row = dict(coefs)
            row[u.name] = row.get(u.name, 0) + max(grown[t - start], 0) + u.recompute_extra_bytes
            for v in inner:
                key = nest_key(u.name, v)
                row[key] = row.get(key, 0) + self.effect_bytes(v, t)
            rows.append(Row(f"recompute_{u.name}_t{t}", "recompute", index, const_bytes, row, unit=u.name))
        return rows

    # -- evaluation ---------------------------------------------------------------------------
    def row_bytes(self, row: Row, plan: Iterable[str]) -> int:
        """Predicted bytes of one row under ``plan``. A recompute row of an unchosen unit reduces to
        the plain memory at its index (never above the segment row covering that index)."""
        chosen = plan if isinstance(plan, (set, frozenset)) else set(plan)
        return row.const_bytes + sum(c for u, c in row.coef_bytes.items() if u in chosen)

    def peak_bytes(self, plan: Iterable[str]) -> int:
        """Predicted peak memory of the whole step with ``plan`` (unit names) checkpointed (bytes)."""
        chosen = self.assignment(plan)
        return max(self.row_bytes(r, chosen) for r in self.rows)

    def breakdown(self, plan: Iterable[str]) -> PeakBreakdown:
        """The predicted peak of ``plan`` split by category."""
        chosen = self.assignment(plan)
        p = self.profile
        row = max(self.rows, key=lambda r: self.row_bytes(r, chosen))
        total = self.row_bytes(row, chosen)
        i = row.index
        grads = p.grad_bytes[i] if p.live_bytes else 0
        effects = self._coefs(i)
        saved = (p.saved_bytes[i] if p.live_bytes else 0) + sum(effects.get(v, 0) for v in chosen)
        phase = row.phase if row.unit is None or row.unit not in chosen else f"recompute of {row.unit}"
        if phase == "recompute":
            phase = "backward"
        temporaries = total - p.fixed_bytes - grads - saved
        return PeakBreakdown(
            total_bytes=total,
            params_bytes=p.params_bytes,
            grads_bytes=grads,
            optimizer_state_bytes=p.optimizer_state_bytes,
            buffers_bytes=p.buffers_bytes,
            inputs_bytes=p.inputs_bytes,
            saved_activations_bytes=saved,
            temporaries_bytes=temporaries,
            phase=phase,
            index=i,
            largest=self.held_at(i, chosen, grads),
        )

    @functools.cached_property
    def _droppers(self) -> dict[int, list[str]]:
        """Per recorded storage, the candidate units that drop it (Note [What holds the peak])."""
        out: dict[int, list[str]] = {}
        for u in self.units.values():
            for d in u.drops:
                if d.storage is not None:
                    out.setdefault(d.storage, []).append(u.name)
        return out

    def held_at(self, i: int, chosen: frozenset[str], grads: int) -> tuple[HeldTensor, ...]:
        """Note [What holds the peak]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A least peak says only "temporaries 491 MiB" until it names what they are. Issue #23 guessed the
        logits (4 x 256 x 50,304 fp32, 196 MiB) at GPT-2 small size; the breakdown shows that with the
        weight-tied head the least peak (every block's) comes in backward, where the head's and the
        embedding's gradient contributions to the tied weight (two 50,304 x 768 fp32 tensors, 147 MiB each)
        are alive with the parameters, gradients and AdamW state: no checkpointing plan removes any of them
        (benchmarks/results/gpt2-small-cpu.md).
        At the peak's operator ``i`` the breakdown lists the fixed categories (parameters, optimizer state,
        gradients then alive) and the HELD_TENSORS largest of the profile's tensors (``Profile.tensors``)
        alive there with the plan's drops taken out, each with the operator and module that made it and
        whether some plan could free it: a storage some candidate unit drops (saved inside it, freed until
        its recomputation) is freeable; a gradient, a tensor made outside every module (the loss) or one no
        candidate drops (a unit's output, the head's logits) is not. Tensors a recomputation makes again
        are not in the recording: they are in ``temporaries``."""
        p = self.profile
        if not p.tensors:
            return ()
        droppers = self._droppers
        dropped: set[int] = set()
        for v in chosen:
            u = self.units[inner_unit(v)]
            for d in u.drops:
                until = d.until_index if d.until_index is not None else u.recompute_at
                if d.storage is not None and d.free_from <= i and (until is None or i < until):
                    dropped.add(d.storage)
        alive = [t for t in p.tensors if t.alloc_index <= i and (t.free_index is None or i < t.free_index)
                 and t.storage not in dropped and not t.is_grad]
        shaped_like: dict[tuple[int, ...], str] = {}
        for name, shape in p.parameter_shapes:
            shaped_like.setdefault(shape, name)
        held = [HeldTensor("parameters", p.params_bytes), HeldTensor("optimizer state", p.optimizer_state_bytes),
                HeldTensor("gradients", grads)]
        for t in alive[:HELD_TENSORS]:
            units = droppers.get(t.storage, [])
            if units:
                why = "saved inside " + ", ".join(sorted(units, key=len)[:3])
            elif t.alloc_index >= p.backward_start and (like := shaped_like.get(t.shape)):
                why = (f"a gradient made in backward shaped like parameter {like} (a contribution to a weight "
                       "used more than once, e.g. a tied embedding and head, before autograd sums it into .grad)")
            elif t.alloc_index >= p.backward_start:
                why = "an activation's gradient, made in backward"
            elif not t.module:
                why = "made outside every candidate unit (the model's own code or the loss)"
            else:
                why = f"not saved inside any candidate unit ({t.module}'s output, or a module no plan checkpoints)"
            held.append(HeldTensor("tensor", t.nbytes, t.shape, t.dtype, t.op, t.module, bool(units), why))
        return tuple(sorted((h for h in held if h.nbytes), key=lambda h: -h.nbytes))

    def recompute_s(self, plan: Iterable[str]) -> float:
        """Predicted extra time of ``plan``: the measured recompute time of its units plus checkpoint's
        measured bookkeeping per unit (seconds)."""
        return sum(self.units[u].cost_s for u in plan)

    def conflicts(self, a: str, b: str) -> bool:
        """Whether units ``a`` and ``b`` cannot be checkpointed together: one contains the other or
        they overlap (segments), i.e. their forward spans intersect."""
        ua, ub = self.units[a], self.units[b]
        return a == b or any(s1 <= e2 and s2 <= e1 for s1, e1 in ua.spans for s2, e2 in ub.spans)

    def ancestors(self, name: str) -> list[str]:
        """Candidate units whose forward contains ``name``'s (on equal spans, the one with the shorter name)."""
        u = self.units[name]
        out = []
        for v in self.units.values():
            if v.name == name or not (v.forward_start <= u.forward_start and u.forward_end <= v.forward_end):
                continue
            if (v.forward_start, v.forward_end) != (u.forward_start, u.forward_end) or len(v.name) < len(name):
                out.append(v.name)
        return out

    def cliques(self) -> list[list[str]]:
        """Sets of units of which at most one may be chosen: those whose span covers a unit's first
        operator. Every pair of intersecting spans shares one (the later start lies in both)."""
        seen, out = set(), []
        for u in self.units.values():
            for start, _ in u.spans:  # every call of a reused module (Note [Reused modules])
                group = frozenset(v.name for v in self.units.values() if any(s <= start <= e for s, e in v.spans))
                if len(group) > 1 and group not in seen:
                    seen.add(group)
                    out.append(sorted(group))
        return out

    def _check_known(self, plan: frozenset[str]) -> None:
        unknown = sorted(plan - self.units.keys())
        if unknown:
            raise InvalidInputError(f"not candidate units of this profile: {unknown}; the candidates are "
                                    "Planner(profile).model.units (units that may be checkpointed and free something)")


class WorstRankModel(MemoryModel):
    """The memory model of one plan run on every rank (Note [One plan for every rank] in remat.runtime.distributed):
    every rank's rows (its own timeline, its own shard and batch), so a plan's predicted peak is the largest
    over ranks and the ILP keeps every rank within the budget; a unit's recompute time is its largest over
    ranks (the slowest rank sets the pace). Candidates are the units every rank has."""

    def __init__(self, profiles: list[Profile], candidates: Iterable[str] | None = None, *,
                 nesting: bool = False) -> None:
        names = [u.name for u in profiles[0].candidates()] if candidates is None else list(candidates)
        names = [n for n in names if all(any(u.name == n for u in p.candidates()) for p in profiles)]
        self.members = [MemoryModel(p, names, nesting=nesting) for p in profiles]
        self.profile = profiles[0]
        first = self.members[0]
        self.units = {n: dataclasses.replace(u, recompute_s=max(m.units[n].recompute_s for m in self.members),
                                             overhead_s=max(m.units[n].overhead_s for m in self.members))
                      for n, u in first.units.items()}
        self._drops = first._drops
        # a nested pair every rank offers (the same model on every rank: all of them)
        self.inner = {u: kept for u, inner in first.inner.items()
                      if (kept := tuple(v for v in inner if all(v in m.inner.get(u, ()) for m in self.members)))}
        self.variables = tuple(names) + tuple(nest_key(u, v) for u, inner in self.inner.items() for v in inner)
        known = set(self.variables)
        self.rows = tuple(dataclasses.replace(row, name=f"rank{r}_{row.name}",
                                              coef_bytes={k: c for k, c in row.coef_bytes.items() if k in known})
                          for r, m in enumerate(self.members) for row in m.rows)

    def breakdown(self, plan: Iterable[str]) -> PeakBreakdown:
        """The breakdown of the rank where ``plan`` peaks highest."""
        chosen = frozenset(plan)
        return max((m.breakdown(chosen) for m in self.members), key=lambda b: b.total_bytes)
