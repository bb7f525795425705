"""The race beside the hand rules in a tradeoff table's rows (Note [Plans timed beside the hand rules] in
remat.api.hand_rules): a table times its plans anyway, so remat's row at a budget is compared with the hand rules on
those same rounds, not raced again per budget.

In: the table's ``(plan, budget, note)`` rows and the hand rules; what each plan measured. Out: the rows, each remat
row the plan or the hand rule measured faster than it, said in the row's note.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from remat.api.hand_rules import Timed, faster_of, timing_off
from remat.api.margins import name_of, rules_to_time
from remat.solve.plan import Plan


def remats_row(plan: Plan, granularity: str, budget_bytes: int, faster: Timed | None = None) -> tuple[Plan, int, str]:
    """remat's answer for a budget as a tradeoff table's row of remat's (``ilp`` or ``ilp-op``): the plan, the
    budget and the row's note. ``faster``: a hand rule the table's own rounds measured faster than the ILP's plan
    (:func:`faster_of`), which is then the row (the race of Note [Plans timed beside the hand rules], decided by the
    table's timing); a hand rule ``plan_checked`` fell back to is the row too."""
    ilp = "ilp" if granularity == "block" else "ilp-op"
    if faster is not None:
        return (dataclasses.replace(faster.rule, strategy=ilp, budget_bytes=budget_bytes), budget_bytes,
                f"{name_of(faster.rule)}, measured faster than the ILP's plan at this budget in this table's rounds "
                f"(median of {faster.rounds} pairs {faster.paired_s * 1e3:+,.1f} ms; Note [Plans timed beside the "
                "hand rules])")
    if plan.strategy == ilp:
        return plan, budget_bytes, ""
    return (dataclasses.replace(plan, strategy=ilp), budget_bytes, f"{name_of(plan)}, the plans predicted cheaper "
            "measured over the budget (Note [Least peak is a promise])")


def rows_beside_rules(rows: list[tuple[Any, int | None, str]], rules: list[Plan]) -> dict[int, list[Plan]]:
    """For a table of ``(plan, budget, note)`` rows (``tradeoff``'s), each remat row's hand rules to compare it with
    (:func:`rules_to_time`), by row index: the table times them with its plans, once however many budgets, and
    :func:`rows_decided` reads the race from those rounds. Empty with ``REMAT_TIME_HAND_RULES=0``."""
    if timing_off():
        return {}
    return {i: near for i, (plan, budget, _) in enumerate(rows) if budget is not None and isinstance(plan, Plan)
            and plan.strategy in ("ilp", "ilp-op") and (near := rules_to_time(plan, budget, rules))}


def rows_decided(rows: list[tuple[Any, int | None, str]], beside: dict[int, list[Plan]],
                 measured: Callable[[Plan], tuple[int, tuple[float, ...]]]) -> list[tuple[Any, int | None, str]]:
    """``rows`` with each remat row of ``beside`` replaced by the hand rule measured faster than its plan in the
    table's rounds (``measured(plan)``: its measured peak and step times), among those measured within the budget
    (:func:`remats_row` says so in the row's note)."""
    out = list(rows)
    for i, near in beside.items():
        plan, budget, _ = rows[i]
        fits = [(r, measured(r)[1]) for r in near if measured(r)[0] <= budget]
        results = faster_of(measured(plan)[1], fits) if fits and measured(plan)[1] else []
        if results and results[0].rule_faster:
            out[i] = remats_row(plan, "block" if plan.strategy == "ilp" else "op", budget, faster=results[0])
    return out
