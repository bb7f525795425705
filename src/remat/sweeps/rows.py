"""The rows of the tradeoff tables: one :class:`TradeoffRow` per strategy and budget, the budgets swept, and the row
of a budget no plan meets (part of :mod:`remat.sweeps`: :mod:`remat.sweeps.report` and :mod:`remat.sweeps.compiled`
fill them, :mod:`remat.sweeps.render` writes them out).

In: a planner (for the sweep), a strategy and budget (for an unreachable row). Out: :class:`TradeoffRow` values.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.solve import Planner


@dataclass(frozen=True)
class TradeoffRow:
    """One line of the tradeoff table. Bytes and seconds; ``predicted_*`` from the simulator,
    ``measured_*`` from real steps (None where not measured)."""

    #: the row's strategy: "none", "every_block", ..., "remat" (block-level ILP) or "remat-op" (selective units allowed)
    strategy: str
    #: the budget of a remat row (bytes); None for a hand rule
    budget_bytes: int | None
    #: the units checkpointed, in forward order
    checkpointed: tuple[str, ...]
    #: the memory model's peak for the plan (bytes); None for an infeasible row
    predicted_peak_bytes: int | None
    #: peak of real training steps with the plan (bytes)
    measured_peak_bytes: int | None
    #: the plain step measured while profiling plus the plan's predicted recompute (seconds)
    predicted_step_time_s: float | None
    #: median of the real timed steps (seconds)
    measured_step_time_s: float | None
    #: measured step time over the measured no-checkpointing step time, minus 1
    measured_overhead: float | None
    #: the ILP's time for a remat row (seconds); None for a hand rule
    solve_time_s: float | None
    #: "optimal", "fits", "baseline", "infeasible", ...
    status: str
    #: whether the measured peak is within the budget (None without a budget or a measurement)
    budget_met: bool | None
    #: why a row has no plan (an unreachable budget: the least achievable peak)
    note: str = ""
    #: every timed step (seconds); with interleaved timing, entry i of every row is from round i
    measured_step_times_s: tuple[float, ...] = ()
    #: under torch.distributed, each rank's measured peak (``measured_peak_bytes`` is the largest)
    measured_peak_per_rank_bytes: tuple[int, ...] = ()

    @property
    def units(self) -> int:
        return len(self.checkpointed)


#: table names of remat's own strategies
REMAT_STRATEGY = {"ilp": "remat", "ilp-op": "remat-op"}


@dataclass(frozen=True)
class Infeasible:
    """Stands for a plan that no budget-meeting solution exists for."""

    strategy: str


def budget_sweep(planner: Planner, points: int, *, least_bytes: int | None = None) -> list[int]:
    """``points`` budgets (bytes) evenly from the least achievable peak to the no-checkpointing peak: the
    planner's predicted least, or ``least_bytes`` (the least peak the check measures, Note [The sweep starts
    where the check meets it]) where that is higher."""
    lo, hi = max(planner.min_peak_bytes, least_bytes or 0), planner.baseline_peak_bytes
    if points <= 1 or hi <= lo:
        return [max(hi, lo)]
    return [int(lo + (hi - lo) * i / (points - 1)) for i in range(points)]


def infeasible_row(plan: "Infeasible", budget: int | None, note: str) -> TradeoffRow:
    return TradeoffRow(REMAT_STRATEGY.get(plan.strategy, plan.strategy), budget, (), None, None, None, None, None, None,
                       "infeasible", None, note)
