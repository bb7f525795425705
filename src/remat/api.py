"""The public entry points: optimize_checkpointing, apply_plan, remove_checkpointing."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import nn

from remat._compat import CHECKED_ON, inductor_programs, profiler_memory_trace, uncompiled
from remat.capture import ModelGraph, capture
from remat.runtime.compiled import CompiledLoop, compiled_loop, compiled_nothing_note, eager_submodules
from remat.costs.compiled_memory import composed_step_bytes, eager_blocks, step_program_bytes
from remat.costs.unit_costs import Profile
from remat.runtime.distributed import Ranks, Wrapping, ranks_for, steps_checked, wrapping_of
from remat.errors import EquivalenceError, InternalError, InvalidInputError, PlanMismatchError, RematError
from remat.runtime.measure import DefaultLoss, LossFn, default_loss, found_storages_are_fresh, input_tensors, measure_peak, model_device, run_step, split_inputs, \
    tensor_bytes, trainable_parameters
from remat.solve.plan import GiB, Plan, fmt_bytes
from remat.profile import profile_model
from remat.rewrite import check_units, checkpoint_plan, remove_checkpointing
from remat.solve import Planner
from remat.solve.calibrated import CompiledReading, plan_compiled
from remat.runtime.state import fresh_grads, preserved
from remat.check.verify import CompiledComparison, check_compiled_plan

log = logging.getLogger(__name__)


def model_signature(model: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


def validate(model: Any, budget_gb: Any, example_inputs: Any) -> tuple[int, tuple, dict, torch.device]:
    """Check the arguments of optimize_checkpointing; returns (budget bytes, args, kwargs, device)."""
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)) or not math.isfinite(budget_gb) \
            or budget_gb <= 0:
        raise InvalidInputError(
            f"budget_gb must be a positive finite number of GiB (2**30 bytes), got {budget_gb!r}"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise InvalidInputError(
            f"{type(model).__name__} has no trainable parameters (none with requires_grad=True): "
            "there is no training step to checkpoint"
        )
    args, kwargs = split_inputs(example_inputs)
    if kwargs.get("use_cache") is True:
        raise InvalidInputError(
            "example_inputs sets use_cache=True: a KV cache in a checkpointed training step is rebuilt on every "
            "recomputation; pass use_cache=False (training does not use the cache)"
        )
    device = model_device(model)
    for t in input_tensors(args, kwargs):
        if t.device != device:
            raise InvalidInputError(
                f"example input on {t.device} but the model is on {device}: move the batch with "
                f".to({str(device)!r}) first"
            )
    return int(budget_gb * GiB), args, kwargs, device


def make_profile(
    model: nn.Module, example_inputs: Any, *, loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None, output_alive: bool = True, grad_accumulation: bool = False,
    zero_grad_after_forward: bool = False,
) -> Profile:
    """Capture and profile one training step of ``model`` on ``example_inputs`` (a tensor, a tuple of
    positional arguments or a dict of keyword arguments), for :class:`remat.Planner`: the measured
    costs every plan is predicted from. Arguments as in :func:`optimize_checkpointing`.

    The model is left as it was, remat's own checkpointing included, and so are its gradients, buffers,
    ``optimizer`` (never called) and the RNG state. The step is profiled as remat will run it: without a
    KV cache or the model's own gradient checkpointing (Note [Hugging Face]), which are given back
    afterwards."""
    model = uncompiled(model)
    _, args, kwargs, device = validate(model, 1.0, example_inputs)
    loss_fn = loss_fn or default_loss
    _, undo = prepare_hf_for_training(model)
    try:
        with eager_submodules(model):
            profile = _make_profile(model, args, kwargs, loss_fn=loss_fn, optimizer=optimizer, device=device,
                                    output_alive=output_alive, wrapping=wrapping_of(model))
        return loop_grads(profile, grad_accumulation, zero_grad_after_forward)
    finally:
        undo()


def _make_profile(
    model: nn.Module, args: tuple, kwargs: dict, *, loss_fn: LossFn, optimizer: torch.optim.Optimizer | None,
    device: torch.device, output_alive: bool = True, wrapping: Wrapping | None = None,
    graph: ModelGraph | None = None, memory_known: Callable[[Profile], None] | None = None,
) -> Profile:
    """``graph``: the model's capture, when already made (on another batch of the same model: its units do not
    depend on the batch). ``memory_known``: see :func:`remat.profile.profile_model`."""
    wrapping = wrapping or Wrapping()
    wrapped = None if wrapping.kind == "none" else f"the model is wrapped by {wrapping}"
    with preserved(model), found_storages_are_fresh(wrapping.kind == "fsdp2"):
        remove_checkpointing(model)
        with stage("profile", model, args, kwargs, loss_fn):
            # Note [Tracing without module hooks]: torch.fx traces on proxies, running no kernel and no
            # collective, and here without module hooks (capture's _WithoutModuleHooks): what it sees is the
            # Python of the forwards, which is what decides whether the operator sequence can depend on the data
            # (Note [Selective checkpointing]). The hooks parallelize_module installs redistribute DTensors by
            # their placements, not their values (SequenceParallel's refuses a proxy: traced with hooks, a
            # sequence-parallel model failed); FSDP2's gather and free parameters, and hold state that running
            # them on proxies or fake tensors breaks: left out, they are not run at all. So a model wrapped by
            # tensor parallelism (sequence parallel or not) or FSDP2, 2-D included, is traced when its own
            # forwards trace, and gets selective options named by position in the real step's operators,
            # collectives included (ranks agree: Note [One plan for every rank]). torch.export is not tried: it
            # would run the hooks on fake tensors. DDP's wrapper does its bookkeeping in its own forward, not in
            # hooks: it is never traced
            traced = wrapping.kind in ("tp", "fsdp2")
            graph = graph or capture(model, args, kwargs, untraceable=None if traced else wrapped,
                                     no_export=wrapped if traced else None)
            return profile_model(model, args, kwargs, loss_fn=loss_fn, optimizer=optimizer, graph=graph,
                                 device=device, output_alive=output_alive, record_real=wrapped,
                                 world_size=wrapping.world_size, wrapping=str(wrapping) if wrapping.world_size > 1 else "",
                                 sharded=tuple(name for name, _ in wrapping.fsdp), memory_known=memory_known)


def loop_grads(profile: Profile, grad_accumulation: bool, zero_grad_after_forward: bool) -> Profile:
    """``profile`` for the loop's gradients (Note [Accumulated gradients] in remat.costs.unit_costs)."""
    if grad_accumulation:
        return profile.with_held_grads()
    return profile.with_held_grads(through_backward=False) if zero_grad_after_forward else profile


