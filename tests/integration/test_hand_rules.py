"""Note [Plans timed beside the hand rules] (issue #56): where a hand rule meets the budget and the time model
cannot tell it from the chosen plan, the one measured faster is returned."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import remat
import remat.api.hand_rules as hand_rules
from remat.api import margins
from remat.api.hand_rules import faster_of
from remat.api.margins import TIMED_MARGIN, confirmed, rules_to_time
from remat.check.steps import time_plans_in_place
from remat.examples import make_gpt
from remat.rewrite.install import checkpointed_modules
from remat.runtime.measure import split_inputs
from remat.solve import Planner


@pytest.fixture(autouse=True)
def _timed(monkeypatch):
    monkeypatch.setenv("REMAT_TIME_HAND_RULES", "1")  # off in the rest of the suite (tests/conftest.py)
    # what the checked steps measure is this machine's business: the tests that race say whether they confirm
    monkeypatch.setattr(hand_rules, "confirmed", lambda *a, **k: False)


def fake_timings(pairs_of, calls=None):
    """A stand-in for time_plans_in_place that honours its rounds and ``still`` as the real one does: round r times
    the plans ``still`` names, plan i's time being ``pairs_of(r, i)``; ``calls`` gets each round's plan indices."""
    def timings(model, plans, *args, rounds, still=None, **kwargs):
        times = [[] for _ in plans]
        for r in range(rounds):
            live = list(range(len(plans))) if still is None else sorted(still(times))
            if still is not None and len(live) < 2:
                break
            for i in live:
                times[i].append(pairs_of(r, i))
            if calls is not None:
                calls.append(live)
        return [tuple(t) for t in times]
    return timings


def every_rule_timed(monkeypatch):
    """Every rule within the budget timed, whatever predicted: the model's margin (measured or not) at 100%."""
    monkeypatch.setattr(margins, "TIMED_MARGIN", 1.0)
    monkeypatch.setattr(hand_rules, "measured_error", lambda *a: (1.0, "forced by the test"))


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
    assert rules_to_time(near, budget, [rule]) == [rule]
    assert rules_to_time(near, budget - 1, [rule]) == []  # the rule is over the budget
    assert rules_to_time(rule, budget, [rule]) == []  # the plan is the rule
    assert rules_to_time(far, budget, [rule]) == []  # the model's margin is wide: trusted
    assert rules_to_time(near, budget, [planner.no_checkpointing()]) == []  # not a rule that checkpoints


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
    """Rounds go on while the pairs cannot tell a rule from the plan, up to ROUNDS_MAX, and the decision is the median
    of all of them (the pairs given here alternate, then favour the rule: undecided until the 11th; the rule faster
    in 8 of the 11; every 2nd block, where it fits, slower in every pair: decided after 3)."""
    pairs = [(1.0, 1.1), (1.0, 0.9)] * 3 + [(1.0, 0.9)] * 5
    calls = []
    monkeypatch.setattr(hand_rules, "time_plans_in_place",
                        fake_timings(lambda r, i: pairs[r][i] if i < 2 else 1.2, calls))
    every_rule_timed(monkeypatch)
    model, inputs, _ = gpt()
    plan = remat.optimize_checkpointing(model, planner.every_nth_block(1).predicted_peak_bytes * 1.02 / 2**30,
                                        inputs, optimizer=torch.optim.AdamW(model.parameters()))
    assert len(calls) == hand_rules.ROUNDS_MAX and all(1 in live for live in calls)
    assert plan.choices == planner.every_nth_block(1).choices


def test_a_comparison_stops_as_soon_as_the_pairs_decide(planner, monkeypatch):
    """issue #60: a rule whose pairs decide is timed no more: here every pair says the rules are faster by 0.1 s, so
    the comparison ends after the first 3 rounds (the fewest that decide: all three pairs alike), where 5 were timed
    before whatever they said; pairs for the plan decide only from KEEP_ROUNDS_MIN (5) rounds. The plan's fields and
    its printout count the passes (no warm-up round: issue #60) and the seconds."""
    calls = []
    monkeypatch.setattr(hand_rules, "time_plans_in_place", fake_timings(lambda r, i: 1.0 if i == 0 else 0.9, calls))
    every_rule_timed(monkeypatch)
    every = planner.every_nth_block(1)
    model, inputs, _ = gpt()
    plan = remat.optimize_checkpointing(model, every.predicted_peak_bytes * 1.02 / 2**30, inputs,
                                        optimizer=torch.optim.AdamW(model.parameters()))
    assert len(calls) == 3 and plan.strategy.startswith("every_")
    assert plan.rules_timing_passes == sum(len(live) for live in calls) == 3 * len(calls[0])
    assert plan.rules_timing_s > 0
    assert f"timed beside hand rules: {plan.rules_timing_passes} forward and backward passes" in str(plan)
    note = next(n for n in plan.notes if "compared with the hand rules" in n)
    assert f"{plan.rules_timing_passes} forward and backward passes" in note and "3 paired steps" in note


