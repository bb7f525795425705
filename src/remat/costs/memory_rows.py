"""The rows of the memory model: its predicted memory at every point of the step, as linear functions of a plan.

In: a :class:`~remat.costs.unit_costs.Profile` and its candidate units (:class:`~remat.costs.unit_costs.UnitCost`),
with the units that may nest inside each (Note [Nested checkpoints]). Out: the :class:`Row` list (constant +
coefficient per plan variable) that :class:`remat.costs.simulate.MemoryModel` takes the maximum of and the ILP
keeps within the budget (Note [Memory model] in remat.costs.simulate), and each unit's effect at any index.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping

from remat.costs.offload import OffloadSpan
from remat.costs.unit_costs import Profile, UnitCost, is_selective, nest_key, recompute_growth

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


class MemoryRows:
    """The row-building half of :class:`remat.costs.simulate.MemoryModel` (a base class of it): what each unit
    does at each timeline index, which units nest, and the rows. Reads the attributes the model sets."""

    profile: Profile
    units: dict[str, UnitCost]
    inner: dict[str, tuple[str, ...]]
    _drops: dict[str, list[tuple[int, list[int], list[int]]]]
    #: per offload variable (``offload:u``), when its drops are gone (Note [Offload in the memory model])
    offloads: dict[str, OffloadSpan]

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
        for key, span in self.offloads.items():
            if b := span.freed_at(index):
                out[key] = -b
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
        for span in self.offloads.values():
            cuts.update(span.cuts())
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