@contextlib.contextmanager
def stage(name: str, model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn) -> Iterator[None]:
    """Note [Whose failure]: an exception that is not a RematError, raised while remat runs one of its
    stages, is either the user's (the training step itself fails on these inputs) or remat's. To tell
    which, the plain step runs once (forward, loss, gradients by autograd.grad: ``.grad`` untouched;
    model, buffers and RNG restored): if it fails too, the user gets InvalidInputError with their own
    exception chained; if it runs, remat failed, and says so (InternalError, naming the stage, with
    the cause chained). The model is restored by the callers either way."""
    try:
        yield
    except RematError:
        raise
    except Exception as e:  # noqa: BLE001 - sorted into the user's failure or remat's below
        user_error = plain_step_error(model, args, kwargs, loss_fn)
        if user_error is not None:
            if isinstance(user_error, RematError):
                raise user_error from None
            raise InvalidInputError(
                f"the training step fails without remat too on example_inputs ({type(user_error).__name__}: "
                f"{_first_line(user_error)}); check that the model accepts them (shapes, dtypes, argument names) "
                "and that loss_fn fits its output"
            ) from user_error
        raise InternalError(
            f"remat failed in its {name} stage ({type(e).__name__}: {_first_line(e)}), while your training step "
            f"runs without remat on the same inputs. This is remat's failure, not your inputs': please report it "
            f"with the traceback (the cause is chained below) and remat {_version()}, torch {torch.__version__} "
            f"(remat is tested on torch {', '.join(CHECKED_ON)}). "
            "Your model and training state are as they were.",
            stage=name,
        ) from e


def plain_step_error(model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn) -> BaseException | None:
    """The exception one plain training step raises on these inputs, or None when it runs (Note [Whose
    failure]). Leaves the model, its gradients, buffers and the RNG state as they were."""
    try:
        with preserved(model), torch.random.fork_rng(devices=[]):
            remove_checkpointing(model)
            with fresh_grads(trainable_parameters(model)):
                run_step(model, args, kwargs, loss_fn)
    except Exception as e:  # noqa: BLE001 - this is the answer
        return e
    return None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else ""


def _version() -> str:
    from remat import __version__

    return __version__


