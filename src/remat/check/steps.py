"""Real training steps of a model, measured: peak memory and step time of whole steps (forward, backward,
optimizer step), on a deep copy of the model (``measure_step``, ``warm_up``; ``measure_plans`` applies
each plan in turn to one copy) or, for
models that cannot be copied (sharded by FSDP2, replicated by DDP), in place (``measure_step_in_place``).
Built on the one measurement layer in ``remat.runtime.measure``."""

from __future__ import annotations

import contextlib
import copy
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from remat.runtime.measure import (
    Clock,
    LossFn,
    OptimizerFactory,
    default_loss,
    found_storages_are_fresh,
    input_tensors,
    measure_peak,
    model_device,
    run_step,
    split_inputs,
)
from remat.runtime.state import keeps_rng


@dataclass(frozen=True)
class StepMeasurement:
    """Measured peak memory and step time of real training steps."""

    #: highest memory during one step, all of it: parameters, gradients, optimizer state, activations (bytes)
    peak_bytes: int
    #: median wall time of the timed steps (seconds)
    step_time_s: float
    #: every timed step (seconds), in order
    step_times_s: tuple[float, ...]
    #: how the peak was measured: "cuda allocator" or "live tensor storages (CPU)"
    method: str


def as_factory(optimizer: torch.optim.Optimizer | OptimizerFactory | None,
               model: nn.Module) -> OptimizerFactory | None:
    """``measure_step``'s optimizer argument as a factory of optimizers over a copy's parameters: a factory is
    itself; an optimizer instance (what ``optimize_checkpointing`` takes, e.g. from a model's own
    ``configure_optimizers``) gives new optimizers of its class with its parameter groups' settings over the
    copy's parameters at the same positions in ``model.parameters()`` (built by the class's constructor and
    ``add_param_group`` of the new optimizer: the user's is never called, Note [Never call the user's
    optimizer])."""
    if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    from remat.profile.optimizer import hyperparameters, independent_copy

    position = {id(p): i for i, p in enumerate(model.parameters())}
    groups = [([position[id(p)] for p in g["params"] if id(p) in position], hyperparameters(g))
              for g in optimizer.param_groups]
    groups = [(idx, hp) for idx, hp in groups if idx]

    def factory(params) -> torch.optim.Optimizer:
        params = list(params)
        (first, hp), rest = groups[0], groups[1:]
        opt = independent_copy(optimizer, hp, [params[i] for i in first])
        for idx, hp in rest:
            opt.add_param_group({"params": [params[i] for i in idx], **hp})
        return opt

    return factory if groups else None


