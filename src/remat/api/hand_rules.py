"""The checked plan timed beside the hand rules that meet its budget, where the time model cannot tell them apart.

Note [Plans timed beside the hand rules]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
remat's promise is less recompute than any hand rule, and the ILP ranks plans by predicted times. Where a hand rule
("every block", "every 2nd block") meets the budget too, the ILP's plan is predicted faster than it, by construction
(the rule is one of the plans it chose from), but the prediction is a model: within +-10% of measured steps where it
was held to them (the H200's traces, docs/targets.md; this CPU, docs/results.md), never exactly. A plan predicted a
few percent faster than every block can run slower: at a budget just above every block's peak a segment plan was
measured at 1.3x every block's overhead on a CPU (issue #56), and on the H200 a 16-selective-unit plan predicted
11% faster than every block ran 16% slower (its host time, since modelled).

So where a hand rule meets the budget by its prediction and the chosen plan is predicted faster than it by less than
TIMED_MARGIN of the rule's predicted step, the rule's peak is checked on a real step like the plan's (Note [Checked
plans] in remat.api.checking), and if it is within the budget the two are timed on the model itself: ROUNDS rounds of
one forward and backward each, in a shuffled order after a warm-up round, every round a paired comparison (Note
[Interleaved timing] in remat.sweeps.report); while the pairs cannot tell a rule from the plan (the quartiles of the
differences on both sides of 0), two rounds more, up to ROUNDS_MAX. The rule is returned in the plan's place where it
was faster in the median of the pairs: the plan returned is the one measured faster. A first version kept the plan
unless the rule was faster beyond the noise (even the lower quartile above 0) after 3 rounds of a long step; on
benchmarks/ranking.py's 16 MLP blocks it kept a segment plan that 10 rounds then measured slower than every block
(median +90 ms a step of 3.6 s, lower quartile +17: the issue's case). Where two plans are alike in truth, which of the
two is returned is chance, and either is as fast. The figures are in the plan's notes, measured. The pairs are kept in
the timing cache under the step's measured unit times and the plans' units: a later call whose profile read its times
from the cache reads the same pairs, so it returns the same plan (docs/plans.md#reproducible-plans; ``REMAT_CACHE=0``
times them again).

What it costs: where it applies, one real step for each rule's peak (every block's is often checked already, Note
[Least peak is a promise]) and (ROUNDS + 1) x (1 + rules) forward and backward passes, up to (ROUNDS_MAX + 1) x
(1 + rules) where the pairs are undecided, fewer for a step of a second or more (LONG_ROUNDS, LONG_ROUNDS_MAX);
nothing where the model's margin is wide or no rule meets the budget. Not done for
distributed plans (each rank would time its own steps and all must agree on one plan: the ranks' steps are timed
by the model alone, said in the plan's notes) nor compiled loops (each plan a compile of its own: Note [Compiled
steps] in remat.solve.calibrated), nor with ``check=False`` (no real step at all), nor with the environment variable
``REMAT_TIME_HAND_RULES=0`` (the plan as the model ranks it, no steps timed: the test suite's setting, where a plan
must not hang on this machine's noise; tests/integration/test_hand_rules.py turns it on).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from remat.check.steps import time_plans_in_place
from remat.profile import cache
from remat.runtime.measure import LossFn
from remat.solve import Planner
from remat.solve.plan import Plan

#: a hand rule is timed beside the plan when the plan is predicted faster by less than this fraction of the rule's
#: predicted step: the time model's accuracy where it was held to measured steps (+-10%)
TIMED_MARGIN = 0.10
#: paired rounds (after one warm-up round); LONG_ROUNDS for a step of a second or more (profile's step time); while
#: the pairs cannot tell the plans apart (their quartiles on both sides of 0), more, up to the *_MAX
ROUNDS, ROUNDS_MAX = 5, 11
LONG_ROUNDS, LONG_ROUNDS_MAX = 3, 7
LONG_STEP_S = 1.0
#: what the note of a plan that replaced the ILP's says (the tradeoff table reads it)
REPLACED = "it is the plan returned in place of the ILP's"


@dataclass(frozen=True)
class Timed:
    """A hand rule timed beside the plan: each one's median step (seconds, forward and backward, measured) and the
    paired differences' median and quartiles (plan less rule: above 0, the rule was faster)."""

    rule: Plan
    plan_s: float
    rule_s: float
    paired_s: float
    paired_low_s: float
    paired_high_s: float

    @property
    def rule_faster(self) -> bool:
        """The rule measured faster: in the median of the pairs."""
        return self.paired_s > 0

    @property
    def undecided(self) -> bool:
        """The pairs cannot tell the two apart: their quartiles lie on both sides of 0."""
        return self.paired_low_s < 0 < self.paired_high_s


def rules_to_time(planner: Planner, plan: Plan, budget_bytes: int, rules: list[Plan]) -> list[Plan]:
    """The hand rules the plan is timed beside: those predicted within the budget, other than the plan, that the
    plan is predicted to beat by less than TIMED_MARGIN of their step (no torch: the predictions decide)."""
    out = []
    for rule in rules:
        if not rule.checkpointed or rule.choices == plan.choices or rule.predicted_peak_bytes > budget_bytes:
            continue
        if rule.predicted_step_time_s - plan.predicted_step_time_s < TIMED_MARGIN * rule.predicted_step_time_s:
            out.append(rule)
    return out


