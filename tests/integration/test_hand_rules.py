"""Note [Plans timed beside the hand rules] (issue #56): where a hand rule meets the budget and the time model
cannot tell it from the chosen plan, the one measured faster is returned."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import remat
import remat.api.hand_rules as hand_rules
from remat.api.hand_rules import TIMED_MARGIN, faster_of, rules_to_time
from remat.check.steps import time_plans_in_place
from remat.examples import make_gpt
from remat.rewrite.install import checkpointed_modules
from remat.runtime.measure import split_inputs
from remat.solve import Planner


@pytest.fixture(autouse=True)
def _timed(monkeypatch):
    monkeypatch.setenv("REMAT_TIME_HAND_RULES", "1")  # off in the rest of the suite (tests/conftest.py)


def gpt():
    return make_gpt(layers=4, batch_size=2, seq_len=32, d_model=64, heads=2, vocab=256, dropout=0.1)


@pytest.fixture(scope="module")
def planner() -> Planner:
    model, inputs, _ = gpt()
    return Planner(remat.make_profile(model, inputs, optimizer=torch.optim.AdamW(model.parameters())))


def test_a_rule_is_timed_only_within_the_margin_and_the_budget(planner):
    """rules_to_time decides from predictions alone: every block is timed beside a plan predicted faster by less
    than the margin where it fits the budget; not beside a plan predicted faster by more, nor over the budget, nor
    beside itself (the plans' predictions are set here)."""
    every = planner.every_nth_block(1)
    budget = every.predicted_peak_bytes
    rule = dataclasses.replace(every, predicted_step_time_s=1.0)
    near = dataclasses.replace(planner.every_nth_block(2), predicted_step_time_s=1.0 - TIMED_MARGIN / 2)
    far = dataclasses.replace(near, predicted_step_time_s=1.0 - 2 * TIMED_MARGIN)
    assert rules_to_time(planner, near, budget, [rule]) == [rule]
    assert rules_to_time(planner, near, budget - 1, [rule]) == []  # the rule is over the budget
    assert rules_to_time(planner, rule, budget, [rule]) == []  # the plan is the rule
    assert rules_to_time(planner, far, budget, [rule]) == []  # the model's margin is wide: trusted
    assert rules_to_time(planner, near, budget, [planner.no_checkpointing()]) == []  # not a rule that checkpoints


def test_the_rule_faster_in_the_median_of_the_pairs_wins(planner):
    """faster_of pairs round r of the plan with round r of the rule: a rule faster in the median of the pairs wins,
    one slow outlier of its own notwithstanding; the winner is listed first; pairs whose quartiles lie on both sides
    of 0 are undecided (more rounds are timed for them)."""
    every, second = planner.every_nth_block(1), planner.every_nth_block(2)
    plan_s = (1.00, 1.10, 0.90, 1.20, 1.00)
    results = faster_of(plan_s, [(second, (1.01, 1.11, 0.91, 1.21, 1.01)), (every, (0.95, 1.05, 0.85, 9.0, 0.95))])
    assert [t.rule for t in results] == [every, second]
    assert results[0].rule_faster and results[0].paired_s == pytest.approx(0.05)  # the outlier does not decide
    assert not results[1].rule_faster and results[1].paired_s == pytest.approx(-0.01)
    assert results[0].undecided and not results[1].undecided  # every pair of the second says the plan was faster
    assert results[0].plan_s == 1.0 and results[0].rule_s == pytest.approx(0.95)


def test_undecided_pairs_are_timed_again_up_to_the_most(planner, monkeypatch):
    """Rounds are added two at a time while the pairs cannot tell a rule from the plan, up to ROUNDS_MAX, and the
    decision is the median of all of them (the pairs given here: undecided after 5, 7 and 9 rounds, so 11 were timed;
    the rule faster in 9 of the 11)."""
    calls = []
    alternating = iter([(1.0, 1.1), (1.0, 0.9), (1.0, 1.1), (1.0, 0.9), (1.0, 0.9)] + [(1.0, 0.9)] * 6)

    def timings(model, plans, *args, rounds, **kwargs):
        calls.append(rounds)
        pairs = [next(alternating) for _ in range(rounds)]
        return [tuple(p for p, _ in pairs), tuple(r for _, r in pairs)] + [(2.0,) * rounds] * (len(plans) - 2)

    monkeypatch.setattr(hand_rules, "time_plans_in_place", timings)
    monkeypatch.setattr(hand_rules, "TIMED_MARGIN", 1.0)
    model, inputs, _ = gpt()
    plan = remat.optimize_checkpointing(model, planner.every_nth_block(1).predicted_peak_bytes * 1.02 / 2**30,
                                        inputs, optimizer=torch.optim.AdamW(model.parameters()))
    assert calls == [hand_rules.ROUNDS, 2, 2, 2] and sum(calls) == hand_rules.ROUNDS_MAX
    assert plan.choices == planner.every_nth_block(1).choices


@pytest.mark.parametrize("rule_faster", [True, False])
def test_optimize_checkpointing_returns_the_plan_measured_faster(planner, monkeypatch, rule_faster):
    """Just above every block's predicted peak the ILP's plan (never every block there: the last block's checkpoint
    buys no memory) is timed beside every block; the timings are given here (no timing asserts: which one a CPU
    runs faster is not the test's business) and the plan returned, applied and noted follows them. Fails where the
    chosen plan was returned whatever was measured."""
    every = planner.every_nth_block(1)
    seen = []

    def timings(model, plans, *args, **kwargs):
        seen.append([p.choices for p in plans])  # the plan, every block, and every 2nd block where it fits
        return [(1.0, 1.0, 1.0), (0.9, 0.9, 0.9) if rule_faster else (1.1, 1.1, 1.1)] + [(1.2, 1.2, 1.2)] * (len(plans) - 2)

    monkeypatch.setattr(hand_rules, "time_plans_in_place", timings)
    monkeypatch.setattr(hand_rules, "TIMED_MARGIN", 1.0)  # every rule within the budget is timed, whatever predicted
    model, inputs, _ = gpt()
    budget_gb = every.predicted_peak_bytes * 1.02 / 2**30
    plan = remat.optimize_checkpointing(model, budget_gb, inputs, optimizer=torch.optim.AdamW(model.parameters()))
    assert len(seen) == 1 and seen[0][1] == every.choices and seen[0][0] != every.choices
    assert (plan.choices == every.choices) is rule_faster
    note = next(n for n in plan.notes if "timed beside the hand rules" in n)
    assert ("so it is the plan returned" in note) is rule_faster and ("this plan kept" in note) is not rule_faster
    assert plan.checked_peak_bytes <= plan.budget_bytes
    assert sorted(checkpointed_modules(model)) == sorted(plan.checkpointed)  # applied as returned


def test_timing_in_place_leaves_the_model_as_it_was(planner):
    """time_plans_in_place runs real forward and backward passes on the model itself: its parameters, gradients
    (objects and values), buffers and RNG state are as before, and it is left without checkpointing."""
    model, inputs, _ = gpt()
    args, kwargs = split_inputs(inputs)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = copy.deepcopy(model.state_dict())
    grads = [(p.grad, p.grad.clone()) for p in model.parameters()]
    forwards = {name: m.forward for name, m in model.named_modules()}
    rng = torch.get_rng_state()
    times = time_plans_in_place(model, [planner.every_nth_block(1), planner.every_nth_block(2)], args, kwargs,
                                remat.default_loss, torch.device("cpu"), rounds=2)
    assert [len(t) for t in times] == [2, 2] and all(s > 0 for t in times for s in t)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is g and torch.equal(g, c) for p, (g, c) in zip(model.parameters(), grads))
    assert torch.equal(rng, torch.get_rng_state())
    assert {name: m.forward for name, m in model.named_modules()} == forwards