def test_a_rule_the_pairs_cannot_tell_from_the_plan_is_returned(planner, monkeypatch):
    """issue #60 (benchmarks/plans/ranking.py's mlp16 at every block x 1.05: a plan kept on the median of undecided
    pairs measured +251 ms a step slower than every block over 10 rounds): where the rounds end with the pairs'
    quartiles across 0 and the model not confirmed, the plan was not shown faster, and the rule is returned, its
    note saying why; here the pairs' median favours the plan (-0.1 s in 6 of 11 pairs, +0.05 s in 5). Fails where the
    median of undecided pairs decides."""
    calls = []
    monkeypatch.setattr(hand_rules, "time_plans_in_place", fake_timings(
        lambda r, i: 1.0 if i == 0 else (1.1 if r % 2 == 0 else 0.95), calls))
    every_rule_timed(monkeypatch)
    every = planner.every_nth_block(1)
    model, inputs, _ = gpt()
    plan = remat.optimize_checkpointing(model, every.predicted_peak_bytes * 1.02 / 2**30, inputs,
                                        optimizer=torch.optim.AdamW(model.parameters()))
    assert len(calls) == hand_rules.ROUNDS_MAX
    assert plan.choices == every.choices and plan.checked_peak_bytes <= plan.budget_bytes
    note = next(n for n in plan.notes if "compared with the hand rules" in n)
    assert "every block not told apart from this plan by 11 pairs (their quartiles across 0)" in note


def test_a_decided_rule_drops_out_while_another_is_timed(planner):
    """still_undecided: after ROUNDS_MIN rounds the plan and only the rules whose pairs are still undecided are timed
    (pairs for the plan decide from KEEP_ROUNDS_MIN rounds); a rule dropped once is not timed again; nothing at all
    once every rule is decided."""
    plan = [1.0, 1.0, 1.0]
    decided, undecided, slower = [0.9, 0.9, 0.9], [0.9, 1.1, 1.05], [1.1, 1.1, 1.1]
    assert hand_rules.still_undecided([plan[:2], decided[:2], undecided[:2]]) == [0, 1, 2]  # fewer than 3 rounds
    assert hand_rules.still_undecided([plan, decided, undecided]) == [0, 2]
    assert hand_rules.still_undecided([plan + [1.0], decided, undecided + [1.1]]) == [0, 2]
    assert hand_rules.still_undecided([plan, decided]) == [0]
    assert hand_rules.still_undecided([plan, slower]) == [0, 1]  # the plan faster: not yet decided at 3 rounds
    assert hand_rules.still_undecided([plan + [1.0] * 2, slower + [1.1] * 2]) == [0]


def test_the_median_pair_confirms_the_model_from_the_third_round():
    """issue #60: a rule whose first pair is off (a slow first pass) but whose median pair, from ROUNDS_MIN rounds
    on, confirms the model is timed no more (before, pairs off kept the quartiles across 0 up to the most rounds);
    the second round confirms nothing by its median (two pairs: one off moves it); the quartiles' rule still decides
    the rest (fails where the confirmation is the first pair's only, or any round's)."""
    def confirms(i, plan_s, rule_s):  # the model predicts the rule 0.1 s slower: 0.05-0.3 measured confirms it
        return 0.05 <= rule_s - plan_s <= 0.3

    plan = [1.0, 1.0, 1.0]
    off = [0.4, 1.1, 1.12]  # the first pair off (the rule's first pass fast), then 0.1 and 0.12 slower
    assert hand_rules.still_undecided([plan[:1], off[:1]], confirms=confirms) == [0, 1]
    assert hand_rules.still_undecided([plan[:2], off[:2]], confirms=confirms) == [0, 1]  # median 0.35: not yet
    assert hand_rules.still_undecided([plan, off], confirms=confirms) == [0]  # median 0.1: confirmed
    assert hand_rules.still_undecided([plan, off]) == [0, 1]  # unconfirmed, the quartiles straddle 0
    assert hand_rules.still_undecided([plan[:1], [1.1]], confirms=confirms) == [0]  # the first pair confirms


