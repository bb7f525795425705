"""Strategies that turn a Profile into a Plan. None of them imports torch.

Every strategy returns the same :class:`remat.solve.plan.Plan`, so the hand rules are also
test oracles and table rows (as in checkmate). ``plan_for_budget`` is remat's own
(the ILP); the rest are the baselines users would otherwise reach for.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Iterable, Sequence

from remat.costs.offload import HostLink, offloaded_choice, offloaded_unit
from remat.costs.step_time import plan_step_time_s
from remat.costs.unit_costs import Profile, is_selective
from remat.errors import InfeasibleBudgetError, InvalidInputError, UnsupportedError
from remat.solve.calibrated import UNDER_COMPILE
from remat.solve.plan import Plan, fmt_bytes
from remat.costs.simulate import MemoryModel, WorstRankModel
from remat.solve.ilp import min_peak, solve_ilp

#: Note [Selective margin]: a selective unit's recompute time is derived (its operators' share of the
#: unit's measured time, plus a per-operator policy cost measured on tiny operators), not measured
#: itself, so it is less certain than a whole unit's. With granularity="op" the ILP's plan is used only
#: when it is predicted to save at least this share of the block-level plan's recompute for the same
#: budget; otherwise the block-level plan is returned (and said so in the plan's notes). Issue 6 asks
#: that op-level plans never measure slower than block-level ones.
SELECTIVE_MARGIN = 0.05


def block_units(model: MemoryModel) -> list[str]:
    """The model's repeated blocks, in forward order: candidate units that are numbered children of a
    container (``h.0``, ``layers.1``, ``down.2``) and not inside another numbered unit; the top-level
    candidates when there are none."""
    numbered = [u for u in model.units if u.rpartition(".")[2].isdigit() and not model.units[u].is_segment]
    blocks = [u for u in numbered if not any(u.startswith(v + ".") for v in numbered)]
    if len(blocks) >= 2:
        return blocks
    return [u for u in model.units
            if not model.ancestors(u) and not model.units[u].is_segment and not is_selective(u)]


def chen_segments(n: int) -> list[tuple[int, int]]:
    """Chen et al.'s sqrt(n) rule as ``checkpoint_sequential(functions, segments=round(sqrt(n)))``
    applies it: ``round(sqrt(n))`` equal segments, all but the last checkpointed."""
    k = max(1, round(math.sqrt(n)))
    size = n // k
    return [(s, s + size) for s in range(0, size * (k - 1), size)] if size >= 1 else []


#: Note [Warm start] in remat.solve.ilp: seconds CBC may search nested plans once it holds the best flat plan
NESTED_SEARCH_S = 1.0


def _shorter(limit_s: float | None, cap_s: float) -> float:
    return cap_s if limit_s is None else min(limit_s, cap_s)




class Planner:
    """Makes plans for one profile; the memory model and the least peak are computed once."""

    def __init__(self, profile: Profile, *, time_limit_s: float | None = 60.0, granularity: str = "block",
                 ranks: Sequence[Profile] | None = None, nesting: bool = True, regions: bool = True,
                 offload: HostLink | None = None) -> None:
        """``granularity``: "block" plans whole units only; "op" also lets units be checkpointed
        selectively (``name@ops<k>``: option k of the unit's menu of policies, which keep some
        operators' outputs and recompute the rest). ``ranks``: every rank's profile, in rank order, when
        one plan must fit every rank (Note [One plan for every rank] in remat.runtime.distributed). ``nesting``:
        plans may checkpoint units inside checkpointed units (Note [Nested checkpoints] in remat.costs.memory_rows).
        ``regions``: plans may checkpoint regions of a module's forward (Note [Regions] in remat.capture); off
        for compiled loops (Note [Compiled steps] in remat.solve.calibrated). ``offload``: plans may also offload
        units' activations to host memory over that link (Note [Offload in the memory model] in
        remat.costs.offload), and with granularity "op" also some of a unit's operator outputs (Note [Offloaded
        parts])."""
        if granularity not in ("block", "op"):
            raise InvalidInputError(f"granularity must be 'block' or 'op', got {granularity!r}")
        self.profile = profile
        self.granularity = granularity
        names = [u.name for u in profile.candidates()
                 if (granularity == "op" or not is_selective(u.name)) and (regions or not u.is_region)]
        self.nesting = nesting

        def model(candidates: list[str], nesting: bool = nesting) -> MemoryModel:
            parts = granularity == "op"  # offloading some of a unit's operator outputs (Note [Offloaded parts])
            if ranks:
                return WorstRankModel(list(ranks), candidates, nesting=nesting, offload=offload, parts=parts)
            return MemoryModel(profile, candidates, nesting=nesting, offload=offload, parts=parts)

        self.model = model(names)
        #: the block-level problem without nesting, whose plans start the nested solves (Note [Warm start]
        #: in remat.solve.ilp); built on first use
        self._flat: MemoryModel | None = None
        self._make_model = model
        #: the block-level model, for Note [Selective margin]
        self._block_model = self.model if granularity == "block" else model([n for n in names if not is_selective(n)])
        self.time_limit_s = time_limit_s
        self.baseline_peak_bytes = self.model.peak_bytes(())
        t0 = time.perf_counter()
        self._min_units, self.min_peak_bytes = min_peak(self.model, time_limit_s=time_limit_s)
        self.min_peak_solve_s = time.perf_counter() - t0

    # -- building plans ---------------------------------------------------------------------
    def make_plan(
        self,
        units: Iterable[str],
        strategy: str,
        *,
        budget_bytes: int | None = None,
        status: str = "heuristic",
        solve_time_s: float = 0.0,
        notes: tuple[str, ...] = (),
    ) -> Plan:
        """A Plan for exactly ``units`` with the simulator's predictions."""
        # forward order (an outer unit before the units nested in it); profile order among equals
        order = {u.name: (u.forward_start, -u.forward_end, i) for i, u in enumerate(self.profile.units)}
        every = tuple(sorted(set(units), key=lambda u: order[offloaded_unit(u) or u]))
        chosen = tuple(u for u in every if offloaded_unit(u) is None)
        offloaded = tuple(offloaded_choice(u) for u in every if offloaded_unit(u) is not None)
        parts = {offloaded_choice(u): self.model.offloads[u].ops for u in every
                 if u in self.model.offloads and self.model.offloads[u].ops}
        # Note [Exposed copies] in remat.costs.offload: the pairing the model priced, for the mechanism to install
        spans = [self.model.offloads[u] for u in every if u in self.model.offloads]
        ahead = {s.next_unit: s.unit for s in spans if s.next_unit in {t.unit for t in spans}}
        bd = self.model.breakdown(every)
        copy_s = self.model.exposed_copy_s(every)
        recompute_s = self.model.recompute_s(chosen)
        p = self.profile
        return Plan(
            strategy=strategy,
            checkpointed=chosen,
            budget_bytes=budget_bytes,
            predicted_peak_bytes=bd.total_bytes,
            baseline_peak_bytes=self.baseline_peak_bytes,
            min_peak_bytes=self.min_peak_bytes,
            breakdown=bd,
            # Note [Host time in the plan]: where the host is modelled, each phase the longer of its GPU's and
            # its host's time
            predicted_step_time_s=(plan_step_time_s(p, (p.unit(u) for u in chosen))
                                   if p.forward_host_s or p.backward_host_s else p.step_time_s + recompute_s) + copy_s,
            baseline_step_time_s=p.step_time_s,
            predicted_recompute_s=recompute_s,
            solver_status=status,
            solve_time_s=solve_time_s,
            capture_path=p.capture_path,
            device=p.device,
            optimizer=p.optimizer,
            output_alive=p.output_alive,
            grads_held=p.grads_held,
            grads_held_in_forward=p.grads_held_in_forward,
            world_size=p.world_size,
            wrapping=p.wrapping,
            notes=notes + p.notes + ((UNDER_COMPILE,) if chosen else ()) + _communication(p, chosen),
            # every unit: one that mutates no buffer replays none (Note [Buffers replay] in remat.rewrite)
            mutated_buffers={u: p.unit(u).mutated_buffers for u in chosen},
            saved_ops={u: p.unit(u).saved_ops for u in chosen if p.unit(u).saved_ops},
            nested_in=self.model.outer_of(chosen),
            tokens_per_step=p.tokens_per_step, model_flops=p.model_flops, peak_flops_per_s=p.peak_flops_per_s,
            offloaded=offloaded, offloaded_ops=parts, offload_ahead=ahead,
            predicted_offload_bytes=self.model.offloaded_bytes(every),
            predicted_exposed_copy_s=copy_s,
        )

    def infeasible(self, budget_bytes: int, *, least_bytes: int | None = None,
                   compiled: str = "", steps: int = 1, source: str = "", remedy: str = "") -> InfeasibleBudgetError:
        """The error for a budget below the least achievable peak, with that peak and its breakdown.
        ``least_bytes``: the least-memory plan's checked (measured) peak, when known (Note [Least peak
        is a promise] in remat.api); else its prediction. ``compiled``: how the loop compiles the model, when
        ``least_bytes`` was measured on compiled steps (Note [Compiled steps] in remat.solve.calibrated);
        ``steps``: how many real steps it was the largest of (Note [Steps under gloo] in remat.runtime.distributed);
        ``source``: where ``least_bytes`` comes from, when not from real steps (a modelled target's allocator replay);
        ``remedy``: what to do, where raising the budget cannot help (default: raise it to ``least_bytes``)."""
        least = self.make_plan(self._min_units, "least-memory")
        b = least.breakdown
        fixed = self.profile.fixed_bytes
        how = "predicted" if least_bytes is None else \
            (f"measured on {'one real step' if steps <= 1 else f'{steps} real steps, the largest'}; predicted "
             f"{fmt_bytes(self.min_peak_bytes)}") if not compiled else \
            f"measured on compiled steps ({compiled}); eager prediction {fmt_bytes(self.min_peak_bytes)}"
        how = f"{source}; predicted allocated {fmt_bytes(self.min_peak_bytes)}" if source else how
        least_bytes = self.min_peak_bytes if least_bytes is None else least_bytes
        every = self.every_nth_block(1)
        rule = " It equals checkpointing every block's prediction:" if every.checkpointed and \
            every.predicted_peak_bytes == self.min_peak_bytes else ""
        holds = (f"{rule} what holds it, as predicted (Note [What holds the peak] in remat.costs.peak_breakdown; "
                 f"no plan frees {fmt_bytes(b.unfreeable_bytes)} of the largest): " +
                 "; ".join(str(h) for h in b.largest[:4]) + ".") if b.largest else ""
        return InfeasibleBudgetError(
            f"budget {fmt_bytes(budget_bytes)} ({budget_bytes} bytes) is below the least peak any "
            f"checkpointing plan reaches: {fmt_bytes(least_bytes)} ({least_bytes} bytes, "
            f"{how}, at {b.phase}). Of the prediction, {fmt_bytes(fixed)} is memory no plan removes "
            f"(parameters {fmt_bytes(b.params_bytes)}, optimizer state {fmt_bytes(b.optimizer_state_bytes)}, "
            f"buffers {fmt_bytes(b.buffers_bytes)}, inputs {fmt_bytes(b.inputs_bytes)}), plus gradients "
            f"{fmt_bytes(b.grads_bytes)}, saved activations {fmt_bytes(b.saved_activations_bytes)} and "
            f"temporaries {fmt_bytes(b.temporaries_bytes)}.{holds} " + (remedy or (
                f"Raise budget_gb to at least {math.ceil(least_bytes / 2**30 * 1000) / 1000:.3f}, or shrink the "
                "batch.")),
            budget_bytes=budget_bytes,
            min_feasible_bytes=least_bytes,
        )

    # -- remat's strategy ----------------------------------------------------------------------
    def plan_for_budget(self, budget_bytes: int) -> Plan:
        """The least-recompute plan whose predicted peak is within ``budget_bytes`` (the ILP).

        Raises InfeasibleBudgetError when no plan fits."""
        if self.baseline_peak_bytes <= budget_bytes:
            return self.make_plan(
                (), "ilp" if self.granularity == "block" else "ilp-op", budget_bytes=budget_bytes, status="fits",
                notes=("the step fits the budget without checkpointing",),
            )
        if budget_bytes < self.min_peak_bytes:
            raise self.infeasible(budget_bytes)
        t0 = time.perf_counter()
        start, flat_status = self._flat_start(budget_bytes)
        limit = self.time_limit_s if start is None else _shorter(self.time_limit_s, NESTED_SEARCH_S)
        units, status, dt = solve_ilp(self.model, budget_bytes, time_limit_s=limit, fallback=self._min_units,
                                      start=start)
        if start is not None and status.startswith("feasible"):
            # (the flat plan's own status where it was not solved to the end: Note [Offload search])
            flat = f"; the flat plan {flat_status}" if flat_status.startswith("feasible") else ""
            status = f"at least as good as the best flat plan (nested search stopped at {NESTED_SEARCH_S:g} s{flat})"
        dt = time.perf_counter() - t0
        if units is None:  # cannot happen at or above the least peak: the least-memory plan fits
            raise self.infeasible(budget_bytes)
        notes: tuple[str, ...] = ()
        if self.granularity == "op" and any(is_selective(u) for u in units):
            block, block_status, block_dt = solve_ilp(self._block_model, budget_bytes, time_limit_s=limit,
                                                      start=start)
            dt += block_dt
            op_s, block_s = self.model.extra_s(units), None if block is None else self.model.extra_s(block)
            if block_s is not None and op_s > (1 - SELECTIVE_MARGIN) * block_s:
                notes = (f"the best op-level plan was predicted to save {1 - op_s / block_s:.1%} of the time the "
                         f"block-level plan adds (recompute, host time, exposed copies), under the "
                         f"{SELECTIVE_MARGIN:.0%} margin (Note [Selective margin]): "
                         "block-level plan kept",)
                units, status = block, block_status
        name = "ilp" if self.granularity == "block" else "ilp-op"
        return self.make_plan(units, name, budget_bytes=budget_bytes, status=status, solve_time_s=dt, notes=notes)

    def _flat_start(self, budget_bytes: int) -> tuple[frozenset[str] | None, str]:
        """The flat block-level problem's plan for ``budget_bytes``, to start the nested solves from (None: no
        nesting, or no flat plan fits), and its solver status."""
        if not self.model.inner:
            return None, ""
        if self._flat is None:
            self._flat = self._make_model([u for u in self.model.units if not is_selective(u)], nesting=False)
        units, status, _ = solve_ilp(self._flat, budget_bytes, time_limit_s=self.time_limit_s)
        return units, status

    # -- baselines -------------------------------------------------------------------------------
    def no_checkpointing(self) -> Plan:
        return self.make_plan((), "none", status="baseline")

    def every_nth_block(self, n: int = 1) -> Plan:
        """Checkpoint blocks 0, n, 2n, ... (n=1: every block, as HF's gradient_checkpointing_enable)."""
        blocks = block_units(self.model)
        name = "every_block" if n == 1 else f"every_{n}{_ordinal(n)}_block"
        return self.make_plan(blocks[::n], name, status="baseline")

    def greedy(self, budget_bytes: int) -> Plan:
        """Add units by most droppable bytes per second of recompute until the budget is met."""
        t0 = time.perf_counter()
        ranked = sorted(
            self.model.units.values(),
            key=lambda u: u.droppable_bytes / max(u.cost_s, 1e-9),
            reverse=True,
        )
        chosen: list[str] = []
        status = "infeasible"
        if self.model.peak_bytes(chosen) <= budget_bytes:
            status = "fits"
        for u in ranked:
            if status != "infeasible":
                break
            if any(self.model.conflicts(u.name, c) for c in chosen):
                continue
            chosen.append(u.name)
            if self.model.peak_bytes(chosen) <= budget_bytes:
                status = "heuristic"
        return self.make_plan(chosen, "greedy", budget_bytes=budget_bytes, status=status,
                              solve_time_s=time.perf_counter() - t0)

    def brute_force(self, budget_bytes: int, *, max_units: int = 18) -> Plan:
        """Exhaustive search over every valid set of candidates, nested ones included when the planner
        nests (a test oracle; small models only)."""
        units = list(self.model.units)
        if len(units) > max_units:
            raise UnsupportedError(f"brute force over {len(units)} units is too slow (max {max_units}): use "
                                   "plan_for_budget (the ILP) or raise max_units")
        t0 = time.perf_counter()
        best: tuple[float, int, tuple[str, ...]] | None = None
        for k in range(len(units) + 1):
            for combo in itertools.combinations(units, k):
                try:
                    self.model.outer_of(combo)
                except InvalidInputError:  # units that overlap, or nest deeper than plans do
                    continue
                if self.model.peak_bytes(combo) > budget_bytes:
                    continue
                key = (round(self.model.recompute_s(combo), 12), k, combo)
                if best is None or key[:2] < best[:2]:
                    best = key
        if best is None:
            raise self.infeasible(budget_bytes)
        return self.make_plan(best[2], "brute_force", budget_bytes=budget_bytes, status="optimal",
                              solve_time_s=time.perf_counter() - t0)

    def least_memory(self) -> Plan:
        """The cheapest plan among those with the least predicted peak."""
        return self.plan_for_budget(self.min_peak_bytes)

    def chen_sqrt(self) -> Plan | None:
        """Chen et al.'s sqrt(n) segments over the longest nn.Sequential whose segments were profiled
        (what ``checkpoint_sequential`` does); None when the model has no such container."""
        containers: dict[str, list[int]] = {}  # container -> [children seen, bytes its segments free]
        for u in self.model.units.values():
            if u.is_segment and not u.is_region:
                container, _, rng = u.name.rpartition("[")
                entry = containers.setdefault(container, [0, 0])
                entry[0] = max(entry[0], int(rng[:-1].split(":")[1]))
                entry[1] += u.droppable_bytes
        for container, (n, _) in sorted(containers.items(), key=lambda kv: kv[1], reverse=True):
            names = [f"{container}[{i}:{j}]" for i, j in chen_segments(n)]
            if names and all(nm in self.model.units for nm in names):
                return self.make_plan(names, "chen_sqrt", status="baseline")
        return None

    def draws_random(self, units: Iterable[str]) -> bool:
        """Whether any of ``units`` runs an operator that draws random numbers (its plan compiles two ways: Note
        [Two programs per plan] in remat.solve.calibrated)."""
        return any(self.profile.unit(u).draws_random for u in units)

    def baselines(self) -> list[Plan]:
        """The usual hand rules: no checkpointing, every block, every 2nd block, and Chen's sqrt(n)
        segments where the blocks sit in an nn.Sequential."""
        plans = [self.no_checkpointing(), self.every_nth_block(1), self.every_nth_block(2)]
        chen = self.chen_sqrt()
        return plans + ([chen] if chen is not None else [])


