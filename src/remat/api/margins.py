"""Which hand rules a checked plan is timed beside: those the time model cannot tell from it by its error measured
on this call's checked steps, and when a measured pair confirms the model (Note [Plans timed beside the hand rules]
in remat.api.hand_rules). No torch: predictions and measured seconds in, decisions out.

Note [The model's measured error]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Which rules are timed at all rests on how far the time model can be off on this model and device, and the call has
measured that already: every plan checked on a real step (the ILP's, and a hand rule where its peak was checked: every
block's where a refusal or a fallback checked the least, Note [Least peak is a promise] in remat.api.checking) has its forward and backward timed there beside its prediction (Note [Checked plans] in
remat.api.checking). The margin is the largest relative error among them, at least FLOOR_MARGIN (one step's noise);
a rule predicted slower than the plan by more than it is ranked by the model and not timed, and the plan's note says
so with the figures. Where no checked step was timed (distributed plans: each rank's own; a compiled loop) the margin
is TIMED_MARGIN, the model's accuracy where it was held to measured steps.
- Where the model is off for a plan, its own step shows it: the ViT-style model's plans were predicted 22-29% slow on
  this CPU before the host model read the model itself, 4-9% at 385103f (benchmarks/results/ranking-cpu.md), and
  every rule within that is timed. The 16 MLP blocks' segment plans, whose first block's activations leave the cache
  before its backward (a cost the model does not see), are predicted within FLOOR_MARGIN of every block: timed
  whatever the error.
- On a CPU the checked step runs under the dispatch-level meter, and its time leaves out the meter's own (its
  handler's bookkeeping and each call's entry into the mode: Note [The meter's own time] in remat.runtime.meters).
  Kept in, it read the built-in GPT's step 1.53x and 1.89x the unmetered one in the median of two runs, a 6-layer
  Llama's 1.19x and 1.21x; left out, 1.15x and 1.33x, 1.11x and 1.07x (benchmarks/accuracy/meter_own_time.py). On
  GPT-2 small the bookkeeping was 0.06-0.12 s of a 5-7 s step (1.2-1.7%, benchmarks/accuracy/checked_step_time.py at
  9a9f1bc) where the plain step read 1.03-1.21x metered: what is left (the meter's effect on caches and the allocator)
  adds to the error read where the model predicts the step too fast (more rules timed) and hides as much where it
  predicts it too slow (fewer). With one step's noise of the same few percent, a call on GPT-2 small, whose rules are
  predicted 6.2-6.6% slower than the plan, times one pair on one run and none on the next (docs/results.md); a third
  run of planning_cost.py (9a9f1bc) read the error 8.0%, 14.1% and 2.5% at its three budgets: one step's noise on a
  2-core CPU, which only more steps measure.
- Issue #60: GPT-2 small (benchmarks/scale/gpt2_small.py's) at 85% of the plain peak, every 2nd block predicted 370
  ms (6.6%) a step slower than the plan and a pair measured 203 ms; at every block x 1.01, every block 399 ms (6.2%)
  slower and measured 408: the pair cost 11.5-12.6 s, two plain steps, of calls of 35-52 s. Neither is timed where the
  plan's checked step reads within those 6% of its prediction: one run of two at 385103f, none of the third at
  9a9f1bc, seven calls of nine at dc67aa9-1eda969, whose checked steps read 0.2-10.0% from their predictions, and
  eleven of twelve at 75aee80 (2.4-5.9%; the twelfth read 30.5% on a machine that slowed: benchmarks/scale/
  planning_cost.py).
- A later call whose profile read its times from the timing cache reads the same error (kept with the step's times:
  remat.profile.cache.model_error), so it times the same rules and returns the same plan.
"""

from __future__ import annotations

from remat.solve.plan import Plan

#: a hand rule is compared with the plan where the plan is predicted faster by less than this fraction of the rule's
#: predicted step: the time model's accuracy where it was held to measured steps (+-10%); beyond it, trusted
TIMED_MARGIN = 0.10
#: below this fraction of the rule's predicted forward and backward, one pair of checked steps confirms nothing
FLOOR_MARGIN = 0.03
#: a pair confirms the model where it measures at least CONFIRMED of the predicted difference and at most
#: CONFIRMED_MOST times it (more says the pair is off, or the model: not a confirmation of it)
CONFIRMED, CONFIRMED_MOST = 0.5, 3.0


