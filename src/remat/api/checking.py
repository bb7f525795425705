"""Plans checked on real steps (Note [Checked plans]): a plan's peak measured by the meter of the loop, the plan
tightened until its checked peak meets the budget, the least peak checked, compiled plans proved.

In: a :class:`~remat.solve.Planner`, a budget, the model and its inputs. Out: a :class:`~remat.solve.plan.Plan`
with its checked peak, or InfeasibleBudgetError with the least checked peak.
"""

from __future__ import annotations

import logging
import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from remat._compat import inductor_programs, profiler_memory_trace
from remat.check.compiled import CompiledComparison
from remat.costs.compiled_memory import composed_step_bytes, eager_blocks, step_program_bytes
from remat.costs.unit_costs import Profile
from remat.rewrite import checkpoint_plan, remove_checkpointing
from remat.runtime.compiled import CompiledLoop
from remat.runtime.distributed import Ranks, steps_checked, wrapping_of
from remat.runtime.meters import StepMeter
from remat.runtime.measure import (
    Clock,
    LossFn,
    found_storages_are_fresh,
    input_tensors,
    measure_peak,
    run_step,
    tensor_bytes,
    trainable_parameters,
)
from remat.runtime.state import fresh_grads, preserved
from remat.solve import Planner
from remat.solve.calibrated import CompiledReading
from remat.solve.plan import Plan, fmt_bytes

if TYPE_CHECKING:
    from remat.api.hand_rules import Race

log = logging.getLogger(__name__)

# Note [Least peak is a promise]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The least peak remat refuses a budget with (the figure in the infeasible-budget error) is a *checked* peak, not a
# prediction: the least-memory plan's, measured on one real step, or the hand rule "every block"'s where that is
# lower (least_checked). A budget equal to it always gets a plan (one of those two, if nothing cheaper measures
# within the budget), and no budget that "every block" meets is refused. That costs one or two real steps, spent
# only where they can change the answer: a refusal, or a fallback. So they run where no plan is predicted within
# the budget (before any timed step: Note [Memory before time] in remat.api.source), and where every plan solved
# for the budget measured over it; never to report a figure beside a plan that measured within it. Issue #60: at
# GPT-2 small they were one of the 5.8 plain steps planning took at 85% of the plain peak, and two of the 8.5-9.8
# at budgets 1-5% above every block's peak, where they ran ahead of the ILP's plan because a refusal was within
# the model's error. A budget between the least predicted peak and a checked least a little above it now spends
# the ILP's plan's real step (or up to three) before the refusal. A plan says which least it carries
# (Plan.min_peak_checked): measured where the least-memory plan's step ran anyway (it is the plan returned, or a
# hand rule the race checked), else predicted; its printout labels the figure, and its note says why.

#: how far a checked peak may lie from its prediction (Note [Checked plans]: the tests hold the memory model to it):
#: a budget further than this above a plan's prediction is met by that plan without a real step to show it
CHECK_TOLERANCE = 0.05

#: ``plan_checked``'s ``beside``: (the ILP's plan checked within the budget, the hand rules, the checker of peaks,
#: each checked step's forward and backward seconds by plan units) -> the plan returned and its note
Beside = Callable[[Plan, list[Plan], Callable[[Plan], int], dict[tuple[str, ...], float]], "Race"]


# Note [The optimizer beside the checked step]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The checked step runs forward and backward for real and reads them by the allocator (on CUDA absolutely: Note [The
# budget on CUDA is absolute] in remat.costs.allocator_reading); the optimizer's part is predicted beside it, not
# measured on a copy. A copy that really steps would have to be an independent optimizer over the real parameters
# and gradients (the user's object is never called: Note [Never call the user's optimizer]): it writes the
# parameters, so they must be copied first and restored (the parameters' bytes again on the device, 2.47 GB for the
# 1B Llama, when the device is the one thing short), and its state (AdamW: twice the parameters) is allocated inside
# the measured window in the order the allocator then serves, not the user's. Predicted beside: the state is what
# the same class with the same hyperparameters creates for each parameter's shape, dtype and device (measured on
# zero-filled shadows, one parameter at a time, on this device), held all step; the step's temporaries, measured on
# the same shadows (summed where the optimizer runs foreach or fused), on top of what the measured step holds once
# backward has returned, workspaces included. What prediction cannot see is where the allocator places the state
# (a large block left unsplit counts up to 1 MiB more than its tensor); that is the allocator model's to replay.


