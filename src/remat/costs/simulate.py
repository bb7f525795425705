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

Units chosen together either are disjoint or nest (Note [Nested checkpoints] in remat.costs.memory_rows);
either way their effects add up: the predicted memory at every timeline index is a *linear* function of
the 0/1 choices, one per unit checkpointed at the top level and one per (outer, inner) pair. This module
turns that function into a list of :class:`Row` (constant + coefficients); the
simulator takes their maximum for one plan and the ILP requires each to stay
within the budget, so both agree by construction. Between two consecutive
breakpoints (a ``free_from`` or a ``recompute_at``) the active drops are the same,
so only the largest ``live_bytes`` of each such segment needs a row.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from remat.costs.memory_rows import MemoryRows, Row
from remat.costs.offload import HostLink, exposed_copy_s, offloadable_units, offloaded_unit
from remat.costs.peak_breakdown import HeldTensor, PeakBreakdown, PeakExplainer, fmt_bytes  # noqa: F401 - fmt_bytes: solve.plan's
from remat.costs.unit_costs import Profile, UnitCost, inner_unit, nest_key
from remat.errors import InvalidInputError


class MemoryModel(MemoryRows, PeakExplainer):
    """Predicted memory of every plan over one step, built once from a :class:`Profile`: its rows come from
    :class:`~remat.costs.memory_rows.MemoryRows`, the breakdown of a peak from
    :class:`~remat.costs.peak_breakdown.PeakExplainer`."""

    def __init__(self, profile: Profile, candidates: Iterable[str] | None = None, *, nesting: bool = False,
                 offload: HostLink | None = None, parts: bool = True) -> None:
        """``nesting``: also offer units checkpointed inside a checkpointed unit (Note [Nested checkpoints] in
        remat.costs.memory_rows); ``offload``: also offer offloading units to host memory over that link (Note
        [Offload in the memory model] in remat.costs.offload), and with ``parts`` their parts too (Note [Offloaded
        parts]: the operator-level choice, offered at ``granularity="op"``)."""
        self.profile = profile
        names = [u.name for u in profile.candidates()] if candidates is None else list(candidates)
        self.units: dict[str, UnitCost] = {n: profile.unit(n) for n in names}
        #: per unit, the units that may be checkpointed inside it when it is checkpointed (Note [Nested
        #: checkpoints]); empty without nesting
        self.inner: dict[str, tuple[str, ...]] = self._inner_units() if nesting else {}
        #: the 0/1 choices of a plan: a unit checkpointed at the top level (its name) or inside another
        #: (``nest_key(outer, inner)``)
        self.link = offload
        self.offloads = offloadable_units(profile, self.units, offload, parts) if offload is not None else {}
        self.variables: tuple[str, ...] = tuple(names) + tuple(
            nest_key(u, v) for u, inner in self.inner.items() for v in inner) + tuple(self.offloads)
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

    # -- nesting ------------------------------------------------------------------------------
    def outer_of(self, plan: Iterable[str]) -> dict[str, str]:
        """For a plan (unit names), each unit checkpointed inside another and that other unit. Raises
        InvalidInputError for units that overlap without nesting, or nest more than two levels deep."""
        chosen = frozenset(v for v in plan if offloaded_unit(v) is None)
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
        """The variables (``self.variables``) a plan of unit names (and ``offload:`` names) sets to 1."""
        plan = frozenset(plan)
        outer = self.outer_of(plan)
        offloaded = frozenset(v for v in plan if offloaded_unit(v) is not None)
        unknown = sorted(offloaded - self.offloads.keys())
        if unknown:
            raise InvalidInputError(f"{unknown} cannot be offloaded in this model: the units that can are "
                                    f"{sorted(self.offloads) or 'none (offloading not offered)'}")
        for v in offloaded:
            clash = [u for u in plan - offloaded if self.conflicts(offloaded_unit(v), u)]
            if clash:
                raise InvalidInputError(f"plan offloads {offloaded_unit(v)!r} and checkpoints {clash}, which overlap "
                                        "it: a unit is kept, recomputed or offloaded, one of the three")
            twice = sorted(w for w in offloaded if w != v and self.conflicts(offloaded_unit(v), offloaded_unit(w)))
            if twice:
                raise InvalidInputError(f"plan offloads {v!r} and {twice}, which overlap: offload a unit, or one "
                                        "part of it (Note [Offloaded parts]), once, and nothing inside it besides")
        return frozenset(nest_key(outer[u], u) if u in outer else u for u in plan - offloaded) | offloaded

    def units_of(self, variables: Iterable[str]) -> frozenset[str]:
        """The unit names a set of chosen variables checkpoints, with ``offload:`` names for those it offloads
        (inverse of ``assignment``)."""
        return frozenset(v if offloaded_unit(v) is not None else inner_unit(v) for v in variables)

    def cost_s(self, variable: str) -> float:
        """Predicted extra time of one variable on its own: its unit's recompute and bookkeeping (seconds); an
        offload's wait for its whole copy back, which is less where the unit after it is offloaded too (the ILP's
        pairing terms; :meth:`exposed_copy_s` for a whole plan: Note [Exposed copies] in remat.costs.offload)."""
        if offloaded_unit(variable) is not None:
            return self.offloads[variable].stall_s
        return self.units[inner_unit(variable)].cost_s

    def offloaded_bytes(self, plan: Iterable[str]) -> int:
        """Bytes ``plan`` moves to host memory (each way) in one step."""
        return sum(self.offloads[v].nbytes for v in plan if v in self.offloads)

    def exposed_copy_s(self, plan: Iterable[str]) -> float:
        """Seconds of ``plan``'s host copies not hidden behind compute, the waits for copies back included (Note
        [Exposed copies] in remat.costs.offload)."""
        return exposed_copy_s({v: self.offloads[v] for v in plan if v in self.offloads}, self.profile.forward_s)

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

    def recompute_s(self, plan: Iterable[str]) -> float:
        """Predicted time ``plan``'s checkpointed units add (seconds): each unit's ``UnitCost.cost_s``, its
        recompute and checkpoint's bookkeeping, or its host's time for them where that is longer, and the host's
        extra time in its forward (Note [Host time in the plan]); its offloads cost :meth:`exposed_copy_s`."""
        return sum(self.units[u].cost_s for u in plan if offloaded_unit(u) is None)

    def extra_s(self, plan: Iterable[str]) -> float:
        """Predicted time ``plan`` adds to the plain step: recompute and exposed copies (seconds)."""
        plan = list(plan)
        return self.recompute_s(plan) + self.exposed_copy_s(plan)

    def conflicts(self, a: str, b: str) -> bool:
        """Whether units ``a`` and ``b`` (or ``offload:`` names) cannot be chosen together: one contains the other
        or they overlap (segments), i.e. their forward spans intersect."""
        ua, ub = self.units[offloaded_unit(a) or a], self.units[offloaded_unit(b) or b]
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
        offloaded: dict[str, list[str]] = {}
        for key, span in self.offloads.items():
            offloaded.setdefault(span.unit, []).append(key)
        for u in self.units.values():
            for start, _ in u.spans:  # every call of a reused module (Note [Reused modules])
                covering = [v.name for v in self.units.values() if any(s <= start <= e for s, e in v.spans)]
                group = frozenset(covering + [k for v in covering for k in offloaded.get(v, ())])
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
                 nesting: bool = False, offload: HostLink | None = None, parts: bool = True) -> None:
        names = [u.name for u in profiles[0].candidates()] if candidates is None else list(candidates)
        names = [n for n in names if all(any(u.name == n for u in p.candidates()) for p in profiles)]
        self.members = [MemoryModel(p, names, nesting=nesting, offload=offload, parts=parts) for p in profiles]
        self.profile = profiles[0]
        first = self.members[0]
        self.units = {n: dataclasses.replace(u, recompute_s=max(m.units[n].recompute_s for m in self.members),
                                             overhead_s=max(m.units[n].overhead_s for m in self.members))
                      for n, u in first.units.items()}
        self._drops = first._drops
        # a nested pair every rank offers (the same model on every rank: all of them)
        self.inner = {u: kept for u, inner in first.inner.items()
                      if (kept := tuple(v for v in inner if all(v in m.inner.get(u, ()) for m in self.members)))}
        self.link = offload
        # an offload every rank offers, its bytes the largest over ranks (the host link is each rank's own)
        self.offloads = {k: max((m.offloads[k] for m in self.members), key=lambda s: s.nbytes)
                         for k in first.offloads if all(k in m.offloads for m in self.members)}
        self.variables = tuple(names) + tuple(nest_key(u, v) for u, inner in self.inner.items() for v in inner) \
            + tuple(self.offloads)
        known = set(self.variables)
        self.rows = tuple(dataclasses.replace(row, name=f"rank{r}_{row.name}",
                                              coef_bytes={k: c for k, c in row.coef_bytes.items() if k in known})
                          for r, m in enumerate(self.members) for row in m.rows)

    def breakdown(self, plan: Iterable[str]) -> PeakBreakdown:
        """The breakdown of the rank where ``plan`` peaks highest."""
        chosen = frozenset(plan)
        return max((m.breakdown(chosen) for m in self.members), key=lambda b: b.total_bytes)