def optimize_checkpointing(
    model: nn.Module,
    budget_gb: float,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    time_limit_s: float | None = 60.0,
    check: bool = True,
    granularity: str = "op",
    output_alive: bool = True,
    grad_accumulation: bool = False,
    zero_grad_after_forward: bool = False,
    timeout_s: float | None = None,
    compile: bool | dict | None = None,
) -> Plan:
    """Checkpoint ``model``'s submodules in place so a training step fits ``budget_gb``.

    ``budget_gb`` is GiB (2**30 bytes) of peak memory on the model's device during one whole
    training step -- forward, backward and optimizer step: parameters + gradients + optimizer
    state + activations saved for backward + temporaries. ``example_inputs`` is one tensor, a
    tuple of positional arguments or a dict of keyword arguments shaped like a real batch.
    ``loss_fn(output)`` gives the scalar loss (default: :func:`default_loss`). ``optimizer``'s
    state, as it is after a step, counts in the budget (None: no optimizer state counted); remat
    never calls it (Note [Never call the user's optimizer]).

    ``output_alive`` says how the training loop treats the model's output (Note [Loop style] in
    remat.profile): True (the default) when it stays referenced until the step ends
    (``out = model(x); loss = crit(out, y); loss.backward(); opt.step()``: nanoGPT, most hand-written
    loops, Lightning's ``training_step`` when it returns the output), False when only the loss
    survives the forward (Hugging Face Trainer's ``compute_loss``, torchtitan's ``del pred``). For
    language models the output (logits) is often the largest single tensor. ``grad_accumulation``: the
    loop accumulates gradients over several micro-batches before each optimizer step, so every micro-step
    but the first starts with all gradients allocated; the plan is made and checked for that micro-step
    (Note [Accumulated gradients] in remat.costs.unit_costs). ``zero_grad_after_forward``: the loop calls
    ``zero_grad()`` between the forward and the backward (Lightning's automatic optimization), so the
    previous step's gradients are alive through the forward.

    With ``check`` (the default) the plan is run once for real before it is returned (Note [Checked
    plans]) and tightened if its measured peak exceeds the budget. ``granularity="op"`` (the default)
    also considers checkpointing units *selectively* (``name@ops<k>``: one of a menu of policies per
    unit that keep the outputs of some operators, such as the matmuls, and recompute the cheap rest),
    and uses such a plan only where it is predicted to save at least 5% of the block-level plan's
    recompute (Note [Selective margin] in remat.solve); ``"block"`` checkpoints whole units only. "op"
    is the default because in benchmarks/selective.py op-level plans measured faster than, or within
    the timing noise of, block-level plans at every budget, with 0.25-0.68x their overhead halfway
    between "every block" and no checkpointing on 512-wide decoders (CPU).

    Mutates ``model`` (the chosen submodules' ``forward`` is checkpointed) and returns the
    :class:`Plan`. On any error the model, its gradients, buffers and the RNG state are left
    as they were. Raises ``InfeasibleBudgetError`` (with the least achievable peak) when no
    plan fits, ``InvalidInputError`` for bad arguments.

    ``compile``: the loop trains the model compiled, so the plan is made and checked for the compiled step
    (Note [Compiled steps] in remat.solve.calibrated): True (``torch.compile``'s defaults), or a dict of the
    ``torch.compile`` settings the loop uses (``backend``, ``mode``, ``options``, ``fullgraph``, ``dynamic``).
    None (the default) detects it: a model wrapped by ``torch.compile`` or with submodules compiled in place
    (``block.compile()``, torchtitan's order) is planned for its compiled step; False plans the eager step.
    The predicted and checked peaks are then the compiled step's, measured by the allocator (CUDA) or the
    profiler's allocator-level memory events (CPU) on compiled steps of 1-7 plans (one compile each, the cost
    of compiled planning: 1 when the budget needs no checkpointing, 3 to refuse one below the least peak); a
    whole model compiled by inductor is predicted from what its generated program allocates (Note [Compiled
    programs] in remat.costs.compiled_memory). Regions (Note [Regions] in remat.capture) are not offered for a compiled loop. The
    model is profiled eagerly (the module ``torch.compile`` wraps) and recompiles on its next call (Note
    [Under torch.compile] in remat.rewrite).

    Distributed training (FSDP2 ``fully_shard``, DDP): call it on every rank, on the model as it will
    train; ``budget_gb`` is per rank. Every rank gets the same plan (Note [One plan for every rank] in
    remat.runtime.distributed); ``timeout_s`` bounds the wait for the other ranks (default 300 s).
    """
    given, model = model, uncompiled(model)
    budget_bytes, args, kwargs, device = validate(model, budget_gb, example_inputs)
    default = DefaultLoss() if loss_fn is None else None
    loss_fn = loss_fn or default
    loop = compiled_loop(given, model, compile)
    wrapping, ranks = ranks_for(model, timeout_s, same=dict(
        budget_gb=budget_gb, granularity=granularity, output_alive=output_alive, check=check,
        grad_accumulation=grad_accumulation, zero_grad_after_forward=zero_grad_after_forward,
        time_limit_s=time_limit_s, optimizer=None if optimizer is None else type(optimizer).__name__,
        compiled=str(loop)))
    notes, undo = prepare_hf_for_training(model)
    notes += tuple(n for n in (compiled_nothing_note(model),) if n)
    started = time.perf_counter()
    checked: dict[tuple[str, ...], int] = {}  # checked peaks by plan (Note [Memory before time])
    by_memory: list[Planner] = []

    def memory_least() -> list[Plan]:
        """The least-memory plan as memory alone chooses it (its units, timed by the full profile's planner)."""
        return [planner.make_plan(by_memory[0].least_memory().checkpointed, "least-memory")] if by_memory else []

    def memory_known(memory: Profile) -> None:
        """Note [Memory before time]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~
        Whether a budget is below the least peak is a question of memory, which the recording answers before
        any timed step runs; a refusal after timing cost 16 training steps' time at GPT-2-small size (issue
        #23). So profiling hands the profile as memory alone gives it (every recompute 0 s) to this hook
        first: a budget under its least predicted peak is refused there, with the checked least (the
        least-memory plan of that profile, or every block where lower: :func:`least_checked`), in the time
        of the recording, one plain forward and one or two checked steps. Without times, the least-memory
        plan is one of the plans of least predicted peak, not necessarily the one the timed profile picks, and
        two such plans can measure a few hundred bytes apart: so the full check, before it refuses a budget,
        also checks this plan (``more_fallbacks`` of :func:`plan_checked`), and a budget equal to a figure
        either path reported gets a plan. Peaks checked here are not measured again."""
        memory = loop_grads(memory, grad_accumulation, zero_grad_after_forward)
        planner = Planner(memory, time_limit_s=time_limit_s, granularity=granularity,
                          ranks=ranks.gather(memory) if ranks is not None else None)
        by_memory.append(planner)
        if budget_bytes >= planner.min_peak_bytes:
            return
        if not check:
            raise planner.infeasible(budget_bytes)
        with stage("check", model, args, kwargs, loss_fn):
            promise = least_checked(model, args, kwargs, loss_fn, device, planner, budget_bytes, ranks=ranks,
                                    checked=checked)
        if budget_bytes < promise:
            raise planner.infeasible(budget_bytes, least_bytes=promise, steps=max(steps_checked(model, device), 1))

    try:
        # (not for a compiled loop: Dynamo warns about global module hooks and would trace them)
        with preserved(model, on_success=False), eager_submodules(model), \
                forwards_counted(model) if loop is None else contextlib.nullcontext({}) as runs:
            profile = _make_profile(model, args, kwargs, loss_fn=loss_fn, optimizer=optimizer, device=device,
                                    output_alive=output_alive, wrapping=wrapping,
                                    memory_known=memory_known if loop is None else None)
            profile = loop_grads(profile, grad_accumulation, zero_grad_after_forward)
            profiled = time.perf_counter()
            notes += (default.note,) if default is not None and default.note else ()
            planner = Planner(profile, time_limit_s=time_limit_s, granularity=granularity,
                              ranks=ranks.gather(profile) if ranks is not None else None, regions=loop is None)
            if check and loop is not None:
                compare = CompiledComparison(loop) if ranks is None else None
                with stage("check", model, args, kwargs, loss_fn):
                    plan = plan_compiled(
                        planner, budget_bytes, lambda p: _ranks_reading(ranks, checked_reading(
                            model, p, args, kwargs, loss_fn, device, profile, loop, compare=compare)),
                        agree=ranks.broadcast if ranks is not None else (lambda p: p), loop=str(loop))
                    notes += (proved_compiled(model, plan, args, kwargs, loss_fn, loop, compare),)
            elif check:
                with stage("check", model, args, kwargs, loss_fn):
                    plan = plan_checked(model, args, kwargs, loss_fn, device, planner, budget_bytes, ranks=ranks,
                                        checked=checked, more_fallbacks=memory_least)
            else:
                plan = planner.plan_for_budget(budget_bytes)
                plan = ranks.broadcast(plan) if ranks is not None else plan
            if ranks is not None:
                notes += (f"one plan for every rank ({wrapping}): the per-rank budget holds on the worst rank",)
            if loop is not None and any(u.is_region for u in profile.candidates()):
                notes += ("regions of modules' forwards (Note [Regions] in remat.capture) are not offered for a "
                          "compiled loop: their forward runs a traced graph node by node, untested under compile",)
            notes += (f"planning took {time.perf_counter() - started:.1f} s: profile {profiled - started:.1f} s, "
                      f"solve{' and check' if check else ''} {time.perf_counter() - profiled:.1f} s (one plain step "
                      f"measured {profile.step_time_s:.3f} s)" + (
                          f"; the model's forward ran {runs['real']} times for real (training steps, and forward-only "
                          f"passes that check the recording) and {runs['fake']} on fake tensors (no kernels)"
                          if runs else ""),)
            plan = dataclasses.replace(plan, model_signature=model_signature(model), notes=plan.notes + notes)
            with stage("rewrite", model, args, kwargs, loss_fn):
                remove_checkpointing(model)
                checkpoint_plan(model, plan)
    except BaseException:
        undo()
        raise
    log.info("remat: checkpointed %d units; predicted peak %d bytes", len(plan.checkpointed),
             plan.predicted_peak_bytes)
    return plan


