"""The memory/step-time tradeoff: plans at a sweep of budgets and the hand rules, each measured.

``tradeoff`` profiles once, makes remat's plan at every budget plus the usual hand rules,
applies each distinct plan to the model, measures real training steps (peak memory and median
step time) and returns one :class:`TradeoffRow` per (strategy, budget). Predicted figures come
from the simulator; measured ones from :func:`remat.check.steps.measure_step`. The rows and the budget sweep are
:mod:`remat.sweeps.rows`' (``TradeoffRow`` and ``budget_sweep`` importable from here too), the table of a compiled loop
:mod:`remat.sweeps.compiled`'s, the rows written out (JSON, plots) :mod:`remat.sweeps.render`'s (``rows_to_json``,
``plot_rows``, ``plot_sizes``: importable from here too).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch
from torch import nn

from remat.api import plan_checked, prepare_hf_for_training, remats_row
from remat.api.checking import least_checked
from remat.api.table_rows import rows_beside_rules, rows_decided
from remat.runtime.compiled import compiled_loop
from remat.costs.unit_costs import Profile
from remat.errors import InfeasibleBudgetError
from remat.runtime.distributed import ranks_for
from remat.runtime.measure import OptimizerFactory, default_loss, model_device, split_inputs
from remat.check.steps import measure_plans, measure_step_in_place
from remat.solve.plan import Plan, fmt_bytes
from remat.rewrite import checkpoint_plan, remove_checkpointing
from remat.solve import Planner
from remat.sweeps.compiled import tradeoff_compiled
from remat.sweeps.render import plot_rows, plot_sizes, rows_to_json  # noqa: F401 - re-exported
from remat.sweeps.rows import REMAT_STRATEGY, Infeasible, TradeoffRow, budget_sweep, infeasible_row


def _measured_sweep(model, inputs, loss_fn, planners: dict[str, Planner], granularities, points: int,
                    ranks) -> tuple[list[int], dict[str, dict[tuple[str, ...], int]]]:
    """Note [The sweep starts where the check meets it]: each budget's plan is checked on a real step, and a
    budget below the least peak the check measures (the least-memory plan's, :func:`least_checked`) is refused.
    A prediction under the real step (on an H200, ``remat tradeoff gpt --device cuda`` predicted its least
    2.930 GiB and measured 2.957: workspaces and kernels the recorded step does not show) made the table's
    first budget one its own check refused. So the sweep starts at the measured least where that is above the
    predicted one, for every granularity with rows. Returns the budgets and, per granularity, the checked peaks
    read (by the plans' units), which the first budget's check reuses: the budget is met by the very reading it
    was set from, not by a second step that could read a few bytes more (the same real steps, none added)."""
    args, kwargs = split_inputs(inputs)
    device = model_device(model)
    checked: dict[str, dict[tuple[str, ...], int]] = {g: {} for g in granularities}
    measured = max(least_checked(model, args, kwargs, loss_fn, device, planners[g], planners[g].min_peak_bytes,
                                 ranks=ranks, checked=checked[g]) for g in granularities)
    return budget_sweep(planners["block"], points, least_bytes=measured), checked


def tradeoff(
    model: nn.Module,
    inputs: Any,
    profile: Profile,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    optimizer_factory: OptimizerFactory | None,
    budgets: list[int] | None = None,
    points: int = 6,
    warmup: int = 2,
    repeats: int = 5,
    warmup_s: float = 3.0,
    planner: Planner | None = None,
    hand_rules: list[Plan] | None = None,
    greedy: bool = False,
    interleave: bool | None = None,
    granularities: tuple[str, ...] = ("block",),
    progress: Callable[[str], None] | None = None,
    compile: bool | dict | None = None,
) -> list[TradeoffRow]:
    """Plan and measure. ``model`` must be plain (not checkpointed); it is checkpointed and restored
    in turn, and the measured steps train one deep copy of it (each plan applied to the copy in turn: one copy
    however many plans), so ``model`` ends as it started.

    Rows: ``hand_rules`` (default: ``planner.baselines()``), then per budget remat's checked plan
    and, with ``greedy``, the greedy plan for that budget. Step times are interleaved across plans
    (Note [Interleaved timing]) unless ``interleave`` is False; the default interleaves on CPU.

    ``compile`` (True, or a dict of ``torch.compile`` settings): every row is the compiled step's
    (:func:`tradeoff_compiled`): remat's plans as ``optimize_checkpointing(..., compile=...)`` makes them,
    predicted and measured peaks of compiled steps, step times of compiled forward and backward passes
    measured on ``model`` itself (restored after each) plus the optimizer step as profiled."""
    notes, undo = prepare_hf_for_training(model)  # every row is a training step as remat runs it (no KV cache)
    try:
        if compile:
            return tradeoff_compiled(model, inputs, profile, loss_fn=loss_fn or default_loss, budgets=budgets,
                                      points=points, warmup=warmup, repeats=repeats, granularities=granularities,
                                      loop=compiled_loop(model, model, compile), say=progress or (lambda m: None))
        return _tradeoff(model, inputs, profile, loss_fn=loss_fn, optimizer_factory=optimizer_factory,
                         budgets=budgets, points=points, warmup=warmup, repeats=repeats, warmup_s=warmup_s,
                         planner=planner, hand_rules=hand_rules, greedy=greedy, interleave=interleave,
                         granularities=granularities, progress=progress)
    finally:
        undo()


def _checked_plans(model, inputs, loss_fn, planners, granularities, budget: int, ranks,
                   checked: dict[str, dict[tuple[str, ...], int]] | None = None) -> list:
    """remat's checked plan for ``budget`` at each granularity, or a stand-in saying why there is none.
    ``checked``: peaks already read per granularity (plan_checked's ``checked``; copied, not filled)."""
    args, kwargs = split_inputs(inputs)
    out: list = []
    for gran in granularities:
        try:
            out.append(remats_row(plan_checked(model, args, kwargs, loss_fn, model_device(model), planners[gran], budget,
                                               ranks=ranks, checked=dict((checked or {}).get(gran, {}))), gran, budget))
        except InfeasibleBudgetError as e:
            out.append((Infeasible("ilp" if gran == "block" else "ilp-op"), budget,
                        f"below the least achievable peak {fmt_bytes(e.min_feasible_bytes)}"))
    return out


def _tradeoff_ranks(model, inputs, profile, ranks, planners, sweep, plans, *, loss_fn, optimizer_factory, warmup,
                    repeats, granularities, say, first_checked=None) -> list[TradeoffRow]:
    """Note [Tradeoff on every rank]. ``first_checked``: the peaks the sweep's first budget was set from."""
    loss_fn = loss_fn or default_loss
    for i, b in enumerate(sweep):
        say(f"planning for {fmt_bytes(b)}")
        plans += _checked_plans(model, inputs, loss_fn, planners, granularities, b, ranks,
                                first_checked if i == 0 else None)
    distinct: dict[frozenset[str], Plan] = {}
    for plan, _, _ in plans:
        if not isinstance(plan, Infeasible) and plan.solver_status != "infeasible":
            distinct.setdefault(frozenset(plan.checkpointed), plan)
    measured: dict[frozenset[str], tuple[tuple[int, ...], tuple[float, ...]]] = {}
    for i, (key, plan) in enumerate(distinct.items()):
        say(f"measuring {plan.strategy} ({len(plan.checkpointed)} units) on every rank [{i + 1}/{len(distinct)}]")
        checkpoint_plan(model, plan)
        try:
            m = measure_step_in_place(model, inputs, loss_fn=loss_fn, optimizer_factory=optimizer_factory,
                                      warmup=warmup, repeats=repeats, output_alive=profile.output_alive)
        finally:
            remove_checkpointing(model)
        peaks = tuple(ranks.gather(m.peak_bytes))
        times = ranks.gather(m.step_times_s)
        measured[key] = (peaks, tuple(max(ts) for ts in zip(*times)))  # the slowest rank's step sets the pace
    plain_time = statistics.median(measured[frozenset()][1]) if frozenset() in measured else None
    rows = []
    for plan, budget, note in plans:
        if isinstance(plan, Infeasible):
            rows.append(infeasible_row(plan, budget, note))
            continue
        peaks, times = measured[frozenset(plan.checkpointed)]
        step_s = statistics.median(times) if times else None
        rows.append(TradeoffRow(
            strategy=REMAT_STRATEGY.get(plan.strategy, plan.strategy), budget_bytes=budget, checkpointed=plan.checkpointed,
            predicted_peak_bytes=plan.predicted_peak_bytes, measured_peak_bytes=max(peaks),
            predicted_step_time_s=plan.predicted_step_time_s, measured_step_time_s=step_s,
            measured_overhead=step_s / plain_time - 1 if step_s is not None and plain_time else None,
            solve_time_s=plan.solve_time_s if plan.strategy in REMAT_STRATEGY else None, status=plan.solver_status,
            budget_met=None if budget is None else max(peaks) <= budget, note=note, measured_step_times_s=times,
            measured_peak_per_rank_bytes=peaks,
        ))
    return rows


def _tradeoff(model, inputs, profile, *, loss_fn, optimizer_factory, budgets, points, warmup, repeats, warmup_s,
              planner, hand_rules, greedy, interleave, granularities, progress) -> list[TradeoffRow]:
    # Note [Tradeoff on every rank]: a model trained by several processes (FSDP2, DDP) is planned for every
    # rank at once (gathered profiles, rank 0's plans) and measured in place, not on deep copies (which
    # sharded models do not support): it is trained by the measured steps; peaks are per rank
    wrapping, ranks = ranks_for(model, same=dict(budgets=budgets, points=points, granularities=granularities))
    profiles = ranks.gather(profile) if ranks is not None else None
    planner = planner or Planner(profile, ranks=profiles)
    say = progress or (lambda msg: None)
    rules = planner.baselines() if hand_rules is None else hand_rules
    plans: list[tuple[Plan | None, int | None, str]] = [(p, None, "") for p in rules]
    planners = {"block": planner}
    if "op" in granularities:
        planners["op"] = Planner(profile, granularity="op", ranks=profiles)
    first_checked = None
    if budgets is not None:
        sweep = budgets
    else:
        say("measuring the least-memory plan")
        sweep, first_checked = _measured_sweep(model, inputs, loss_fn or default_loss, planners, granularities,
                                               points, ranks)
    if ranks is not None:
        return _tradeoff_ranks(model, inputs, profile, ranks, planners, sweep, plans, loss_fn=loss_fn,
                               optimizer_factory=optimizer_factory, warmup=warmup, repeats=repeats,
                               granularities=granularities, say=say, first_checked=first_checked)
    for i, b in enumerate(sweep):
        say(f"planning for {fmt_bytes(b)}")
        plans += _checked_plans(model, inputs, loss_fn or default_loss, planners, granularities, b, None,
                                first_checked if i == 0 else None)
        if greedy:
            g = planner.greedy(b)
            plans.append((g, b, "" if g.solver_status != "infeasible" else "greedy found no plan within the budget"))

    # Note [Plans timed beside the hand rules] in remat.api.hand_rules: remat's rows raced by the table's own rounds
    beside = rows_beside_rules(plans, [planner.every_nth_block(1), planner.every_nth_block(2)])
    distinct: dict[frozenset[str], Plan] = {}
    for plan in [p for p, _, _ in plans] + [r for near in beside.values() for r in near]:
        if not isinstance(plan, Infeasible) and plan.solver_status != "infeasible":
            distinct.setdefault(frozenset(plan.checkpointed), plan)
    order = list(distinct.items())
    # Note [Warm-up]: the first steps of a process run slow (thread pools, allocator, clocks): on the
    # 2-core CPU this project is developed on, markedly so for the first dozen or so. Warm up first, with
    # the least-memory plan so that warming up fits wherever the plans do.
    # Note [Interleaved timing]: on a shared CPU, step times drift within a minute; timing the plans one
    # after another compares drifts, not plans. Round-robin one step of every plan per round and take the
    # median per plan. Every step runs on one copy of the model, each plan applied in turn (issue #23).
    least = min(distinct.values(), key=lambda p: p.predicted_peak_bytes)
    interleave = model_device(model).type == "cpu" if interleave is None else interleave
    results = measure_plans(model, inputs, [p for _, p in order], loss_fn=loss_fn, optimizer_factory=optimizer_factory,
                            warm_with=least, warmup_s=warmup_s, warmup=warmup, repeats=repeats, interleave=interleave,
                            output_alive=profile.output_alive, progress=say)
    measured: dict[frozenset[str], Any] = {key: m for (key, _), m in zip(order, results)}
    plain_time = measured[frozenset()].step_time_s
    plans = rows_decided(plans, beside, lambda p: (measured[frozenset(p.checkpointed)].peak_bytes,
                                                   measured[frozenset(p.checkpointed)].step_times_s))
    rows = []
    for plan, budget, note in plans:
        if isinstance(plan, Infeasible):
            rows.append(infeasible_row(plan, budget, note))
            continue
        name = REMAT_STRATEGY.get(plan.strategy, plan.strategy)
        if plan.strategy == "greedy" and plan.solver_status == "infeasible":
            rows.append(TradeoffRow("greedy", budget, plan.checkpointed, plan.predicted_peak_bytes, None, None, None,
                                    None, plan.solve_time_s, "infeasible", None, note))
            continue
        m = measured[frozenset(plan.checkpointed)]
        rows.append(TradeoffRow(
            strategy=name, budget_bytes=budget, checkpointed=plan.checkpointed,
            predicted_peak_bytes=plan.predicted_peak_bytes, measured_peak_bytes=m.peak_bytes,
            predicted_step_time_s=plan.predicted_step_time_s, measured_step_time_s=m.step_time_s,
            measured_overhead=m.step_time_s / plain_time - 1 if plain_time > 0 else None,
            solve_time_s=plan.solve_time_s if plan.strategy in REMAT_STRATEGY else None, status=plan.solver_status,
            budget_met=None if budget is None else m.peak_bytes <= budget, note=note,
            measured_step_times_s=tuple(m.step_times_s)))
    return rows