def rules_to_time(plan: Plan, budget_bytes: int, rules: list[Plan], margin: float | None = None) -> list[Plan]:
    """The hand rules the plan is compared with: those predicted within the budget, other than the plan, that the
    plan is predicted to beat by less than ``margin`` of their step (the model's error: TIMED_MARGIN where this call
    measured none, Note [The model's measured error]; no torch: the predictions decide)."""
    margin = TIMED_MARGIN if margin is None else margin
    return [rule for rule in rules_in_budget(plan, budget_bytes, rules)
            if rule.predicted_step_time_s - plan.predicted_step_time_s < margin * rule.predicted_step_time_s]


def rules_in_budget(plan: Plan, budget_bytes: int, rules: list[Plan]) -> list[Plan]:
    """The hand rules that checkpoint, other than the plan, predicted within the budget; none beside a plan that
    neither recomputes nor offloads anything (the plain step: every rule only adds recomputation to it)."""
    if not plan.choices:
        return []
    return [rule for rule in rules if rule.checkpointed and rule.choices != plan.choices
            and rule.predicted_peak_bytes <= budget_bytes]


def measured_error(plans: list[Plan], step_s: dict[tuple[str, ...], float], optimizer_s: float) -> \
        tuple[float, str] | None:
    """Note [The model's measured error]: the largest relative error of the predicted forward and backward against
    a checked step's (``step_s``, by the plans' units) over ``plans`` (the first is the ILP's), and what it was read
    from; None where none of them was timed."""
    found = []
    for i, p in enumerate(plans):
        predicted = p.predicted_step_time_s - optimizer_s
        if p.choices in step_s and predicted > 0:
            found.append((abs(step_s[p.choices] - predicted) / predicted, i, p, step_s[p.choices], predicted))
    if not found:
        return None
    error, i, p, measured, predicted = max(found, key=lambda f: f[:2])
    return error, (f"{'this plan' if i == 0 else name_of(p)}: forward and backward predicted "
                   f"{predicted * 1e3:,.1f} ms, "
                   f"its checked step measured {measured * 1e3:,.1f} ms")


def margin_of(error: tuple[float, str] | None) -> tuple[float, str]:
    """The margin rules are timed within (Note [The model's measured error]) from :func:`measured_error`'s error and
    source (None: no step timed, TIMED_MARGIN), and the words the plan's note gives it."""
    if error is None:
        return TIMED_MARGIN, f"{TIMED_MARGIN:.0%}, no step of this call timed to measure the model's error"
    margin = max(FLOOR_MARGIN, error[0])
    return margin, (f"{margin:.1%}, the model's error measured on this call's checked steps ({error[1]}; at least "
                    f"{FLOOR_MARGIN:.0%}: Note [The model's measured error])")


def confirmed(plan: Plan, rule: Plan, plan_s: float | None, rule_s: float | None, optimizer_s: float) -> bool:
    """Whether the checked steps (``plan_s``, ``rule_s``: forward and backward seconds, None where unknown) confirm
    that ``plan`` is faster than ``rule`` as predicted: the predicted difference at least FLOOR_MARGIN of the rule's
    predicted forward and backward, and between CONFIRMED and CONFIRMED_MOST of it measured (Note [Plans timed beside
    the hand rules])."""
    if plan_s is None or rule_s is None:
        return False
    predicted = rule.predicted_step_time_s - plan.predicted_step_time_s
    return predicted >= FLOOR_MARGIN * (rule.predicted_step_time_s - optimizer_s) and \
        CONFIRMED * predicted <= rule_s - plan_s <= CONFIRMED_MOST * predicted


def name_of(plan: Plan) -> str:
    """A plan's strategy as the notes name it ("every block")."""
    return plan.strategy.replace("_", " ")


def trusted_note(plan: Plan, trusted: list[Plan], margin_said: str) -> str:
    """The note of a plan the model ranks apart from every hand rule within the budget: nothing timed."""
    return ("not timed beside the hand rules (Note [Plans timed beside the hand rules] in remat.api.hand_rules): " +
            "; ".join(f"{name_of(r)} predicted {(r.predicted_step_time_s - plan.predicted_step_time_s) * 1e3:,.1f} ms "
                      f"({(r.predicted_step_time_s - plan.predicted_step_time_s) / r.predicted_step_time_s:.1%}) a "
                      "step slower than this plan" for r in trusted) + f", beyond the margin {margin_said}")