def measure_checked_peak(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, *,
    output_alive: bool = True, optimizer_state_bytes: int = 0, optimizer_step_bytes: int = 0,
    grads_held: bool = False, grads_held_in_forward: bool = False, call: Callable[..., Any] | None = None,
    allocator_level: bool = False, steps: int | None = None, step_s: list[float] | None = None,
) -> int:
    """The peak memory (bytes) of one training step of ``model`` as it is (checkpointed or not): forward,
    loss and ``loss.backward()`` run for real, as the loop runs them (Note [Loop style] in remat.profile:
    gradients start as None, the output is dropped after the loss unless ``output_alive``), measured
    with the parameters, buffers and the batch; the optimizer, which remat never steps (Note [Never call
    the user's optimizer]), is added as predicted: its state all step long, its step's temporaries on
    top of what is alive once backward has returned. With ``grads_held`` (gradient accumulation) every
    trainable parameter has a gradient (zeros) when the step starts and backward adds into it; with
    ``grads_held_in_forward`` (zero_grad after the forward) they are set to None once the loss exists
    (Note [Accumulated gradients] in remat.costs.unit_costs). ``call``: what runs the forward (the compiled model; default
    ``model``); ``allocator_level``: meter every allocation, as compiled code needs (the profiler's memory
    events on CPU; on CUDA the allocator always is). ``steps``: read that many steps by the allocator's
    events and keep the largest peak; None: as many as ``model`` needs (:func:`remat.runtime.distributed.steps_checked`:
    3 for a tensor-parallel or compiled model on CPU, under gloo, Note [Steps under gloo]; else one).

    ``step_s``: the measured step's forward and backward seconds are appended to it, timed under the meter (one
    process, not metered by profiler events; Note [Plans timed beside the hand rules] in remat.api.hand_rules), less
    the meter's own time (Note [The meter's own time] in remat.runtime.meters).

    The model's gradients (``.grad`` objects and values), buffers and the RNG state are as they were."""
    inputs = input_tensors(args, kwargs)
    clock, started = Clock(device), []
    meter = StepMeter(device, time_own=step_s is not None)
    state = [*model.parameters(), *model.buffers(), *inputs]
    trainable = trainable_parameters(model)
    leaves = trainable + [t for t in inputs if t.requires_grad and t.is_leaf]
    after_backward: list[int | None] = []
    call = model if call is None else call

    def on(event: str, live_now: Callable[[], int]) -> None:
        if event == "loss" and grads_held_in_forward and not grads_held:
            for p in trainable:
                p.grad = None
        if event == "backward":
            if step_s is not None and started:
                t0, own, ran = started[-1]  # less the meter's own time: Note [The meter's own time]
                step_s.append(max(clock.seconds(t0, clock.mark()) - (meter.own_seconds() - own),
                                  meter.ran_seconds() - ran))
            after_backward.append(live_now())

    def work(live_now: Callable[[], int]) -> None:
        if grads_held or grads_held_in_forward:  # allocated in the work: the meter sees them come and go
            for p in trainable:
                p.grad = torch.zeros_like(p)
        started.append((clock.mark(), meter.own_seconds(), meter.ran_seconds()))
        run_step(call, args, kwargs, loss_fn, output_alive=output_alive, on=lambda event: on(event, live_now))

    steps = steps_checked(model, device, compiled=allocator_level) if steps is None else steps
    with preserved(model), fresh_grads(leaves):
        if (allocator_level or steps) and device.type != "cuda":  # Note [Compiled steps] in remat.solve.calibrated
            base, peaks = tensor_bytes(state, device), []
            for _ in range(max(steps, 1)):  # Note [Steps under gloo] in remat.runtime.distributed: the largest
                for t in leaves:  # every step starts as the first (the previous one's gradients dropped)
                    t.grad = None
                peak, at = profiler_memory_trace(lambda mark: work(lambda: mark("backward")), device, marks=True)
                peaks.append(max(base + peak, base + at["backward"] + optimizer_step_bytes))
            return max(peaks) + optimizer_state_bytes
        peak = measure_peak(work, device, state, meter=meter)  # the allocator on CUDA sees compiled code too
    return max(peak, after_backward[0] + optimizer_step_bytes) + optimizer_state_bytes