def test_confirmed_holds_the_model_to_a_measured_pair(planner):
    """confirmed: the predicted difference at least FLOOR_MARGIN of the rule's step and at least half of it measured
    (the figures are set here)."""
    every, second = planner.every_nth_block(1), planner.every_nth_block(2)
    rule = dataclasses.replace(every, predicted_step_time_s=1.1)
    near = dataclasses.replace(second, predicted_step_time_s=1.0)
    assert margins.CONFIRMED == 0.5 and margins.FLOOR_MARGIN == 0.03
    assert confirmed(near, rule, 0.90, 0.96, optimizer_s=0.1)  # 60 ms of the predicted 100 measured
    assert not confirmed(near, rule, 0.90, 0.94, optimizer_s=0.1)  # 40 ms: under half
    assert not confirmed(near, rule, 0.96, 0.90, optimizer_s=0.1)  # the rule measured faster
    assert not confirmed(near, rule, None, 0.96, optimizer_s=0.1)  # not measured
    assert not confirmed(dataclasses.replace(near, predicted_step_time_s=1.075), rule, 0.0, 1.0, optimizer_s=0.1)
    assert margins.CONFIRMED_MOST == 3.0
    assert confirmed(near, rule, 0.90, 1.19, optimizer_s=0.1)  # 290 ms of the predicted 100: within 3x
    assert not confirmed(near, rule, 0.90, 1.21, optimizer_s=0.1)  # 310 ms: the pair is off, or the model


def test_on_a_cpu_the_first_pair_that_confirms_the_model_ends_the_comparison(planner, monkeypatch):
    """On a CPU the checked steps' times are not offered (the dispatch-level meter slows a checkpointed step): the
    first timed pair is the confirmation, and a rule it confirms is timed no more (one round, not ROUNDS_MIN); the
    note says so and the plan counts the passes."""
    offered = []

    def confirms(plan, rule, plan_s, rule_s, optimizer_s):
        offered.append((plan_s, rule_s))
        return plan_s is not None and rule_s is not None and rule_s - plan_s >= 0.05

    monkeypatch.setattr(hand_rules, "confirmed", confirms)
    calls = []
    monkeypatch.setattr(hand_rules, "time_plans_in_place", fake_timings(lambda r, i: 1.0 if i == 0 else 1.1, calls))
    every_rule_timed(monkeypatch)
    every = planner.every_nth_block(1)
    model, inputs, _ = gpt()
    plan = remat.optimize_checkpointing(model, every.predicted_peak_bytes * 1.02 / 2**30, inputs,
                                        optimizer=torch.optim.AdamW(model.parameters()))
    assert len(calls) == 1 and plan.rules_timing_passes == len(calls[0]) and plan.choices != every.choices
    assert all(p is None and r is None for p, r in offered[:len(calls[0]) - 1])  # the checked steps: not offered
    note = next(n for n in plan.notes if "compared with the hand rules" in n)
    assert "1 paired step, which confirmed the model: timed no more" in note


