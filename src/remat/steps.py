"""Real training steps of a model, measured: peak memory and step time of whole steps (forward, backward,
optimizer step), on deep copies of the model (``measure_step``, ``warm_up``, ``time_interleaved``) or, for
models that cannot be copied (sharded by FSDP2, replicated by DDP), in place (``measure_step_in_place``).
Built on the one measurement layer in ``remat.measure``."""

from __future__ import annotations

import copy
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.measure import (
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
from remat.state import keeps_rng


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


def _trainee(model: nn.Module, optimizer_factory: OptimizerFactory | None, plan: Any = None):
    """A deep copy of ``model`` (checkpointed as ``plan`` says, when given) without gradients, and its optimizer
    (``optimizer_factory``: a factory or an optimizer instance, :func:`as_factory`)."""
    optimizer_factory = as_factory(optimizer_factory, model)
    m = copy.deepcopy(model)
    if plan is not None:
        from remat.rewrite import checkpoint_plan, remove_checkpointing

        remove_checkpointing(m)
        checkpoint_plan(m, plan)
    m.zero_grad(set_to_none=True)
    return m, optimizer_factory(m.parameters()) if optimizer_factory else None


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
    m, opt = _trainee(model, optimizer_factory)
    return _measured_steps(m, opt, example_inputs, loss_fn or default_loss, warmup=warmup, repeats=repeats,
                           measure_memory=measure_memory, output_alive=output_alive)


def measure_step_in_place(
    model: nn.Module, example_inputs: Any, *, loss_fn: LossFn | None = None,
    optimizer_factory: OptimizerFactory | None = None, warmup: int = 1, repeats: int = 3,
    measure_memory: bool = True, output_alive: bool = True,
) -> StepMeasurement:
    """:func:`measure_step` on ``model`` itself, for models that cannot be deep-copied (sharded by FSDP2,
    replicated by DDP): it **trains** ``model`` (its parameters change) with a new optimizer; for throwaway
    models such as the command line's targets under torchrun. Every rank must call it alike."""
    model.zero_grad(set_to_none=True)
    optimizer_factory = as_factory(optimizer_factory, model)
    opt = optimizer_factory(model.parameters()) if optimizer_factory else None
    return _measured_steps(model, opt, example_inputs, loss_fn or default_loss, warmup=warmup, repeats=repeats,
                           measure_memory=measure_memory, output_alive=output_alive)


def _measured_steps(m: nn.Module, opt: torch.optim.Optimizer | None, example_inputs: Any, loss_fn: LossFn, *,
                    warmup: int, repeats: int, measure_memory: bool, output_alive: bool) -> StepMeasurement:
    from remat.distributed import wrapping_of

    args, kwargs = split_inputs(example_inputs)
    device = model_device(m)
    clock = Clock(device)

    def step() -> None:
        run_step(m, args, kwargs, loss_fn, output_alive=output_alive, optimizer=opt)
        if opt is None:
            m.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    times = [clock.time(step) for _ in range(repeats)]
    median = statistics.median(times) if times else 0.0
    if not measure_memory:
        return StepMeasurement(0, median, tuple(times), "not measured")
    state = [*m.parameters(), *m.buffers(), *input_tensors(args, kwargs)]
    if opt is not None:
        state += [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    with found_storages_are_fresh(wrapping_of(m).kind == "fsdp2"):  # Note [Memory found]
        peak = measure_peak(lambda live_now: step(), device, state)
    return StepMeasurement(peak, median, tuple(times),
                           "cuda allocator" if device.type == "cuda" else "live tensor storages (CPU)")


@keeps_rng
def warm_up(
    model: nn.Module, example_inputs: Any, *, loss_fn: LossFn | None = None,
    optimizer_factory: OptimizerFactory | None = None, seconds: float = 3.0, max_steps: int = 50,
) -> int:
    """Run training steps on a deep copy of ``model`` until three consecutive step times agree within
    5%, ``seconds`` pass or ``max_steps`` run (see Note [Warm-up] in remat.report). Returns the steps run."""
    loss_fn = loss_fn or default_loss
    m, opt = _trainee(model, optimizer_factory)
    args, kwargs = split_inputs(example_inputs)
    clock = Clock(model_device(m))
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_steps and time.perf_counter() - start < seconds:
        times.append(clock.time(lambda: run_step(m, args, kwargs, loss_fn, optimizer=opt)))
        if opt is None:
            m.zero_grad(set_to_none=True)
        last = times[-3:]
        if len(times) >= 5 and max(last) <= 1.05 * min(last):
            break
    return len(times)


@keeps_rng
def time_interleaved(
    model: nn.Module, example_inputs: Any, plans: list, *, loss_fn: LossFn | None = None,
    optimizer_factory: OptimizerFactory | None = None, warmup: int = 2, rounds: int = 10, seed: int = 0,
    output_alive: bool = True,
) -> list[list[float]]:
    """Step times (seconds) of ``model`` under each plan, timed round-robin: every round runs one
    training step of every plan, in a shuffled order, each plan on its own deep copy with its own
    optimizer. ``model`` itself is not modified. Returns one list of ``rounds`` times per plan."""
    loss_fn = loss_fn or default_loss
    args, kwargs = split_inputs(example_inputs)
    clock = Clock(model_device(model))
    copies = [_trainee(model, optimizer_factory, plan) for plan in plans]

    def step(m: nn.Module, opt: torch.optim.Optimizer | None) -> float:
        seconds = clock.time(lambda: run_step(m, args, kwargs, loss_fn, output_alive=output_alive, optimizer=opt))
        if opt is None:
            m.zero_grad(set_to_none=True)
        return seconds

    for _ in range(warmup):
        for m, opt in copies:
            step(m, opt)
    times: list[list[float]] = [[] for _ in copies]
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(range(len(copies)))
        rng.shuffle(order)
        for i in order:
            times[i].append(step(*copies[i]))
    return times