def peak_with_plan(model: nn.Module, plan: Plan, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device,
                   profile: Profile, loop: CompiledLoop | None = None,
                   then: Callable[[Callable[..., Any]], None] | None = None, *,
                   step_s: list[float] | None = None) -> int:
    """:func:`measure_checked_peak` of one step of ``model`` checkpointed as ``plan`` says, for the loop and
    optimizer ``profile`` was made for; with ``loop``, of the step compiled as the loop compiles it (compiled
    afresh, one warm-up step that compiles, then the measured step, metered at allocator level). ``then(call)``
    runs afterwards with the plan still applied (and compiled: ``call`` runs the forward), e.g. to time steps
    without compiling again. ``step_s``: :func:`measure_checked_peak`'s. Leaves ``model`` without checkpointing."""
    return checked_reading(model, plan, args, kwargs, loss_fn, device, profile, loop, then, step_s=step_s).peak_bytes


def checked_reading(model: nn.Module, plan: Plan, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device,
                    profile: Profile, loop: CompiledLoop | None = None,
                    then: Callable[[Callable[..., Any]], None] | None = None, *,
                    compare: CompiledComparison | None = None,
                    step_s: list[float] | None = None) -> CompiledReading:
    """:func:`peak_with_plan`, and with ``loop`` what the programs inductor generated for the step say of its
    memory, read as they are compiled, before the measured step (Note [Compiled programs] in
    remat.costs.compiled_memory; None where they cannot be read). ``compare``: the step that compiles the plan is
    also the one compared with the plain compiled step (Note [Compiled plans are proved] in remat.check.compiled)."""
    remove_checkpointing(model)
    checkpoint_plan(model, plan)
    program = None
    try:
        with loop.step(model) if loop is not None else contextlib.nullcontext(model) as call:
            if loop is not None:  # compiles: not measured
                # (read where they can say the step's memory: a whole model compiled by inductor, one forward and
                # one backward graph, or blocks compiled one by one, composed with the eager code between them;
                # reading them costs inductor's cache for these compiles)
                blocks = eager_blocks(profile, loop.blocks, plan.checkpointed) if loop.blocks else None
                read = dict(loop.settings).get("backend", "inductor") == "inductor" and (
                    not loop.blocks or blocks is not None)
                with preserved(model), torch.random.fork_rng(devices=[]), fresh_grads(trainable_parameters(model)), \
                        inductor_programs() if read else contextlib.nullcontext(None) as programs:
                    if compare is not None:
                        compare.step(plan.variant, call, model, args, kwargs, loss_fn,
                                     output_alive=profile.output_alive)
                    else:
                        run_step(call, args, kwargs, loss_fn, output_alive=profile.output_alive)
                if programs is not None:
                    program = step_program_bytes(programs) if blocks is None else \
                        composed_step_bytes(profile, blocks, programs)
            peak = measure_checked_peak(
                model, args, kwargs, loss_fn, device, output_alive=profile.output_alive, grads_held=profile.grads_held,
                grads_held_in_forward=profile.grads_held_in_forward,
                optimizer_state_bytes=profile.optimizer_state_bytes, optimizer_step_bytes=profile.optimizer_step_bytes,
                call=call, allocator_level=loop is not None, step_s=step_s)
            if then is not None:
                then(call)
            return CompiledReading(peak, program)
    finally:
        remove_checkpointing(model)


