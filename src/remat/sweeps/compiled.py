"""The tradeoff table for a compiled loop (Note [Compiled tradeoff]): every plan's peak measured on a compiled step,
remat's rows ``plan_compiled``'s plans, the step times those of compiled passes (part of :mod:`remat.sweeps`;
``remat.tradeoff(..., compile=...)`` comes here).

In: the model, its profile, the loop's compile settings, budgets. Out: :class:`~remat.sweeps.rows.TradeoffRow` rows.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from remat.api import checked_reading
from remat.check.compiled import CompiledComparison
from remat.errors import InfeasibleBudgetError
from remat.runtime.measure import model_device, split_inputs
from remat.solve import Planner
from remat.solve.calibrated import CompiledReading, Variant, plan_compiled
from remat.solve.plan import Plan, fmt_bytes
from remat.sweeps.rows import REMAT_STRATEGY, Infeasible, TradeoffRow, infeasible_row


def tradeoff_compiled(model, inputs, profile, *, loss_fn, budgets, points, warmup, repeats, granularities,
                       loop, say) -> list[TradeoffRow]:
    """Note [Compiled tradeoff]: the table for a compiled loop. Every plan's peak is measured on a compiled step
    (Note [Compiled steps] in remat.solve.calibrated; one measurement per distinct plan, shared by the hand
    rules and every budget), remat's rows are ``plan_compiled``'s plans, and the budgets run from the least
    compiled peak measured to the compiled no-checkpointing peak. Step times: ``repeats`` compiled forward and
    backward passes per plan after ``warmup``, on ``model`` itself (its gradients, buffers and RNG restored
    after each: no copy of the model), plus the optimizer step's profiled time."""
    args, kwargs = split_inputs(inputs)
    device = model_device(model)
    planners = {g: Planner(profile, granularity=g, regions=False) for g in granularities}
    first = planners[granularities[0]]
    measured: dict[Variant, int] = {}  # by Plan.variant
    programs: dict[Variant, int | None] = {}
    times: dict[Variant, tuple[float, ...]] = {}
    compare = CompiledComparison(loop)  # Note [Two programs per plan] in remat.solve.calibrated

    def measure(plan: Plan) -> CompiledReading:
        """The compiled peak; the step is timed in the same compile (each plan compiles once)."""
        say(f"compiling and measuring {plan.strategy} ({len(plan.checkpointed)} units"
            f"{', random operators recomputed' if plan.compiled_random == 'recompute' else ''})")

        def timed(call) -> None:
            times[plan.variant] = compiled_step_times(model, call, args, kwargs, loss_fn, device, profile,
                                                       warmup, repeats)

        return checked_reading(model, plan, args, kwargs, loss_fn, device, profile, loop, then=timed, compare=compare)

    plans: list[tuple[Plan | Infeasible, int | None, str]] = []
    for rule in first.baselines():
        if rule.checkpointed not in measured:
            reading = measure(rule)
            measured[rule.variant], programs[rule.variant] = reading.peak_bytes, reading.program_bytes
        plans.append((dataclasses.replace(rule, checked_peak_bytes=measured[rule.variant], compiled=str(loop)),
                      None, ""))
    if budgets is None:
        lo = min(measured.values())
        try:
            plan_compiled(first, 0, measure, loop=str(loop), measured=measured, programs=programs,
                          proved=compare.proved)
        except InfeasibleBudgetError as e:
            lo = e.min_feasible_bytes
        hi = measured[first.no_checkpointing().variant]
        budgets = [hi] if points <= 1 or hi <= lo else [int(lo + (hi - lo) * i / (points - 1)) for i in range(points)]
    for b in budgets:
        say(f"planning for {fmt_bytes(b)}")
        for g in granularities:
            try:
                plans.append((plan_compiled(planners[g], b, measure, loop=str(loop), measured=measured,
                                            programs=programs, proved=compare.proved),
                              b, ""))
            except InfeasibleBudgetError as e:
                plans.append((Infeasible("ilp" if g == "block" else "ilp-op"), b,
                              f"below the least achievable compiled peak {fmt_bytes(e.min_feasible_bytes)}"))
    plain = times.get(first.no_checkpointing().variant)
    plain_s = statistics.median(plain) if plain else None
    rows = []
    for plan, budget, note in plans:
        if isinstance(plan, Infeasible):
            rows.append(infeasible_row(plan, budget, note))
            continue
        ts = times[plan.variant]
        step_s = statistics.median(ts)
        peak = plan.checked_peak_bytes
        rows.append(TradeoffRow(
            strategy=REMAT_STRATEGY.get(plan.strategy, plan.strategy), budget_bytes=budget, checkpointed=plan.checkpointed,
            # a hand rule's compiled peak is not predicted: it is one of the measured points
            predicted_peak_bytes=plan.predicted_peak_bytes if budget is not None else None,
            measured_peak_bytes=peak, predicted_step_time_s=plan.predicted_step_time_s, measured_step_time_s=step_s,
            measured_overhead=step_s / plain_s - 1 if plain_s else None,
            solve_time_s=plan.solve_time_s if plan.strategy in REMAT_STRATEGY else None, status=plan.solver_status,
            budget_met=None if budget is None else peak <= budget,
            note="; ".join(n for n in (note or ("" if budget is not None else "compiled peak measured"),
                                       "random operators recomputed" if plan.compiled_random == "recompute" else "")
                           if n),
            measured_step_times_s=ts))
    return rows


def compiled_step_times(model, call, args, kwargs, loss_fn, device, profile, warmup: int,
                         repeats: int) -> tuple[float, ...]:
    """Seconds of ``repeats`` compiled forward-and-backward passes (``call``: the compiled forward, already
    compiled) after ``warmup`` more, each plus the optimizer step's profiled time (Note [Compiled tradeoff]).
    ``model``'s gradients, buffers and RNG state are as before."""
    from remat.runtime.measure import Clock, run_step, trainable_parameters
    from remat.runtime.state import fresh_grads, preserved

    clock = Clock(device)
    with preserved(model), torch.random.fork_rng(devices=[]):
        out = []
        for i in range(warmup + repeats):
            with fresh_grads(trainable_parameters(model)):
                s = clock.time(lambda: run_step(call, args, kwargs, loss_fn, output_alive=profile.output_alive))
            if i >= warmup:
                out.append(s + profile.optimizer_s)
        return tuple(out)