def faster_of(plan_times: tuple[float, ...], timed: list[tuple[Plan, tuple[float, ...]]]) -> list[Timed]:
    """Each rule's paired comparison with the plan (round ``r`` of both is one pair), the rules measured faster
    first (the largest median of the differences, then the largest lower quartile)."""
    out = []
    for rule, times in timed:
        pairs = [p - r for p, r in zip(plan_times, times)]
        low, _, high = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else (pairs[0],) * 3
        out.append(Timed(rule, statistics.median(plan_times), statistics.median(times), statistics.median(pairs),
                         low, high))
    return sorted(out, key=lambda t: (-t.paired_s, -t.paired_low_s))


def timed_beside_hand_rules(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, planner: Planner,
    plan: Plan, budget_bytes: int, rules: list[Plan], check: Callable[[Plan], int], *, ranks: Any = None,
) -> tuple[Plan, str | None]:
    """Note [Plans timed beside the hand rules]: ``plan`` (checked within the budget) or a hand rule of ``rules``
    measured faster, and the note that says which and by how much (None where nothing was timed: also for a
    distributed plan, ``ranks`` given). ``check`` is the checked peak of a plan (one real step, once per plan)."""
    if ranks is not None or os.environ.get("REMAT_TIME_HAND_RULES", "1").strip().lower() in ("0", "false", "off", "no"):
        return plan, None
    output_alive = planner.profile.output_alive
    candidates = [r for r in rules_to_time(planner, plan, budget_bytes, rules) if check(r) <= budget_bytes]
    if not candidates:
        return plan, None
    long = planner.profile.step_time_s >= LONG_STEP_S
    rounds, most = (LONG_ROUNDS, LONG_ROUNDS_MAX) if long else (ROUNDS, ROUNDS_MAX)
    plans = [plan, *candidates]
    # the same plans of a step whose times came from the timing cache: their pairs too
    # (docs/plans.md#reproducible-plans)
    key = cache.paired_key(device, _step_of(planner, plans, output_alive), [p.choices for p in plans])
    hit = cache.load_paired(key)
    if hit is not None and len(hit[0]) == len(plans):
        times, where = hit
        rounds = len(times[0])
    else:
        times, where = time_plans_in_place(model, plans, args, kwargs, loss_fn, device, output_alive=output_alive,
                                           rounds=rounds), "measured now"
        # two more rounds at a time while some rule's pairs cannot tell it from the plan (model warm: no warm-up)
        while rounds < most and any(t.undecided for t in faster_of(times[0], list(zip(candidates, times[1:])))):
            more = time_plans_in_place(model, plans, args, kwargs, loss_fn, device, output_alive=output_alive,
                                       rounds=min(2, most - rounds), warmup=0, seed=rounds)
            times, rounds = [a + b for a, b in zip(times, more)], rounds + len(more[0])
        cache.store_paired(key, times)
    results = faster_of(times[0], list(zip(candidates, times[1:])))
    said = "; ".join(f"{_name(t.rule)} {t.rule_s * 1e3:,.1f} ms (predicted "
                     f"{(t.rule.predicted_step_time_s - plan.predicted_step_time_s) * 1e3:,.1f} ms a step slower than "
                     f"this plan; checked {check(t.rule):,} bytes; this plan less it, in the pairs: median "
                     f"{t.paired_s * 1e3:+,.1f} ms, lower quartile {t.paired_low_s * 1e3:+,.1f} ms)" for t in results)
    head = (f"timed beside the hand rules that meet the budget and that the model predicts within "
            f"{TIMED_MARGIN:.0%} of this plan (Note [Plans timed beside the hand rules] in remat.api.hand_rules): "
            f"forward and backward, {rounds} paired steps each ({where}), medians: this plan "
            f"{results[0].plan_s * 1e3:,.1f} ms; {said}")
    best = results[0]
    if not best.rule_faster:
        return plan, head + "; no rule measured faster in the median of the pairs: this plan kept"
    rule = dataclasses.replace(best.rule, budget_bytes=budget_bytes)
    return rule, (head + f"; {_name(rule)} measured faster in the median of the pairs, so {REPLACED} "
                  f"({len(plan.checkpointed)} units: {', '.join(plan.checkpointed)})")


def remats_row(plan: Plan, granularity: str, budget_bytes: int) -> tuple[Plan, int, str]:
    """remat's answer for a budget as a tradeoff table's row of remat's (``ilp`` or ``ilp-op``), a hand rule too where
    it was measured faster than the ILP's plan: the plan, the budget and the row's note saying so."""
    ilp = "ilp" if granularity == "block" else "ilp-op"
    if plan.strategy == ilp:
        return plan, budget_bytes, ""
    timed = any(REPLACED in n for n in plan.notes)
    return (dataclasses.replace(plan, strategy=ilp), budget_bytes, f"{_name(plan)}, " + (
        "measured faster than the ILP's plan at this budget (Note [Plans timed beside the hand rules])" if timed else
        "the plans predicted cheaper measured over the budget (Note [Least peak is a promise])"))


def _step_of(planner: Planner, plans: list[Plan], output_alive: bool) -> dict:
    """What the planner knew of the step that the plans' times depend on (for the cache key): each of their units'
    times, as the timing cache gives them back (not the plain step's, whose optimizer step is timed afresh)."""
    p = planner.profile
    names = sorted({u for plan in plans for u in plan.checkpointed})
    return {"output_alive": output_alive,
            "units": [(n, p.unit(n).forward_s, p.unit(n).recompute_s, p.unit(n).overhead_s) for n in names]}


def _name(plan: Plan) -> str:
    return plan.strategy.replace("_", " ")