def plan_checked(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, planner: Planner,
    budget_bytes: int, *, ranks: Ranks | None = None, checked: dict[tuple[str, ...], int] | None = None,
    more_fallbacks: Callable[[], list[Plan]] | None = None, beside: Beside | None = None,
) -> Plan:
    """Note [Checked plans]: the simulator's prediction is close (tests hold it to 5%) but models are
    many; remat's promise is the measured peak. So a plan runs one real step
    (``measure_checked_peak``: forward and backward measured, the optimizer added as predicted); if it
    exceeds the budget, the target shrinks by the excess and the ILP solves again (at most three
    times).

    With ``ranks`` (distributed training), every plan is rank 0's and every checked peak the largest over
    ranks (Note [One plan for every rank] in remat.runtime.distributed). ``checked``: peaks already measured, by the
    plan's units (shared with :func:`least_checked`; filled in). ``more_fallbacks``: other plans to check
    before refusing a budget below the promise (the least-memory plan chosen on memory alone, whose checked
    peak an early refusal reports: Note [Memory before time]). ``beside``: what the ILP's plan, once checked within
    the budget, goes through before it is returned (:func:`remat.api.hand_rules.fastest_checked` passes the race
    beside the hand rules, Note [Plans timed beside the hand rules]; None: nothing, the plan as checked: what
    ``tradeoff`` and ``max_batch`` ask, which time their plans themselves).

    Leaves ``model`` without checkpointing; raises InfeasibleBudgetError when no plan fits."""
    agree = ranks.broadcast if ranks is not None else (lambda plan: plan)
    checked = {} if checked is None else checked
    check_s: dict[tuple[str, ...], float] = {}
    check = _checker(model, args, kwargs, loss_fn, device, planner, ranks, checked, check_s)

    steps = steps_checked(model, device)

    def done(plan: Plan, measured: int, why: str, ilp: Plan | None = None) -> Plan:
        least = promise if promise is not None else _least_known(checked, fallbacks, budget_bytes)
        note = _checked_note(plan, measured, why, steps, checked, planner, fallbacks, ilp, least is not None)
        if least is None:
            note += (f"; least peak predicted, not checked: {fmt_bytes(planner.min_peak_bytes)}, the budget "
                     f"{budget_bytes / planner.min_peak_bytes - 1:.0%} above it (Note [Least peak is a promise])")
        return dataclasses.replace(plan, budget_bytes=budget_bytes, checked_peak_bytes=measured,
                                   min_peak_bytes=planner.min_peak_bytes if least is None else least,
                                   min_peak_checked=least is not None, notes=plan.notes + (note,))

    def promised() -> int:
        """The least peak checked (Note [Least peak is a promise]); InfeasibleBudgetError where the budget is
        below it, the least-memory plans ``more_fallbacks`` gives checked first."""
        least = least_checked(model, args, kwargs, loss_fn, device, planner, budget_bytes, ranks=ranks,
                              checked=checked, fallbacks=fallbacks, check_s=check_s)
        if budget_bytes < least and more_fallbacks is not None:
            extra = [agree(p) for p in more_fallbacks() if p.choices not in {f.choices for f in fallbacks}]
            fallbacks.extend(extra)
            least = min([least, *(check(p) for p in extra)])
        if budget_bytes < least:
            raise planner.infeasible(budget_bytes, least_bytes=least, steps=max(steps, 1))
        return least

    fallbacks = [agree(planner.least_memory()), agree(planner.every_nth_block(1))]
    promise: int | None = None  # the least peak checked (Note [Least peak is a promise]); None: not needed yet
    if fallbacks[0].choices in checked:  # checked already (Note [Memory before time]): a refusal needs no plan's step
        promise = promised()
    target = budget_bytes
    for _ in range(3):
        if target < planner.min_peak_bytes:
            break
        plan = agree(planner.plan_for_budget(target))
        measured = check(plan)
        if measured <= budget_bytes:
            if beside is None or ranks is not None:  # (a distributed plan is not raced: Note [Plans timed ...])
                return done(plan, measured, "within the budget", ilp=plan)
            race = beside(plan, [fallbacks[1], planner.every_nth_block(2)], check, check_s)  # Note [Plans timed ...]
            return done(race.plan, check(race.plan), "within the budget" + (f"; {race.note}" if race.note else ""),
                        ilp=plan)
        excess = measured - budget_bytes
        log.info("plan measured %d bytes over the budget; solving again with a target %d bytes lower",
                 excess, excess)
        target -= excess
    if promise is None:  # no plan solved for the budget measured within it: the least is checked now
        promise = promised()
    best = _cheapest_fallback(fallbacks, checked, check, budget_bytes)
    return done(dataclasses.replace(best, budget_bytes=budget_bytes), check(best),
                f"the {'least-memory plan' if best is fallbacks[0] else 'hand rule every block'}: the plans predicted "
                "cheaper measured over the budget (Note [Least peak is a promise])")


def _cheapest_fallback(fallbacks: list[Plan], checked: dict[tuple[str, ...], int], check: Callable[[Plan], int],
                       budget_bytes: int) -> Plan:
    """Of the fallbacks measured, and every block (``fallbacks[1]``) where it is predicted within the budget (far
    from the least, where least_checked leaves it, it recomputes far less than the least-memory plan), the one of
    least predicted recomputation that measures within the budget (the least peak is checked: one does)."""
    fits = [p for p in fallbacks if (p.choices in checked or p is fallbacks[1] and p.checkpointed and
                                     p.predicted_peak_bytes <= budget_bytes) and check(p) <= budget_bytes]
    return min(fits, key=lambda p: p.predicted_recompute_s)