@pytest.mark.parametrize("rules_faster", [False, True])
def test_on_a_cpu_a_rules_peak_is_checked_only_once_it_is_measured_faster(planner, monkeypatch, rules_faster):
    """issue #60: on a CPU the rules are timed before their peaks are checked: a rule measured slower than the plan
    is never checked (one real step saved); a rule measured faster is checked before it is returned, and one checked
    over the budget is not returned (every block here, forced over it), the next one measured faster is (every 2nd
    block). At a budget halfway between every block's and the plain peak nothing checks the rules beforehand (Note
    [Least peak is a promise] checks every block only near its peak). Fails where every rule is checked first."""
    import remat.api.checking as checking

    every, second = planner.every_nth_block(1), planner.every_nth_block(2)
    real = checking.peak_with_plan
    checked = []

    def peak(model, plan, *a, **k):
        checked.append(plan.choices)
        return 10**15 if plan.choices == every.choices else real(model, plan, *a, **k)

    monkeypatch.setattr(checking, "peak_with_plan", peak)
    calls = []
    monkeypatch.setattr(hand_rules, "time_plans_in_place", fake_timings(
        lambda r, i: 1.0 if i == 0 else (0.8 + 0.05 * i if rules_faster else 1.2), calls))
    every_rule_timed(monkeypatch)
    budget = (every.predicted_peak_bytes + planner.baseline_peak_bytes) // 2
    assert second.predicted_peak_bytes <= budget
    model, inputs, _ = gpt()
    plan = remat.optimize_checkpointing(model, budget / 2**30, inputs, optimizer=torch.optim.AdamW(model.parameters()))
    assert len(calls[0]) == 3  # the plan and both rules timed
    note = next(n for n in plan.notes if "compared with the hand rules" in n)
    if not rules_faster:
        assert every.choices not in checked and second.choices not in checked
        assert plan.choices not in (every.choices, second.choices) and "this plan kept" in note
        assert note.count("its peak not checked: it was not measured faster") == 2
    else:
        assert every.choices in checked and second.choices in checked
        assert plan.choices == second.choices and plan.checked_peak_bytes <= plan.budget_bytes
        assert "every block measured faster but over the budget when its peak was checked: not returned" in note


def test_plan_checked_checks_and_does_not_race(planner, monkeypatch):
    """issue #62: plan_checked only checks (tradeoff and max_batch, which time their plans themselves, call it at
    every budget and size); the race is fastest_checked's, optimize_checkpointing's."""
    monkeypatch.setattr(hand_rules, "time_plans_in_place", lambda *a, **k: pytest.fail("raced"))
    every_rule_timed(monkeypatch)
    model, inputs, _ = gpt()
    args, kwargs = split_inputs(inputs)
    every = planner.every_nth_block(1)
    plan = remat.api.plan_checked(model, args, kwargs, remat.default_loss, torch.device("cpu"), planner,
                                  int(every.predicted_peak_bytes * 1.02))
    assert plan.checked_peak_bytes <= plan.budget_bytes and plan.rules_timing_passes == 0
    assert not any("hand rules" in n for n in plan.notes)


def test_the_checked_step_is_timed():
    """measure_checked_peak's step_s: the measured step's forward and backward seconds, one per step."""
    model, inputs, _ = gpt()
    args, kwargs = split_inputs(inputs)
    seconds = []
    remat.api.measure_checked_peak(model, args, kwargs, remat.default_loss, torch.device("cpu"), step_s=seconds)
    assert len(seconds) == 1 and seconds[0] > 0


def test_the_checked_step_leaves_out_the_meters_own_time(monkeypatch):
    """Note [The meter's own time]: the CPU meter's handler holds every operator of the checked step for 5 ms here
    (a sleep in its bookkeeping, ``on_op``), and the step's time leaves that out, with each call's entry into the
    mode at its measured cost, never below the operators' own seconds. The bound holds whatever the machine's speed:
    each sleep lasts at least 5 ms, and the step's wall time, timed around the call, holds them all. Fails where the
    meter's own time was kept in the step's (it then reads the sleeps and more)."""
    import time as clock

    from remat.runtime.tracker import StorageTracker

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    x = torch.randn(8, 16)
    # a first call warms up what a process pays once (its first dispatch mode: a second here), not the meter's
    remat.api.measure_checked_peak(model, (x,), {}, remat.default_loss, torch.device("cpu"), step_s=[])
    calls = [0]

    def slow_bookkeeping(self, func, args, kwargs, out):
        calls[0] += 1
        clock.sleep(0.005)

    monkeypatch.setattr(StorageTracker, "on_op", slow_bookkeeping)
    seconds = []
    started = clock.perf_counter()
    remat.api.measure_checked_peak(model, (x,), {}, remat.default_loss, torch.device("cpu"), step_s=seconds)
    wall = clock.perf_counter() - started
    assert calls[0] >= 10 and len(seconds) == 1
    assert 0 < seconds[0] <= wall - 0.005 * calls[0]  # (above 0: never below the seconds its operators ran)


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
        return fake_timings(lambda r, i: [1.0, 0.9 if rule_faster else 1.1, 1.2][min(i, 2)])(model, plans, *args,
                                                                                         **kwargs)

    monkeypatch.setattr(hand_rules, "time_plans_in_place", timings)
    every_rule_timed(monkeypatch)  # every rule within the budget is timed, whatever predicted
    model, inputs, _ = gpt()
    budget_gb = every.predicted_peak_bytes * 1.02 / 2**30
    plan = remat.optimize_checkpointing(model, budget_gb, inputs, optimizer=torch.optim.AdamW(model.parameters()))
    assert len(seen) == 1 and seen[0][1] == every.choices and seen[0][0] != every.choices
    assert (plan.choices == every.choices) is rule_faster
    note = next(n for n in plan.notes if "compared with the hand rules" in n)
    assert ("so it is the plan returned" in note) is rule_faster and ("this plan kept" in note) is not rule_faster
    assert plan.checked_peak_bytes <= plan.budget_bytes
    assert sorted(checkpointed_modules(model)) == sorted(plan.checkpointed)  # applied as returned