def proved_compiled(model: nn.Module, plan: Plan, args: tuple, kwargs: dict, loss_fn: LossFn, loop: CompiledLoop,
                    compare: CompiledComparison | None) -> str:
    """Note [Compiled plans are proved] in remat.check.verify: the plan's compiled step against the plain compiled
    step (as compared while the plan was measured, where it was and agreed; else compiled again here); the
    plan's note on success, EquivalenceError where they differ. ``compare`` None: a distributed loop."""
    if compare is None:
        return ("the compiled planned step was not compared with the plain compiled step (a distributed loop: "
                "Note [Compiled plans are proved] in remat.check.verify runs in one process)")
    if not plan.checkpointed:
        return "nothing checkpointed: the compiled step is the plain compiled step"
    report = compare.reports.get(plan.checkpointed)
    if report is None or not report.equal:  # (the slope check needs the planned step's gradients: run it again)
        report = check_compiled_plan(model, plan, args, kwargs, loss_fn, loop)
    if report.equal:
        name, diff = report.worst(1)[0] if report.max_abs_diff else ("", 0.0)
        return (f"proved on one compiled step: loss, outputs, gradients and buffers equal the plain compiled "
                f"step's within rtol {report.rtol:g} ({len(report.max_abs_diff)} tensors; largest difference "
                f"{diff:.2e}, {name}; Note [Compiled plans are proved] in remat.check.verify)")
    own = report.slope is not None and report.slope.consistent
    alike = check_compiled_plan(model, plan, args, kwargs, loss_fn, loop, deterministic=True) if own else None
    if alike is not None and alike.equal:
        return (f"proved on compiled steps: with every module in eval mode the planned step equals the plain "
                f"compiled step (rtol {alike.rtol:g}, {len(alike.max_abs_diff)} tensors); in training it draws "
                f"other random numbers than the plain compiled step (inductor orders the two programs' random "
                f"kernels as it schedules each; loss {float(report.max_abs_diff.get('loss', 0.0)):.2e} apart), and "
                f"{report.slope} (Note [Compiled plans are proved] in remat.check.verify)")
    raise EquivalenceError(
        f"{report if alike is None else alike}\nUnder {loop}, the planned step does not compute what the plain "
        f"compiled step computes (checkpointed: {list(plan.checkpointed)}"
        f"{'' if alike is None else ', compared with every module in eval mode'}); the model is as it was. " + (
            "Its gradient is not its own loss's: do not train with this plan. " if not own else "") +
        "Plan the eager step with compile=False, and report this with the printout (Note [Compiled plans are "
        "proved] in remat.check.verify).")


