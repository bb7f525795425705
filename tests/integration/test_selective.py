"""Selective (op-level) checkpointing: name@ops units keep matmul/attention outputs and recompute the rest."""

from __future__ import annotations

import pytest

import remat
from helpers import adam, case, descendant_calls, step_runner
from remat.solve import Planner


@pytest.mark.parametrize("units", [("h.0@ops", "h.1.mlp@ops", "h.2.attn"), ("h.0@ops", "h.1@ops", "h.2@ops")])
def test_selective_plans_predicted_equivalent_and_recomputed(units):
    c = case("gpt")
    planner = Planner(c.profile, granularity="op")
    plan = planner.make_plan(units, "hand")
    model, inputs, loss_fn = c.fresh()
    remat.apply_plan(model, plan)
    assert sorted(remat.checkpointed_modules(model)) == sorted(units)
    measured = remat.measure_step(model, inputs, loss_fn=loss_fn, optimizer_factory=adam, repeats=1)
    assert abs(plan.predicted_peak_bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes
    report = remat.check_equivalence(model, inputs, loss_fn=loss_fn)  # dropout is recomputed: RNG replays
    assert report.equal, str(report)
    counts = descendant_calls(model, [u.removesuffix("@ops") for u in units], step_runner(model, inputs, loss_fn))
    assert set(counts.values()) == {2}


def test_selective_saves_less_than_full_and_costs_less_recompute():
    p = case("gpt").profile
    full, sel = p.unit("h.1.mlp"), p.unit("h.1.mlp@ops")
    assert 0 < sel.droppable_bytes < full.droppable_bytes  # it keeps the matmul outputs
    assert sel.recompute_s < full.recompute_s  # and does not rerun the matmuls
    assert sel.overhead_s > full.overhead_s  # but pays its policy on every operator


@pytest.mark.parametrize("name", ["gpt", "resnet", "unet"])
def test_op_granularity_never_predicted_worse_than_block(name):
    c = case(name)
    block, op = Planner(c.profile), Planner(c.profile, granularity="op")
    assert op.min_peak_bytes <= block.min_peak_bytes
    for budget in c.budgets((0.0, 0.3, 0.6, 0.9)):
        a, b = block.plan_for_budget(budget), op.plan_for_budget(budget)
        assert b.predicted_recompute_s <= a.predicted_recompute_s + 1e-12
        assert b.predicted_peak_bytes <= budget


def test_optimize_checkpointing_with_op_granularity():
    c = case("gpt")
    model, inputs, loss_fn = c.fresh()
    budget = c.budgets((0.4,))[0]
    plan = remat.optimize_checkpointing(model, budget / 2**30, inputs, loss_fn=loss_fn,
                                        optimizer=adam(model.parameters()), granularity="op")
    assert plan.strategy == "ilp-op" and plan.checkpointed
    assert remat.measure_step(model, inputs, loss_fn=loss_fn, optimizer_factory=adam,
                              repeats=1).peak_bytes <= budget
    with pytest.raises(ValueError, match="granularity must be"):
        remat.optimize_checkpointing(model, 1.0, inputs, granularity="ops")