def test_a_plan_that_recomputes_nothing_is_timed_beside_no_rule(planner, monkeypatch):
    """A budget the plain step fits: the plan checkpoints nothing, and every hand rule only adds recomputation to
    it, so none is timed, whatever the model's measured error (found as a new user: a 6-layer Llama at 0.3 GB, its
    plain step's predicted peak 215 MiB, timed 3 passes beside every block and every 2nd block). Fails where the
    rules within the budget were timed beside the plain step."""
    monkeypatch.setattr(hand_rules, "time_plans_in_place", lambda *a, **k: pytest.fail("timed"))
    every_rule_timed(monkeypatch)  # were the rules compared, every one within the budget would be timed
    none = planner.no_checkpointing()
    assert rules_to_time(none, none.predicted_peak_bytes, [planner.every_nth_block(1)], margin=1.0) == []
    model, inputs, _ = gpt()
    plan = remat.optimize_checkpointing(model, none.predicted_peak_bytes * 1.5 / 2**30, inputs,
                                        optimizer=torch.optim.AdamW(model.parameters()))
    assert plan.checkpointed == () and plan.rules_timing_passes == 0
    assert not any("compared with the hand rules" in n for n in plan.notes)


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
    every_rule_timed(monkeypatch)
    model, inputs, _ = gpt()
    plan = remat.optimize_checkpointing(model, planner.every_nth_block(1).predicted_peak_bytes * 1.02 / 2**30,
                                        inputs, optimizer=torch.optim.AdamW(model.parameters()))
    assert not any("hand rules" in n for n in plan.notes) and plan.rules_timing_passes == 0


def test_a_second_call_reads_the_pairs_and_returns_the_same_plan(planner, monkeypatch):
    """docs/plans.md#reproducible-plans: the second call on the same step reads its times from the timing cache, so
    it reads the pairs the first call timed too (not timed again: another draw of the noise could return another
    plan) and returns the same plan."""
    every = planner.every_nth_block(1)
    calls = []

    def timings(*args, **kwargs):
        calls.append(1)
        return fake_timings(lambda r, i: [1.0, 0.9, 1.2][min(i, 2)])(*args, **kwargs)

    monkeypatch.setattr(hand_rules, "time_plans_in_place", timings)
    every_rule_timed(monkeypatch)
    plans = []
    for _ in range(2):
        model, inputs, _ = gpt()
        plans.append(remat.optimize_checkpointing(model, every.predicted_peak_bytes * 1.02 / 2**30, inputs,
                                                  optimizer=torch.optim.AdamW(model.parameters())))
    assert len(calls) == 1 and plans[0].choices == plans[1].choices == every.choices
    notes = [next(n for n in p.notes if "compared with the hand rules" in n) for p in plans]
    assert "measured now" in notes[0] and "read from remat's timing cache" in notes[1]
    assert plans[0].rules_timing_passes > 0 and plans[1].rules_timing_passes == 0