@contextlib.contextmanager
def forwards_counted(model: nn.Module) -> Iterator[dict[str, int]]:
    """How many times ``model``'s forward runs while the block runs, for real and on fake tensors (a global
    forward pre-hook, removed after: nothing is registered on the user's model)."""
    from remat._compat import FakeTensor, active_fake_mode, tree_flatten

    counts = {"real": 0, "fake": 0}

    def hook(module: nn.Module, args: Any) -> None:
        if module is model:
            fake = active_fake_mode() is not None or any(
                isinstance(t, FakeTensor) for t in tree_flatten(args)[0])
            counts["fake" if fake else "real"] += 1

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield counts
    finally:
        handle.remove()


def _ranks_reading(ranks: Ranks | None, reading: CompiledReading) -> CompiledReading:
    """The largest reading over ranks (a program read on some ranks only: none)."""
    if ranks is None:
        return reading
    readings = ranks.gather((reading.peak_bytes, reading.program_bytes))
    programs = [program for _, program in readings]
    return CompiledReading(max(peak for peak, _ in readings), None if None in programs else max(programs))


def measure_checked_peak(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, *,
    output_alive: bool = True, optimizer_state_bytes: int = 0, optimizer_step_bytes: int = 0,
    grads_held: bool = False, grads_held_in_forward: bool = False, call: Callable[..., Any] | None = None,
    allocator_level: bool = False, steps: int | None = None,
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
    3 for a tensor-parallel model on CPU, under gloo, Note [Steps under gloo]; else one).

    The model's gradients (``.grad`` objects and values), buffers and the RNG state are as they were."""
    inputs = input_tensors(args, kwargs)
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
            after_backward.append(live_now())

    def work(live_now: Callable[[], int]) -> None:
        if grads_held or grads_held_in_forward:  # allocated in the work: the meter sees them come and go
            for p in trainable:
                p.grad = torch.zeros_like(p)
        run_step(call, args, kwargs, loss_fn, output_alive=output_alive, on=lambda event: on(event, live_now))

    steps = steps_checked(model, device) if steps is None else steps
    with preserved(model), fresh_grads(leaves):
        if (allocator_level or steps) and device.type != "cuda":  # Note [Compiled steps] in remat.solve.calibrated
            base, peaks = tensor_bytes(state, device), []
            for _ in range(max(steps, 1)):  # Note [Steps under gloo] in remat.runtime.distributed: the largest
                for t in leaves:  # every step starts as the first (the previous one's gradients dropped)
                    t.grad = None
                peak, at = profiler_memory_trace(lambda mark: work(lambda: mark("backward")), device, marks=True)
                peaks.append(max(base + peak, base + at["backward"] + optimizer_step_bytes))
            return max(peaks) + optimizer_state_bytes
        peak = measure_peak(work, device, state)  # the allocator on CUDA sees compiled code too
    return max(peak, after_backward[0] + optimizer_step_bytes) + optimizer_state_bytes