def test_the_timing_is_off_where_the_environment_says_so(planner, monkeypatch):
    """REMAT_TIME_HAND_RULES=0: the plan as the model ranks it, nothing timed (the rest of the suite's setting)."""
    monkeypatch.setenv("REMAT_TIME_HAND_RULES", "0")
    monkeypatch.setattr(hand_rules, "time_plans_in_place", lambda *a, **k: pytest.fail("timed"))
    monkeypatch.setattr(hand_rules, "TIMED_MARGIN", 1.0)
    model, inputs, _ = gpt()
    plan = remat.optimize_checkpointing(model, planner.every_nth_block(1).predicted_peak_bytes * 1.02 / 2**30,
                                        inputs, optimizer=torch.optim.AdamW(model.parameters()))
    assert not any("timed beside the hand rules" in n for n in plan.notes)


def test_a_second_call_reads_the_pairs_and_returns_the_same_plan(planner, monkeypatch):
    """docs/plans.md#reproducible-plans: the second call on the same step reads its times from the timing cache, so
    it reads the pairs the first call timed too (not timed again: another draw of the noise could return another
    plan) and returns the same plan."""
    every = planner.every_nth_block(1)
    calls = []

    def timings(model, plans, *args, **kwargs):
        calls.append(1)
        return [(1.0, 1.0, 1.0), (0.9, 0.9, 0.9)] + [(1.2, 1.2, 1.2)] * (len(plans) - 2)

    monkeypatch.setattr(hand_rules, "time_plans_in_place", timings)
    monkeypatch.setattr(hand_rules, "TIMED_MARGIN", 1.0)
    plans = []
    for _ in range(2):
        model, inputs, _ = gpt()
        plans.append(remat.optimize_checkpointing(model, every.predicted_peak_bytes * 1.02 / 2**30, inputs,
                                                  optimizer=torch.optim.AdamW(model.parameters())))
    assert len(calls) == 1 and plans[0].choices == plans[1].choices == every.choices
    notes = [next(n for n in p.notes if "timed beside the hand rules" in n) for p in plans]
    assert "(measured now)" in notes[0] and "read from remat's timing cache" in notes[1]


def test_the_tradeoff_tables_remat_row_is_the_plan_the_call_returns(planner, monkeypatch):
    """`remat tradeoff`'s row for remat at a budget is what optimize_checkpointing returns there: every block where it
    was measured faster (labelled remat, with a note saying so), not dropped from remat's rows."""
    every = planner.every_nth_block(1)
    monkeypatch.setattr(hand_rules, "time_plans_in_place",
                        lambda model, plans, *a, **k: [(1.0,) * 3, (0.9,) * 3] + [(1.2,) * 3] * (len(plans) - 2))
    monkeypatch.setattr(hand_rules, "TIMED_MARGIN", 1.0)
    model, inputs, _ = gpt()
    rows = remat.tradeoff(model, inputs, planner.profile, loss_fn=None, optimizer_factory=None,
                          budgets=[int(every.predicted_peak_bytes * 1.02)], granularities=("block",),
                          hand_rules=[planner.no_checkpointing()],
                          warmup=0, repeats=1, warmup_s=0.0)
    ours, = [r for r in rows if r.strategy == "remat"]
    assert ours.checkpointed == every.checkpointed and "every block, measured faster" in ours.note