def test_the_tradeoff_tables_remat_row_is_raced_by_the_tables_own_rounds(planner, monkeypatch):
    """`remat tradeoff`'s row for remat at a budget is decided beside the hand rules by the table's own timed rounds
    (every plan timed once, however many budgets; nothing raced per budget): every block where it was measured faster
    (labelled remat, with a note saying so), not dropped from remat's rows, and no timing of the race's own."""
    import remat.sweeps.report as report
    from remat.check.steps import StepMeasurement

    every = planner.every_nth_block(1)
    measured = []

    def measure_plans(model, inputs, plans, **kwargs):
        measured.append([p.choices for p in plans])
        return [StepMeasurement(p.predicted_peak_bytes, 0.9 if p.choices == every.choices else 1.0,
                                (0.9,) * 3 if p.choices == every.choices else (1.0,) * 3, "given") for p in plans]

    monkeypatch.setattr(report, "measure_plans", measure_plans)
    monkeypatch.setattr(hand_rules, "time_plans_in_place", lambda *a, **k: pytest.fail("raced per budget"))
    every_rule_timed(monkeypatch)
    model, inputs, _ = gpt()
    budgets = [int(every.predicted_peak_bytes * 1.02), int(every.predicted_peak_bytes * 1.05)]
    rows = remat.tradeoff(model, inputs, planner.profile, loss_fn=None, optimizer_factory=None, budgets=budgets,
                          granularities=("block",), hand_rules=[planner.no_checkpointing()], warmup=0, repeats=1,
                          warmup_s=0.0)
    ours = [r for r in rows if r.strategy == "remat"]
    assert len(measured) == 1 and every.choices in measured[0]  # every block measured once, for both budgets
    assert len(ours) == 2 and all(r.checkpointed == every.checkpointed for r in ours)
    assert all("every block, measured faster than the ILP's plan at this budget in this table's rounds" in r.note
               for r in ours)


def test_max_batch_races_in_its_timed_rows_not_at_every_size_tried(monkeypatch):
    """issue #60: max_batch checks a plan at every size it tries (plan_checked: no race there) and compares the plans
    with the hand rules only in the rows it times anyway, in the same rounds; the rule measured faster (given here)
    is the row's plan, and the notes say which sizes were compared and what it cost."""
    import remat.sweeps.search as search

    small = dict(layers=2, d_model=64, heads=4, seq_len=32, vocab=256)
    monkeypatch.setattr(hand_rules, "time_plans_in_place", lambda *a, **k: pytest.fail("raced at a size tried"))
    every_rule_timed(monkeypatch)
    raced = []

    def rows_timed(model, plans, *args, rounds, **kwargs):
        raced.append(len(plans))
        return [(1.0,) * rounds] + [(0.9,) * rounds] * (len(plans) - 1)

    monkeypatch.setattr(search, "time_plans_in_place", rows_timed)
    model, _, _ = make_gpt(batch_size=2, **small)
    report = remat.max_batch(model, 10 * 2**20 / 2**30, lambda n: make_gpt(batch_size=n, **small)[1],
                             optimizer=torch.optim.AdamW(model.parameters()), repeats=1)
    timed_rows = [r for r in report.rows if r.measured_samples_per_s is not None]
    compared = [n for n in report.notes if "timed beside" in n]
    assert len(raced) == len(timed_rows) and len(compared) == sum(k > 1 for k in raced)
    assert all("measured faster in the median of 1 pairs" in n for n in compared)
    for row in timed_rows:
        if f"size {row.size}: timed beside" in " ".join(compared):
            assert row.plan.strategy.startswith("every_") and row.plan.checked_peak_bytes <= report.budget_bytes


def test_the_models_error_is_the_largest_on_the_checked_steps(planner):
    """Note [The model's measured error]: each checked plan's forward and backward against its prediction, the largest
    relative error, what it was read from; None where no plan given was timed."""
    plan = dataclasses.replace(planner.every_nth_block(2), strategy="ilp", predicted_step_time_s=1.5)
    rule = dataclasses.replace(planner.every_nth_block(1), predicted_step_time_s=2.5)
    error, said = margins.measured_error([plan, rule], {plan.choices: 1.1, rule.choices: 2.1}, 0.5)
    assert error == pytest.approx(0.1) and said.startswith("this plan: forward and backward predicted 1,000.0 ms")
    error, said = margins.measured_error([plan, rule], {plan.choices: 1.01, rule.choices: 1.5}, 0.5)
    assert error == pytest.approx(0.25) and said.startswith("every block:") and "1,500.0 ms" in said
    assert margins.measured_error([plan, rule], {}, 0.5) is None