def peak_with_plan(model: nn.Module, plan: Plan, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device,
                   profile: Profile, loop: CompiledLoop | None = None,
                   then: Callable[[Callable[..., Any]], None] | None = None) -> int:
    """:func:`measure_checked_peak` of one step of ``model`` checkpointed as ``plan`` says, for the loop and
    optimizer ``profile`` was made for; with ``loop``, of the step compiled as the loop compiles it (compiled
    afresh, one warm-up step that compiles, then the measured step, metered at allocator level). ``then(call)``
    runs afterwards with the plan still applied (and compiled: ``call`` runs the forward), e.g. to time steps
    without compiling again. Leaves ``model`` without checkpointing."""
    return checked_reading(model, plan, args, kwargs, loss_fn, device, profile, loop, then).peak_bytes


def checked_reading(model: nn.Module, plan: Plan, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device,
                    profile: Profile, loop: CompiledLoop | None = None,
                    then: Callable[[Callable[..., Any]], None] | None = None, *,
                    compare: CompiledComparison | None = None) -> CompiledReading:
    """:func:`peak_with_plan`, and with ``loop`` what the programs inductor generated for the step say of its
    memory, read as they are compiled, before the measured step (Note [Compiled programs] in
    remat.costs.compiled_memory; None where they cannot be read). ``compare``: the step that compiles the plan is
    also the one compared with the plain compiled step (Note [Compiled plans are proved] in remat.check.verify)."""
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
                        compare.step(plan.checkpointed, call, model, args, kwargs, loss_fn,
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
                call=call, allocator_level=loop is not None)
            if then is not None:
                then(call)
            return CompiledReading(peak, program)
    finally:
        remove_checkpointing(model)


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
            return plan_checked(model, args, kwargs, loss_fn or default_loss, device, planner, budget_bytes)
    finally:
        undo()