def _checked_note(plan: Plan, measured: int, why: str, steps: int, checked: dict[tuple[str, ...], int],
                  planner: Planner, fallbacks: list[Plan], ilp: Plan | None, least_checked: bool) -> str:
    """The checked plan's note: its measured peak, why it is returned, the other plans measured."""
    each = "one real step" if not steps else f"{steps} real steps, the largest by the allocator's events"
    note = f"checked on {each}: peak {fmt_bytes(measured)} measured (optimizer predicted), {why}"
    if steps:
        note += " (Note [Steps under gloo] in remat.runtime.distributed: under gloo one step's peak is not the next one's)"
    if len(checked) > 1:
        label = {planner.every_nth_block(2).choices: "every 2nd block, timed beside the ILP's plan",
                 fallbacks[1].choices: "every block", fallbacks[0].choices: "the least-memory plan"}
        if ilp is not None:
            label[ilp.choices] = "the ILP's plan"
        names = [label.get(units, "the least-memory plan chosen on memory alone") for units in checked
                 if units != plan.choices]
        note += (f"; {len(checked)} plans measured, {'one real step' if not steps else f'{steps} real steps'} each "
                 f"({', '.join(names)} and this one" + ("; the least of the least-memory plans' and every "
                                                         "block's is the least peak promised)" if least_checked else ")"))
    return note


def _checker(model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, planner: Planner,
             ranks: Ranks | None, checked: dict[tuple[str, ...], int],
             check_s: dict[tuple[str, ...], float] | None = None) -> Callable[[Plan], int]:
    """A plan's checked peak (one real step, the largest over ranks), measured once per set of units. ``check_s``:
    the forward and backward seconds of each step checked here, by the plan's units (one process only)."""
    fsdp2 = wrapping_of(model).kind == "fsdp2"  # Note [Memory found] in remat.runtime.tracker

    def check(plan: Plan) -> int:
        if plan.choices not in checked:
            step_s: list[float] = []
            with found_storages_are_fresh(fsdp2):
                peak = peak_with_plan(model, plan, args, kwargs, loss_fn, device, planner.profile, step_s=step_s)
            checked[plan.choices] = ranks.max(peak) if ranks is not None else peak
            if check_s is not None and ranks is None and len(step_s) == 1:
                check_s[plan.choices] = step_s[0]
        return checked[plan.choices]

    return check


def least_checked(model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device,
                  planner: Planner, budget_bytes: int, *, ranks: Ranks | None = None,
                  checked: dict[tuple[str, ...], int] | None = None, fallbacks: list[Plan] | None = None,
                  check_s: dict[tuple[str, ...], float] | None = None) -> int:
    """The least peak remat promises (Note [Least peak is a promise]): the least-memory plan's checked peak,
    or "every block"'s where that is lower. Checkpointing the last block frees a few bytes no prediction
    sees, so "every block" can measure 64-128 bytes under the least-memory plan: it is checked too where
    those bytes can change the answer, that is unless its prediction is above the least-memory plan's
    checked peak, or ``budget_bytes`` is away from its prediction, by more than the checks' tolerance (Note
    [Checked plans]: 5%). No budget it meets is refused; a budget far below it (a refusal) or far above it
    (a roomy plan, issue #23: one real step of 2-3 in such a call) does not wait one more real step for a
    least-peak figure a few bytes lower.
    ``fallbacks``: the two plans, when the caller has them (agreed across ranks). ``check_s``: :func:`_checker`'s."""
    checked = {} if checked is None else checked
    agree = ranks.broadcast if ranks is not None else (lambda plan: plan)
    least, every = fallbacks if fallbacks is not None else \
        (agree(planner.least_memory()), agree(planner.every_nth_block(1)))
    check = _checker(model, args, kwargs, loss_fn, device, planner, ranks, checked, check_s)
    promise = check(least)
    if _every_counts(every, promise, budget_bytes):
        promise = min(promise, check(every))
    return promise


def _least_known(checked: dict[tuple[str, ...], int], fallbacks: list[Plan], budget_bytes: int) -> int | None:
    """:func:`least_checked`'s figure where the plans it needs were checked already (``checked``: by units;
    ``fallbacks``: the least-memory plan and every block); None where one of them was not."""
    least, every = fallbacks[:2]
    if least.choices not in checked:
        return None
    promise = checked[least.choices]
    if _every_counts(every, promise, budget_bytes):
        return min(promise, checked[every.choices]) if every.choices in checked else None
    return promise


def _every_counts(every: Plan, least_peak: int, budget_bytes: int) -> bool:
    """Whether every block's checked peak can change the least (:func:`least_checked`): near the budget and its
    prediction within the checks' tolerance of the least-memory plan's checked peak."""
    near = (1 - CHECK_TOLERANCE) * every.predicted_peak_bytes <= budget_bytes <= \
        (1 + CHECK_TOLERANCE) * max(every.predicted_peak_bytes, least_peak)
    return bool(every.checkpointed) and every.predicted_peak_bytes <= (1 + CHECK_TOLERANCE) * least_peak and near