class _Trainee:
    """One deep copy of ``model`` without gradients, and its optimizer (``optimizer_factory``: a factory or an
    optimizer instance, :func:`as_factory`), on which training steps run. With ``plans``, the copy starts plain
    (remat's checkpointing removed) and each plan is applied in turn (:meth:`under`): however many plans are
    measured, one copy of the model and one optimizer state exist at a time (issue #23: one copy per plan
    held 3.3x a plain training process's memory at GPT-2-small size). Without, the copy is checkpointed as
    ``model`` is."""

    def __init__(self, model: nn.Module, optimizer_factory: Any, *, plans: bool = False, in_place: bool = False) -> None:
        """``in_place``: train ``model`` itself (sharded or replicated models, which cannot be copied)."""
        from remat.rewrite import remove_checkpointing

        factory = as_factory(optimizer_factory, model)
        self.model = model if in_place else copy.deepcopy(model)
        if plans:
            remove_checkpointing(self.model)
        self.model.zero_grad(set_to_none=True)
        self.optimizer = factory(self.model.parameters()) if factory else None

    @contextlib.contextmanager
    def under(self, plan: Any) -> Iterator[None]:
        """The copy checkpointed as ``plan`` says while the block runs, plain again after."""
        from remat.rewrite import checkpoint_plan, remove_checkpointing

        checkpoint_plan(self.model, plan)
        try:
            yield
        finally:
            remove_checkpointing(self.model)

    def step(self, args: tuple, kwargs: dict, loss_fn: LossFn, output_alive: bool = True) -> None:
        run_step(self.model, args, kwargs, loss_fn, output_alive=output_alive, optimizer=self.optimizer)
        if self.optimizer is None:
            self.model.zero_grad(set_to_none=True)

    def peak(self, args: tuple, kwargs: dict, loss_fn: LossFn, output_alive: bool = True) -> int:
        """The peak of one step, all of it (parameters, buffers, inputs, optimizer state, the step's own)."""
        from remat.runtime.distributed import wrapping_of

        m, opt = self.model, self.optimizer
        state = [*m.parameters(), *m.buffers(), *input_tensors(args, kwargs)]
        if opt is not None:
            state += [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        with found_storages_are_fresh(wrapping_of(m).kind == "fsdp2"):  # Note [Memory found]
            return measure_peak(lambda live_now: self.step(args, kwargs, loss_fn, output_alive), model_device(m),
                                state)


@keeps_rng
def measure_step(
    model: nn.Module, example_inputs: Any, *, loss_fn: LossFn | None = None,
    optimizer_factory: OptimizerFactory | torch.optim.Optimizer | None = None, warmup: int = 1, repeats: int = 3,
    measure_memory: bool = True, output_alive: bool = True,
) -> StepMeasurement:
    """Measured peak memory (whole step) and median step time of real training steps of ``model``.
    ``output_alive``: whether the loop keeps the output until the step ends (Note [Loop style]).

    Trains a deep copy (``model`` is not modified) with ``optimizer_factory(params)`` (None: no optimizer
    step; gradients are set to None after each step); ``optimizer_factory`` may also be an optimizer instance,
    the argument ``optimize_checkpointing`` takes (its class and settings are copied, :func:`as_factory`). Runs ``warmup`` untimed steps (which create the
    optimizer state), ``repeats`` timed steps, then one step under :func:`measure_peak`."""
    trainee = _Trainee(model, optimizer_factory)
    return _measured_steps(trainee, example_inputs, loss_fn or default_loss, warmup=warmup, repeats=repeats,
                           measure_memory=measure_memory, output_alive=output_alive)


def measure_step_in_place(
    model: nn.Module, example_inputs: Any, *, loss_fn: LossFn | None = None,
    optimizer_factory: OptimizerFactory | None = None, warmup: int = 1, repeats: int = 3,
    measure_memory: bool = True, output_alive: bool = True,
) -> StepMeasurement:
    """:func:`measure_step` on ``model`` itself, for models that cannot be deep-copied (sharded by FSDP2,
    replicated by DDP): it **trains** ``model`` (its parameters change) with a new optimizer; for throwaway
    models such as the command line's targets under torchrun. Every rank must call it alike."""
    trainee = _Trainee(model, optimizer_factory, in_place=True)
    return _measured_steps(trainee, example_inputs, loss_fn or default_loss, warmup=warmup, repeats=repeats,
                           measure_memory=measure_memory, output_alive=output_alive)


def _measured_steps(trainee: _Trainee, example_inputs: Any, loss_fn: LossFn, *, warmup: int, repeats: int,
                    measure_memory: bool, output_alive: bool) -> StepMeasurement:
    args, kwargs = split_inputs(example_inputs)
    clock = Clock(model_device(trainee.model))
    for _ in range(warmup):
        trainee.step(args, kwargs, loss_fn, output_alive)
    times = [clock.time(lambda: trainee.step(args, kwargs, loss_fn, output_alive)) for _ in range(repeats)]
    median = statistics.median(times) if times else 0.0
    if not measure_memory:
        return StepMeasurement(0, median, tuple(times), "not measured")
    peak = trainee.peak(args, kwargs, loss_fn, output_alive)
    return StepMeasurement(peak, median, tuple(times), _method(trainee.model))


def _method(model: nn.Module) -> str:
    return "cuda allocator" if model_device(model).type == "cuda" else "live tensor storages (CPU)"


@keeps_rng
def warm_up(
    model: nn.Module, example_inputs: Any, *, loss_fn: LossFn | None = None,
    optimizer_factory: OptimizerFactory | None = None, seconds: float = 3.0, max_steps: int = 50,
) -> int:
    """Run training steps on a deep copy of ``model`` until three consecutive step times agree within
    5%, ``seconds`` pass or ``max_steps`` run (see Note [Warm-up] in remat.sweeps.report). Returns the steps run."""
    args, kwargs = split_inputs(example_inputs)
    return _warm(_Trainee(model, optimizer_factory), args, kwargs, loss_fn or default_loss, seconds, max_steps)


def _warm(trainee: _Trainee, args: tuple, kwargs: dict, loss_fn: LossFn, seconds: float, max_steps: int = 50,
          output_alive: bool = True) -> int:
    clock = Clock(model_device(trainee.model))
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_steps and time.perf_counter() - start < seconds:
        times.append(clock.time(lambda: trainee.step(args, kwargs, loss_fn, output_alive)))
        last = times[-3:]
        if len(times) >= 5 and max(last) <= 1.05 * min(last):
            break
    return len(times)


@keeps_rng
def measure_plans(
    model: nn.Module, example_inputs: Any, plans: list, *, loss_fn: LossFn | None = None,
    optimizer_factory: OptimizerFactory | torch.optim.Optimizer | None = None, warm_with: Any = None,
    warmup_s: float = 0.0, warmup: int = 2, repeats: int = 5, interleave: bool = True, seed: int = 0,
    output_alive: bool = True, progress: Any = None,
) -> list[StepMeasurement]:
    """Each plan's measured peak and step times, every step on one deep copy of ``model`` (plain, each plan
    applied in turn, :class:`_Trainee`; ``model`` itself is not modified). First the copy warms up (Note
    [Warm-up] in remat.sweeps.report) for up to ``warmup_s`` seconds under ``warm_with`` (a plan; the least-memory
    one, so that warming up fits wherever the plans do); then each plan runs one step and one measured step
    (its peak); then the steps are timed: with ``interleave``, ``2 * repeats`` rounds of one step per plan
    in a shuffled order after ``warmup`` such rounds (Note [Interleaved timing]); without, ``warmup`` and
    ``repeats`` steps per plan in turn."""
    loss_fn = loss_fn or default_loss
    say = progress or (lambda message: None)
    args, kwargs = split_inputs(example_inputs)
    trainee = _Trainee(model, optimizer_factory, plans=True)
    clock = Clock(model_device(model))
    if warmup_s > 0:
        say("warming up")
        with trainee.under(warm_with if warm_with is not None else plans[0]):
            _warm(trainee, args, kwargs, loss_fn, warmup_s, output_alive=output_alive)
    peaks = []
    for i, plan in enumerate(plans):
        say(f"measuring the peak of {plan.strategy} ({len(plan.checkpointed)} units) [{i + 1}/{len(plans)}]")
        with trainee.under(plan):
            trainee.step(args, kwargs, loss_fn, output_alive)
            peaks.append(trainee.peak(args, kwargs, loss_fn, output_alive))
    say("timing steps")

    def timed(plan) -> float:
        with trainee.under(plan):
            return clock.time(lambda: trainee.step(args, kwargs, loss_fn, output_alive))

    times: list[list[float]] = [[] for _ in plans]
    if interleave:
        times = _interleaved(timed, plans, warmup, 2 * repeats, seed)
    else:
        for i, plan in enumerate(plans):
            for _ in range(warmup):
                timed(plan)
            times[i] = [timed(plan) for _ in range(repeats)]
    method = _method(trainee.model)
    return [StepMeasurement(peak, statistics.median(ts) if ts else 0.0, tuple(ts), method)
            for peak, ts in zip(peaks, times)]


def time_plans_in_place(
    model: nn.Module, plans: list, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, *,
    output_alive: bool = True, rounds: int = 5, warmup: int = 1, seed: int = 0,
    still: Callable[[list[list[float]]], Sequence[int]] | None = None,
) -> list[tuple[float, ...]]:
    """Each plan's forward and backward timed on ``model`` itself (no copy: a model that fits the budget once is
    not held twice), up to ``rounds`` rounds of one step per plan in a shuffled order after ``warmup`` rounds (Note
    [Interleaved timing]), so that round ``r``'s steps of two plans are one paired comparison. ``still(times)``,
    asked before each round with the times so far: the indices of the plans that round times (a sequential
    comparison stops timing what it has decided); the rounds end when it gives fewer than two. The optimizer is
    not stepped (it is the same for every plan and remat never calls the user's: Note [Never call the user's
    optimizer]). The model's gradients, buffers and RNG state are as they were, and it is left without
    checkpointing."""
    from remat.rewrite import checkpoint_plan, remove_checkpointing
    from remat.runtime.measure import trainable_parameters
    from remat.runtime.state import fresh_grads, preserved

    clock = Clock(device)
    leaves = [*trainable_parameters(model), *(t for t in input_tensors(args, kwargs) if t.requires_grad and t.is_leaf)]

    def timed(plan) -> float:
        remove_checkpointing(model)
        checkpoint_plan(model, plan)
        for t in leaves:  # every step starts as the first, its gradients None (Note [Loop style])
            t.grad = None
        return clock.time(lambda: run_step(model, args, kwargs, loss_fn, output_alive=output_alive))

    try:
        with preserved(model), fresh_grads(leaves):
            times = _interleaved(timed, plans, warmup, rounds, seed, still)
    finally:
        remove_checkpointing(model)
    return [tuple(ts) for ts in times]


def _interleaved(timed: Any, plans: list, warmup: int, rounds: int, seed: int,
                 still: Callable[[list[list[float]]], Sequence[int]] | None = None) -> list[list[float]]:
    """Note [Interleaved timing]: ``warmup`` rounds of ``timed(plan)`` for every plan, then ``rounds`` rounds in a
    shuffled order (``seed``); each plan's timings in round order. ``still``: see :func:`time_plans_in_place`."""
    for _ in range(warmup):
        for plan in plans:
            timed(plan)
    times: list[list[float]] = [[] for _ in plans]
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(range(len(plans))) if still is None else sorted(set(still(times)))
        if still is not None and len(order) < 2:
            break
        rng.shuffle(order)
        for i in order:
            times[i].append(timed(plans[i]))
    return times