def plan_checked(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, planner: Planner,
    budget_bytes: int, *, ranks: Ranks | None = None, checked: dict[tuple[str, ...], int] | None = None,
    more_fallbacks: Callable[[], list[Plan]] | None = None,
) -> Plan:
    """Note [Checked plans]: the simulator's prediction is close (tests hold it to 5%) but models are
    many; remat's promise is the measured peak. So a plan runs one real step
    (``measure_checked_peak``: forward and backward measured, the optimizer added as predicted); if it
    exceeds the budget, the target shrinks by the excess and the ILP solves again (at most three
    times).

    Note [Least peak is a promise]: the least peak remat reports (``plan.min_peak_bytes``, and the
    figure in the infeasible-budget error) is a *checked* peak, not a prediction: the least-memory plan's,
    measured on one real step, or the hand rule "every block"'s where that is lower (:func:`least_checked`).
    A budget equal to it always gets a plan (one of those two, if nothing cheaper measures within the
    budget), and no budget that "every block" meets is refused. That costs one or two more real steps per
    call.

    With ``ranks`` (distributed training), every plan is rank 0's and every checked peak the largest over
    ranks (Note [One plan for every rank] in remat.runtime.distributed). ``checked``: peaks already measured, by the
    plan's units (shared with :func:`least_checked`; filled in). ``more_fallbacks``: other plans to check
    before refusing a budget below the promise (the least-memory plan chosen on memory alone, whose checked
    peak an early refusal reports: Note [Memory before time]).

    Leaves ``model`` without checkpointing; raises InfeasibleBudgetError when no plan fits."""
    agree = ranks.broadcast if ranks is not None else (lambda plan: plan)
    checked = {} if checked is None else checked
    check = _checker(model, args, kwargs, loss_fn, device, planner, ranks, checked)

    steps = steps_checked(model, device)
    each = "one real step" if not steps else f"{steps} real steps, the largest by the allocator's events"

    def done(plan: Plan, measured: int, why: str) -> Plan:
        note = f"checked on {each}: peak {fmt_bytes(measured)} measured (optimizer predicted), {why}"
        if steps:
            note += " (Note [Steps under gloo] in remat.runtime.distributed: under gloo one step's peak is not the next one's)"
        if len(checked) > 1:
            label = {fallbacks[1].checkpointed: "every block", fallbacks[0].checkpointed: "the least-memory plan"}
            names = [label.get(units, "the least-memory plan chosen on memory alone") for units in checked
                     if units != plan.checkpointed]
            note += (f"; {len(checked)} plans measured, {'one real step' if not steps else f'{steps} real steps'} each "
                     f"({' and '.join(names)}, whose measured least is the least peak promised, and this one)")
        return dataclasses.replace(plan, budget_bytes=budget_bytes, checked_peak_bytes=measured,
                                   min_peak_bytes=promise, notes=plan.notes + (note,))

    fallbacks = [agree(planner.least_memory()), agree(planner.every_nth_block(1))]
    promise = least_checked(model, args, kwargs, loss_fn, device, planner, budget_bytes, ranks=ranks,
                            checked=checked, fallbacks=fallbacks)
    if budget_bytes < promise and more_fallbacks is not None:
        extra = [agree(p) for p in more_fallbacks() if p.checkpointed not in {f.checkpointed for f in fallbacks}]
        fallbacks += extra
        promise = min([promise, *(check(p) for p in extra)])
    if budget_bytes < promise:
        raise planner.infeasible(budget_bytes, least_bytes=promise, steps=max(steps, 1))
    target = budget_bytes
    for _ in range(3):
        if target < planner.min_peak_bytes:
            break
        plan = agree(planner.plan_for_budget(target))
        measured = check(plan)
        if measured <= budget_bytes:
            return done(plan, measured, "within the budget")
        excess = measured - budget_bytes
        log.info("plan measured %d bytes over the budget; solving again with a target %d bytes lower",
                 excess, excess)
        target -= excess
    fits = [p for p in fallbacks if p.checkpointed in checked and check(p) <= budget_bytes]
    best = min(fits, key=lambda p: p.predicted_recompute_s)
    return done(dataclasses.replace(best, budget_bytes=budget_bytes), check(best),
                f"the {'least-memory plan' if best is fallbacks[0] else 'hand rule every block'}: the plans predicted "
                "cheaper measured over the budget (Note [Least peak is a promise])")


def _checker(model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, planner: Planner,
             ranks: Ranks | None, checked: dict[tuple[str, ...], int]) -> Callable[[Plan], int]:
    """A plan's checked peak (one real step, the largest over ranks), measured once per set of units."""
    fsdp2 = wrapping_of(model).kind == "fsdp2"  # Note [Memory found] in remat.runtime.measure

    def check(plan: Plan) -> int:
        if plan.checkpointed not in checked:
            with found_storages_are_fresh(fsdp2):
                peak = peak_with_plan(model, plan, args, kwargs, loss_fn, device, planner.profile)
            checked[plan.checkpointed] = ranks.max(peak) if ranks is not None else peak
        return checked[plan.checkpointed]

    return check


def least_checked(model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device,
                  planner: Planner, budget_bytes: int, *, ranks: Ranks | None = None,
                  checked: dict[tuple[str, ...], int] | None = None, fallbacks: list[Plan] | None = None) -> int:
    """The least peak remat promises (Note [Least peak is a promise]): the least-memory plan's checked peak,
    or "every block"'s where that is lower. Checkpointing the last block frees a few bytes no prediction
    sees, so "every block" can measure 64-128 bytes under the least-memory plan: it is checked too where
    those bytes can change the answer, that is unless its prediction is above the least-memory plan's
    checked peak, or ``budget_bytes`` is away from its prediction, by more than the checks' tolerance (Note
    [Checked plans]: 5%). No budget it meets is refused; a budget far below it (a refusal) or far above it
    (a roomy plan, issue #23: one real step of 2-3 in such a call) does not wait one more real step for a
    least-peak figure a few bytes lower.
    ``fallbacks``: the two plans, when the caller has them (agreed across ranks)."""
    checked = {} if checked is None else checked
    agree = ranks.broadcast if ranks is not None else (lambda plan: plan)
    least, every = fallbacks if fallbacks is not None else \
        (agree(planner.least_memory()), agree(planner.every_nth_block(1)))
    check = _checker(model, args, kwargs, loss_fn, device, planner, ranks, checked)
    promise = check(least)
    near = 0.95 * every.predicted_peak_bytes <= budget_bytes <= 1.05 * max(every.predicted_peak_bytes, promise)
    if every.checkpointed and every.predicted_peak_bytes <= 1.05 * promise and near:
        promise = min(promise, check(every))
    return promise