@pytest.mark.parametrize("error", [0.02, 0.6])
def test_a_rule_is_timed_only_within_the_models_measured_error(planner, monkeypatch, error):
    """issue #60: where the model's error measured on this call's checked steps is below the rules' predicted
    difference, no rule is timed (GPT-2 small at 85%: two plain steps of a 35 s call), the plan's note saying so with
    the figures; where it is above, they are timed. Fails on the fixed 10% margin (both rules here are predicted
    within it, so both were timed at either error)."""
    every, second = planner.every_nth_block(1), planner.every_nth_block(2)
    budget = (every.predicted_peak_bytes + planner.baseline_peak_bytes) // 2
    model, inputs, _ = gpt()
    args, kwargs = split_inputs(inputs)
    plan = planner.plan_for_budget(budget)
    rules = [every, second]
    gaps = [(r.predicted_step_time_s - plan.predicted_step_time_s) / r.predicted_step_time_s for r in rules]
    # the rules' predicted steps placed 10% and 5% above the plan's: within TIMED_MARGIN, beyond a 2% error
    rules = [dataclasses.replace(r, predicted_step_time_s=plan.predicted_step_time_s / (1 - g))
             for r, g in zip(rules, (0.08, 0.05))]
    assert all(g < margins.TIMED_MARGIN for g in (0.08, 0.05)), gaps
    calls = []
    monkeypatch.setattr(hand_rules, "time_plans_in_place", fake_timings(lambda r, i: 1.0 if i == 0 else 1.2, calls))
    fb = plan.predicted_step_time_s - planner.profile.optimizer_s
    check_s = {plan.choices: fb * (1 + error)}
    race = hand_rules.race_hand_rules(model, args, kwargs, remat.default_loss, torch.device("cpu"), planner, plan,
                                      budget, rules, lambda p: 0, check_s)
    if error < 0.05:
        assert calls == [] and race.plan is plan and race.passes == 0
        margin = max(error, margins.FLOOR_MARGIN)
        assert "not timed beside the hand rules" in race.note and f"{margin:.1%}, the model's error measured" in race.note
        assert "every block predicted" in race.note and "every 2nd block predicted" in race.note
    else:
        assert calls and len(calls[0]) == 3 and race.plan is plan
        assert f"within {error:.1%}, the model's error measured on this call's checked steps" in race.note


def test_a_second_race_on_the_same_step_reads_the_models_error_and_decides_alike(planner, monkeypatch):
    """docs/plans.md#reproducible-plans: the model's error is kept with the step's times, so a second race on the same
    step decides which rules to time as the first did, whatever its own checked step read (here the first read the
    plan 1% off its prediction, the second 50% off: without the cached error the second would time both rules).
    With the cache off, each race measures its own."""
    every, second = planner.every_nth_block(1), planner.every_nth_block(2)
    budget = (every.predicted_peak_bytes + planner.baseline_peak_bytes) // 2
    model, inputs, _ = gpt()
    args, kwargs = split_inputs(inputs)
    plan = planner.plan_for_budget(budget)
    rules = [dataclasses.replace(r, predicted_step_time_s=plan.predicted_step_time_s / 0.92) for r in (every, second)]
    calls = []
    monkeypatch.setattr(hand_rules, "time_plans_in_place", fake_timings(lambda r, i: 1.0 if i == 0 else 1.2, calls))
    fb = plan.predicted_step_time_s - planner.profile.optimizer_s

    def race(off):
        return hand_rules.race_hand_rules(model, args, kwargs, remat.default_loss, torch.device("cpu"), planner, plan,
                                          budget, rules, lambda p: 0, {plan.choices: fb * (1 + off)})

    first, again = race(0.01), race(0.5)
    assert calls == [] and first.plan is again.plan is plan
    assert "not timed beside the hand rules" in again.note and "beyond the margin 3.0%" in again.note
    assert "its checked step measured" in again.note and "read from remat's timing cache" in again.note
    monkeypatch.setenv("REMAT_CACHE", "0")
    race(0.5)
    assert calls and len(calls[0]) == 3  # measured afresh: 50% off, both rules timed