def _ordinal(n: int) -> str:
    return {1: "st", 2: "nd", 3: "rd"}.get(n if n < 20 else n % 10, "th")


def _communication(profile: Profile, chosen: Sequence[str]) -> tuple[str, ...]:
    """Note [Recomputed communication] in remat.costs.effects: which units recompute collectives, and how much."""
    per_unit = [(u, profile.unit(u).recomputed_collectives) for u in chosen if profile.unit(u).recomputed_collectives]
    if not per_unit:
        return ()

    def summary(ops: tuple[tuple[str, int], ...]) -> str:
        counts: dict[str, int] = {}
        for name, _ in ops:
            short = name.split(".")[1] if "." in name else name
            counts[short] = counts.get(short, 0) + 1
        return ", ".join(f"{k} x{n}" for k, n in counts.items()) + f", {sum(b for _, b in ops):,} bytes"

    total = sum(b for _, ops in per_unit for _, b in ops)
    return (f"recomputes communication in backward: {len(per_unit)} unit(s) run {sum(len(o) for _, o in per_unit)} "
            f"collective(s) again, {total:,} bytes in all (" + "; ".join(f"{u}: {summary(o)}" for u, o in per_unit)
            + ("); their time is in the predicted step time (each recomputation was timed for real, collectives "
               "included: Note [Recomputed communication] in remat.costs.effects)" if not profile.target else
               "); their time is in the predicted step time: for a modelled target each is timed as a ring "
               "collective over the tensor-parallel group (Note [Device time model] in remat.costs.device_time)"),)