def prepare_hf_for_training(model: nn.Module) -> tuple[tuple[str, ...], Callable[[], None]]:
    """Hugging Face specifics, before profiling (Note [Hugging Face]). Returns notes for the plan and a
    function that puts everything back (called when optimize_checkpointing fails).

    Note [Hugging Face]
    ~~~~~~~~~~~~~~~~~~~
    * ``config.use_cache``: a KV cache built in a checkpointed forward is built again on recompute,
      and training does not need it; remat sets it to False and says so.
    * ``gradient_checkpointing_enable()`` makes each decoder layer checkpoint itself; combined with
      remat's plan, layers would be checkpointed twice. remat takes over: it turns the model's own
      flags off (``gradient_checkpointing_disable()`` does the same) and says so.
    """
    notes: list[str] = []
    undo_steps: list[Callable[[], None]] = []
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if flagged:
        for m in flagged:
            m.gradient_checkpointing = False
        undo_steps.append(lambda: [setattr(m, "gradient_checkpointing", True) for m in flagged])
        notes.append(
            f"took over from the model's own gradient checkpointing (gradient_checkpointing_enable() on "
            f"{len(flagged)} modules): turned off, remat's plan replaces it"
        )
    # every distinct config: encoder-decoder models (T5) give their decoder stack its own copy, whose
    # cache made the cross-attention's recomputation save fewer tensors than its forward
    configs = list({id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", False)
                    is True}.values())
    if configs:
        for c in configs:
            c.use_cache = False
        undo_steps.append(lambda: [setattr(c, "use_cache", True) for c in configs])
        notes.append("set model.config.use_cache = False" + (f" (and on {len(configs) - 1} sub-configs)"
                     if len(configs) > 1 else "") + ": a KV cache would be rebuilt by every recomputation "
                     "and training does not use it")

    def undo() -> None:
        for step in reversed(undo_steps):
            step()

    return tuple(notes), undo


def apply_plan(model: nn.Module, plan: Plan) -> None:
    """Checkpoint ``model`` as ``plan`` says, without profiling (mutates ``model``).

    Raises PlanMismatchError when the model's parameter names or shapes differ from the
    model the plan was made for, a planned module is missing, or the model is trained by another number
    of ranks or wrapped otherwise than the plan was made for (a plan made under FSDP2 or DDP applies on
    every rank of the same set-up)."""
    if not isinstance(plan, Plan):
        raise PlanMismatchError(f"expected a remat.Plan, got {type(plan).__name__}")
    model = uncompiled(model)
    wrapping = wrapping_of(model)
    if (plan.world_size, plan.wrapping) != (wrapping.world_size, str(wrapping) if wrapping.world_size > 1 else ""):
        raise PlanMismatchError(
            f"this plan was made for {plan.wrapping or 'one process'} ({plan.world_size} rank(s)), but this model "
            f"is trained by {wrapping} ({wrapping.world_size} rank(s)): per-rank memory depends on both; run "
            "optimize_checkpointing on every rank of this set-up to make a new plan"
        )
    if plan.model_signature:
        mine = dict(model_signature(model))
        theirs = dict(plan.model_signature)
        missing = sorted(theirs.keys() - mine.keys())
        extra = sorted(mine.keys() - theirs.keys())
        shapes = sorted(n for n in theirs.keys() & mine.keys() if tuple(theirs[n]) != tuple(mine[n]))
        if missing or extra or shapes:
            parts = []
            if missing:
                parts.append(f"parameters missing from the model: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
            if extra:
                parts.append(f"parameters not in the plan's model: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
            if shapes:
                n = shapes[0]
                parts.append(f"{len(shapes)} parameter(s) of another shape, e.g. {n}: plan {tuple(theirs[n])}, "
                             f"model {tuple(mine[n])}")
            raise PlanMismatchError(
                "this plan was made for another model (" + "; ".join(parts) + "); run optimize_checkpointing "
                "on this model to make a new plan"
            )
    absent = check_units(model, plan.checkpointed)
    if absent:
        raise PlanMismatchError(f"the plan checkpoints units this model does not have: {absent}")
    if plan.checkpointed:
        for note in prepare_hf_for_training(model)[0]:
            log.warning("remat.apply_plan: %s", note)
    remove_checkpointing(model)
    checkpoint_plan(model, plan)

