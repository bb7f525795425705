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

Where a hand rule meets the budget by its prediction and the chosen plan is predicted faster than it by less than
the model's error measured on this call's checked steps (Note [The model's measured error] below; TIMED_MARGIN where
none was timed) of the rule's predicted step, the model is held to a measured pair of the two: the predicted difference
d (the rule's predicted step less the plan's) against the measured one m (the rule's forward and backward less the
plan's). Where CONFIRMED x d <= m <= CONFIRMED_MOST x d and d >= FLOOR_MARGIN of the rule's predicted forward and
backward, the model's error on this pair, on this device, is under half the difference it predicts: its ranking
stands and the rule is timed no more. The floor is the noise of one pair of steps (a few percent on a shared CPU,
docs/results.md), below which one pair confirms nothing; the ceiling keeps one slow pass of the rule's (a busy
machine; a first step) from confirming the plan: a pair that measures the rule more than three times as slow as
predicted says the pair is off, or the model, and the rounds go on. The pair:
- on CUDA, the two checked steps (the rule's peak is checked on a real step like the plan's, Note [Checked plans] in
  remat.api.checking), timed while the allocator reads their peaks: they cost nothing more;
- on a CPU, the first pair of the timed rounds below. The checked steps are metered there by a dispatch mode, which
  slows a step unevenly: on GPT-2 small (benchmarks/scale/gpt2_small.py's, 2-core CPU) 1.10-1.21x in the median of 3
  pairs per plan, 1.05-1.26x over the pairs, the plain step included (1.03-1.06x on a quieter machine)
  (benchmarks/accuracy/checked_step_time.py; a first reading, on a machine others' tests shared, said twofold), where
  the differences to tell apart are 5-10%. Nor evenly between the two plans of a pair: in two quiet runs at 9a9f1bc
  the metered pair favoured the ILP's plan at 85% of the plain peak over every 2nd block in every round, by 71-496 ms
  a step beyond the unmetered pair of the same round (medians 371 and 346 ms), where the unmetered pairs measured
  every 2nd block faster in the median (-21 and -215 ms); against every block at its peak x 1.01, by +102 and +2 ms
  in the median: the checked steps would have confirmed a plan the unmetered pairs did not show faster. A rule's
  peak is checked only once it is measured faster than the plan (it would be returned) or where it was checked
  already (every block's, where the least peak was checked before the ILP's plan: Note [Least peak is a promise]):
  a rule measured slower needs no peak.
issue #60: at a budget 1-5% above every block's peak the GPT-2-small plan was predicted 474-621 ms a step faster
than every block and measured 650 ms faster, yet 11 more plain steps' time went into timing it (a warm-up round and 3
rounds of three passes); benchmarks/scale/planning_cost.py measures the cost now.

Elsewhere (not confirmed by the checked steps: a CPU, or a step checked by another call) the two are timed on
the model itself: rounds of one forward and backward each in a shuffled order, every round a paired comparison (Note
[Interleaved timing] in remat.sweeps.report), no warm-up round: by then the process has run the recording, the
profile's timed steps and the checked steps, and each pass installs its plan afresh anyway. (A warm-up round ran on
a CPU before: on a machine that others' unlocked test runs shared, the first unmetered pass after the checked steps
once read every 2nd block 11.4 s against the plan's 5.5, predicted 0.26 s apart; the ceiling above refuses such a
pair as a confirmation, where the warm-up round cost 1 + rules passes on every call.) The comparison is sequential: a
rule whose first pair confirms the model is timed no more; from ROUNDS_MIN rounds on, nor one whose median pair
confirms it (issue #60: on GPT-2 small at 85% of the plain peak, every 2nd block predicted 375 ms a step slower than
the plan, the median of the pairs measured it 400 ms slower, yet pairs off on the other side kept the quartiles
across 0 until LONG_ROUNDS_MAX: 14 passes, 83 s; the median of three is not moved by one pair off), nor one whose pairs decide (their quartiles on one side of 0; with 3 pairs, all three alike; for
the plan, from KEEP_ROUNDS_MIN rounds only), and the rounds end when every rule is decided, or at ROUNDS_MAX
(LONG_ROUNDS_MAX for a step of LONG_STEP_S or more).
The rule is returned in the plan's place where it was faster in the median of the pairs, or where the pairs could not
tell the two apart when the rounds ended (quartiles across 0, the model not confirmed), and its checked peak is
within the budget: the plan returned is the one measured faster, or the rule where the plan was not shown faster
(issue #60: benchmarks/plans/ranking.py's mlp16 at every block x 1.05, the rounds ended undecided with the median for
an 8-unit segment plan, kept then, which 10 rounds of whole steps measured +251 [+31, +456] ms a step slower than
every block; the rule is as fast as itself). A first version kept the plan
unless the rule was faster beyond the noise after 3 rounds of a long step; on benchmarks/plans/ranking.py's 16 MLP blocks
it kept a segment plan that 10 rounds then measured slower than every block (median +90 ms a step of 3.6 s, lower
quartile +17: the issue's case). Where two plans are alike in truth, the rule is returned unless the
pairs or the model show the plan faster, and either is as fast. The figures are in the plan's notes, measured, with the passes and seconds the timing took
(``Plan.rules_timing_passes``, ``Plan.rules_timing_s``, printed with the plan). The checked steps' times and the
pairs are kept in the timing cache under the step's measured unit times and the plans' units: a later call whose
profile read its times from the cache reads the same figures, so it decides alike and returns the same plan
(docs/plans.md#reproducible-plans; ``REMAT_CACHE=0`` measures them again).

What it costs: where it applies, on CUDA one real step for each rule's peak not checked already, and nothing more
where the checked steps confirm the model; on a CPU 1 + rules forward and backward passes where the first pair
confirms it, and one real step for a rule measured faster whose peak was not checked; 3 x (1 + rules) where the median
of three pairs does; else at least ROUNDS_MIN x (1 + rules), at most ROUNDS_MAX x (1 + rules) (LONG_ROUNDS_MAX for a long step); nothing where the model's margin is
wide, no rule meets the budget, or the plan checkpoints and offloads nothing (the plain step fits the budget: a rule
only adds recomputation to it; a 6-layer Llama at 0.3 GB was timed 3 passes beside the rules before).
``tradeoff`` and ``max_batch`` do not race here: they time their plans anyway, and
decide their rows from those same rounds (:func:`faster_of`; remat.sweeps). Not done for distributed plans (each rank would time its
own steps and all must agree on one plan: the ranks' steps are timed by the model alone, said in the plan's notes)
nor compiled loops (each plan a compile of its own: Note [Compiled steps] in remat.solve.calibrated), nor with
``check=False`` (no real step at all), nor with the environment variable ``REMAT_TIME_HAND_RULES=0`` (the plan as
the model ranks it, no steps timed: the test suite's setting, where a plan must not hang on this machine's noise;
tests/integration/test_hand_rules.py turns it on).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from remat._compat import uncompiled
from remat.api.checking import plan_checked
from remat.api.margins import confirmed, margin_of, measured_error, name_of, rules_in_budget, rules_to_time, \
    trusted_note
from remat.api.hf import prepare_hf_for_training
from remat.api.inputs import validate
from remat.check.steps import time_plans_in_place
from remat.profile import cache
from remat.rewrite import eager_submodules
from remat.runtime.measure import LossFn, default_loss
from remat.runtime.state import preserved
from remat.solve import Planner
from remat.solve.plan import GiB, Plan

#: paired rounds: at least ROUNDS_MIN, then each rule until its pairs decide, up to ROUNDS_MAX (LONG_ROUNDS_MAX for a
#: step of LONG_STEP_S or more, the profile's step time)
ROUNDS_MIN, ROUNDS_MAX, LONG_ROUNDS_MAX = 3, 11, 7
#: pairs that decide for the plan (against the rule) count only from this many rounds: keeping the plan is what can
#: break the promise (benchmarks/plans/ranking.py's mlp16 at every block x 1.02: 3 pairs for an 11-unit segment plan, which
#: 10 rounds of whole steps then measured 103 ms a step slower than every block)
KEEP_ROUNDS_MIN = 5
LONG_STEP_S = 1.0


@dataclass(frozen=True)
class Timed:
    """A hand rule timed beside the plan: each one's median step (seconds, forward and backward, measured) and the
    paired differences' median and quartiles (plan less rule: above 0, the rule was faster), over ``rounds``."""

    rule: Plan
    plan_s: float
    rule_s: float
    paired_s: float
    paired_low_s: float
    paired_high_s: float
    rounds: int = 0

    @property
    def rule_faster(self) -> bool:
        """The rule measured faster: in the median of the pairs."""
        return self.paired_s > 0

    @property
    def undecided(self) -> bool:
        """The pairs cannot tell the two apart: their quartiles lie on both sides of 0."""
        return self.paired_low_s < 0 < self.paired_high_s


@dataclass(frozen=True)
class Race:
    """What the race beside the hand rules decided (Note [Plans timed beside the hand rules]): the plan returned,
    whether a hand rule replaced the ILP's plan, the rules confirmed by the checked steps and those timed, what the
    timing cost (passes and seconds run in this call, measured) and the note saying it (None: nothing compared)."""

    plan: Plan
    note: str | None = None
    replaced: bool = False
    confirmed: tuple[Plan, ...] = ()
    timed: tuple[Timed, ...] = ()
    passes: int = 0
    seconds: float = 0.0


def timing_off() -> bool:
    """``REMAT_TIME_HAND_RULES=0``: plans as the model ranks them, nothing timed."""
    return os.environ.get("REMAT_TIME_HAND_RULES", "1").strip().lower() in ("0", "false", "off", "no")


def faster_of(plan_times: tuple[float, ...], timed: list[tuple[Plan, tuple[float, ...]]]) -> list[Timed]:
    """Each rule's paired comparison with the plan (round ``r`` of both is one pair; a rule timed for fewer rounds
    pairs with the plan's first ones), the rules measured faster first (the largest median of the differences, then
    the largest lower quartile)."""
    out = []
    for rule, times in timed:
        pairs = [p - r for p, r in zip(plan_times, times)]
        low, _, high = _quartiles(pairs)
        out.append(Timed(rule, statistics.median(plan_times[:len(pairs)]), statistics.median(times),
                         statistics.median(pairs), low, high, len(pairs)))
    return sorted(out, key=lambda t: (-t.paired_s, -t.paired_low_s))


def still_undecided(times: list[list[float]], minimum: int = ROUNDS_MIN,
                    confirms: Callable[[int, float, float], bool] | None = None) -> list[int]:
    """The plans the next round times (``times[0]``: the plan's, the others a rule's each, in rounds): the plan and
    every rule timed in every round so far whose pairs do not decide yet (all of them before ``minimum`` rounds),
    but a rule whose pairs confirm the model (``confirms(i, plan_s, rule_s)``): its first pair, or from ``minimum``
    rounds on the median of its pairs (one pair off, a first pass slow, does not move it); only the plan (nothing
    more to time) once every rule is decided."""
    done = len(times[0])

    def open_(pairs: list[float]) -> bool:
        return done < minimum or _undecided(pairs) or (done < KEEP_ROUNDS_MIN and statistics.median(pairs) < 0)

    def confirmed_(i: int, ts: list[float]) -> bool:
        if confirms is None or not (done == 1 or done >= minimum):
            return False
        return confirms(i, 0.0, statistics.median(r - p for p, r in zip(times[0], ts)))

    return [0] + [i for i, ts in enumerate(times[1:], 1) if len(ts) == done and not confirmed_(i, ts) and open_(
        [p - r for p, r in zip(times[0], ts)])]


def _undecided(pairs: list[float]) -> bool:
    low, _, high = _quartiles(pairs)
    return low < 0 < high


def _quartiles(pairs: list[float]) -> tuple[float, float, float]:
    """The pairs' quartiles (one pair: itself three times)."""
    low, mid, high = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else (pairs[0],) * 3
    return low, mid, high


def fastest_checked(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, planner: Planner,
    budget_bytes: int, *, ranks: Any = None, checked: dict[tuple[str, ...], int] | None = None,
    more_fallbacks: Callable[[], list[Plan]] | None = None,
) -> Plan:
    """:func:`remat.api.checking.plan_checked`'s plan, raced beside the hand rules where the model cannot tell them
    apart (Note [Plans timed beside the hand rules]): what ``optimize_checkpointing`` returns. Leaves ``model``
    without checkpointing."""
    def beside(plan: Plan, rules: list[Plan], check: Callable[[Plan], int], check_s: dict) -> Race:
        race = race_hand_rules(model, args, kwargs, loss_fn, device, planner, plan, budget_bytes, rules, check,
                               check_s)
        return dataclasses.replace(race, plan=dataclasses.replace(
            race.plan, rules_timing_passes=race.passes, rules_timing_s=race.seconds))

    return plan_checked(model, args, kwargs, loss_fn, device, planner, budget_bytes, ranks=ranks, checked=checked,
                        more_fallbacks=more_fallbacks, beside=None if timing_off() else beside)


def race_hand_rules(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, planner: Planner,
    plan: Plan, budget_bytes: int, rules: list[Plan], check: Callable[[Plan], int],
    check_s: dict[tuple[str, ...], float],
) -> Race:
    """Note [Plans timed beside the hand rules]: ``plan`` (checked within the budget) or a hand rule of ``rules``
    measured faster, and what was measured. ``check`` is the checked peak of a plan (one real step, once per plan),
    ``check_s`` the forward and backward seconds of the steps it checked (filled in)."""
    started, before = time.perf_counter(), set(check_s)
    output_alive = planner.profile.output_alive
    within = rules_in_budget(plan, budget_bytes, rules)
    ours = [plan, *within]
    error = cache.model_error(  # (kept with the step's times: a call reading them reads this too)
        cache.paired_key(device, _step_of(planner, ours, output_alive), [["error"], *(p.choices for p in ours)]),
        lambda: measured_error(ours, check_s, planner.profile.optimizer_s)) if within else None
    margin, margin_said = margin_of(error)
    near = rules_to_time(plan, budget_bytes, within, margin)
    trusted = [r for r in within if r not in near]
    if trusted and not near:
        return Race(plan, seconds=time.perf_counter() - started, note=trusted_note(plan, trusted, margin_said))
    # on CUDA the rules' checked steps are the first pair: each is checked now; on a CPU a rule's peak is checked
    # only where it is measured faster (it would be returned), or where it was checked already
    cuda = device.type == "cuda"
    candidates = [r for r in near if (not cuda and r.choices not in before) or check(r) <= budget_bytes]
    if not candidates:
        over = [r for r in near if r.choices not in before and r.choices in check_s]
        return Race(plan, seconds=time.perf_counter() - started, note=None if not over else (
            f"{', '.join(name_of(r) for r in over)} checked for a comparison with this plan (Note [Plans timed beside "
            f"the hand rules] in remat.api.hand_rules): over the budget, not compared; "
            f"{time.perf_counter() - started:.1f} s (measured)"))
    plans = [plan, *candidates]
    # the same plans of a step whose times came from the timing cache: their checked steps' times and pairs too
    # (docs/plans.md#reproducible-plans)
    key = cache.paired_key(device, _step_of(planner, plans, output_alive), [p.choices for p in plans])
    hit = cache.load_paired(key)
    if hit is not None and len(hit[0]) == len(plans) and len(hit[1]) == len(plans):
        times, steps_s, where = hit
    else:
        # the checked steps are a fair first pair where the allocator meters them (CUDA); on a CPU the dispatch-level
        # meter slows a step by 10-25%, unevenly across plans (Note [Plans timed beside the hand rules]): the first
        # timed pair instead
        steps_s = [check_s.get(p.choices) if cuda else None for p in plans]
        sure = [confirmed(plan, r, steps_s[0], s, planner.profile.optimizer_s) for r, s in zip(candidates, steps_s[1:])]
        times, where = [[] for _ in plans], "measured now"
        if not all(sure):
            most = LONG_ROUNDS_MAX if planner.profile.step_time_s >= LONG_STEP_S else ROUNDS_MAX
            racing = [plan, *(r for r, ok in zip(candidates, sure) if not ok)]
            raced = time_plans_in_place(
                model, racing, args, kwargs, loss_fn, device, output_alive=output_alive, rounds=most, warmup=0,
                still=lambda ts: still_undecided(ts, confirms=lambda i, plan_s, rule_s: confirmed(
                    plan, racing[i], plan_s, rule_s, planner.profile.optimizer_s)))
            it = iter(raced[1:])
            times = [list(raced[0])] + [[] if ok else list(next(it)) for ok in sure]
        cache.store_paired(key, times, steps_s)
    passes = sum(len(t) for t in times) if where == "measured now" else 0
    race = _decided(plan, budget_bytes, candidates, times, steps_s, check, where, margin_said,
                    known=lambda rule: rule.choices in check_s,
                    confirms=lambda rule, diff_s: confirmed(plan, rule, 0.0, diff_s, planner.profile.optimizer_s))
    return dataclasses.replace(race, passes=passes, seconds=time.perf_counter() - started,
                               note=race.note + f"; timing beside the hand rules: {passes} forward and backward "
                               f"passes, {time.perf_counter() - started:.1f} s with the rules' checked steps "
                               "(measured)")


def _decided(plan: Plan, budget_bytes: int, candidates: list[Plan], times: list, steps_s: list,
             check: Callable[[Plan], int], where: str, margin_said: str, *, known: Callable[[Plan], bool],
             confirms: Callable[[Plan, float], bool]) -> Race:
    """The race's outcome from the checked steps' times and the pairs, and its note. ``known``: whether a plan's peak
    was checked already; a rule measured faster, or left undecided, is checked here before it is returned (on a CPU
    a rule is timed before its peak is checked: one measured slower is never checked). ``confirms(rule, rule_less_
    plan_s)``: whether a measured difference confirms the model (:func:`confirmed`)."""
    sure = tuple(r for r, ts in zip(candidates, times[1:]) if not ts)
    results = faster_of(tuple(times[0]), [(r, tuple(ts)) for r, ts in zip(candidates, times[1:]) if ts]) \
        if times[0] else []
    # a rule the pairs could not tell from the plan when the rounds ended (not confirmed slower either) is returned
    # too: the plan was not shown faster, and the rule is as fast within the noise (Note [Plans timed beside ...])
    untold = {id(t) for t in results if t.undecided and not (
        (t.rounds == 1 or t.rounds >= ROUNDS_MIN) and confirms(t.rule, -t.paired_s))}
    winner, over = None, []
    for t in sorted(results, key=lambda t: not t.rule_faster):
        if not (t.rule_faster or id(t) in untold) or winner is not None:
            continue
        if check(t.rule) <= budget_bytes:
            winner = t
        else:
            over.append(t.rule)

    def peak(rule: Plan) -> str:
        return f"checked {check(rule):,} bytes" if known(rule) else "its peak not checked: it was not measured faster"

    said = [f"{name_of(r)} predicted {(r.predicted_step_time_s - plan.predicted_step_time_s) * 1e3:,.1f} ms a step "
            f"slower than this plan, its checked step measured {(s - steps_s[0]) * 1e3:,.1f} ms slower (forward and "
            f"backward, one step each under the memory meter): the model's ranking confirmed, not timed"
            for r, s in zip(candidates, steps_s[1:]) if r in sure]
    said += [f"{name_of(t.rule)} {t.rule_s * 1e3:,.1f} ms against this plan's {t.plan_s * 1e3:,.1f} ms, {t.rounds} "
             f"paired step{'s' if t.rounds > 1 else ', which confirmed the model: timed no more'} (predicted "
             f"{(t.rule.predicted_step_time_s - plan.predicted_step_time_s) * 1e3:,.1f} ms a step slower than this "
             f"plan; {peak(t.rule)}; this plan less it, in the pairs: median "
             f"{t.paired_s * 1e3:+,.1f} ms, lower quartile {t.paired_low_s * 1e3:+,.1f} ms)" for t in results]
    said += [f"{name_of(r)} measured faster but over the budget when its peak was checked: not returned" for r in over]
    head = (f"compared with the hand rules that the model predicts within {margin_said} of this plan and within "
            f"the budget (Note [Plans timed beside the hand rules] in remat.api.hand_rules; {where}): "
            + "; ".join(said))
    if winner is None:
        return Race(plan, head + ("; no rule measured faster within the budget" if results else "") +
                    ": this plan kept", confirmed=sure + tuple(t.rule for t in results if t.rounds == 1),
                    timed=tuple(results))
    rule = dataclasses.replace(winner.rule, budget_bytes=budget_bytes)
    why = "measured faster in the median of the pairs" if winner.rule_faster else (
        f"not told apart from this plan by {winner.rounds} pairs (their quartiles across 0): the plan was not shown "
        "faster")
    return Race(rule, head + f"; {name_of(rule)} {why}, so it is the plan returned in place of the ILP's "
                f"({len(plan.checkpointed)} units: {', '.join(plan.checkpointed)})",
                replaced=True, confirmed=sure, timed=tuple(results))


def _step_of(planner: Planner, plans: list[Plan], output_alive: bool) -> dict:
    """What the planner knew of the step that the plans' times depend on (for the cache key): each of their units'
    times, as the timing cache gives them back (not the plain step's, whose optimizer step is timed afresh)."""
    p = planner.profile
    names = sorted({u for plan in plans for u in plan.checkpointed})
    return {"output_alive": output_alive,
            "units": [(n, p.unit(n).forward_s, p.unit(n).recompute_s, p.unit(n).overhead_s) for n in names]}


def checked_plan(model: nn.Module, example_inputs: Any, planner: Planner, budget_bytes: int, *,
                 loss_fn: LossFn | None = None) -> Plan:
    """The plan :func:`optimize_checkpointing` would choose for ``budget_bytes`` from ``planner`` (made from
    :func:`make_profile` of this model, with the same ``loss_fn``), checked on one real step (Note [Checked
    plans]), without applying it: the model, its checkpointing, gradients, buffers and RNG state are left as
    they were. Raises InfeasibleBudgetError (with the least measured peak) when no plan fits."""
    model = uncompiled(model)
    _, args, kwargs, device = validate(model, max(budget_bytes, 1) / GiB, example_inputs)
    _, undo = prepare_hf_for_training(model)
    try:
        with preserved(model), eager_submodules(model):
            return fastest_checked(model, args, kwargs, loss_fn or default_loss, device, planner, budget_bytes)
    finally:
        undo()
