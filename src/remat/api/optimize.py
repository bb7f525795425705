"""``optimize_checkpointing``: the whole pipeline, in place (capture, profile, cost model, solve, check, rewrite).

In: the model, ``budget_gb``, example inputs and the loop's settings. Out: the model checkpointed in place and
its :class:`~remat.solve.plan.Plan`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch
from torch import nn

from remat._compat import uncompiled
from remat.api.checking import _ranks_reading, checked_reading, least_checked, plan_checked, proved_compiled
from remat.api.inputs import loop_grads, model_signature, stage, validate
from remat.api.profiling import _make_profile, forwards_counted, prepare_hf_for_training
from remat.check.verify import CompiledComparison
from remat.costs.unit_costs import Profile
from remat.rewrite import checkpoint_plan, remove_checkpointing
from remat.runtime.compiled import CompiledLoop, compiled_loop, compiled_nothing_note, eager_submodules
from remat.runtime.distributed import Ranks, Wrapping, ranks_for, steps_checked
from remat.runtime.measure import DefaultLoss, LossFn
from remat.runtime.state import preserved
from remat.solve import Planner
from remat.solve.calibrated import plan_compiled
from remat.solve.plan import Plan

log = logging.getLogger(__name__)


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
    req = _request(model, budget_gb, example_inputs, loss_fn=loss_fn, optimizer=optimizer, time_limit_s=time_limit_s,
                   check=check, granularity=granularity, output_alive=output_alive,
                   grad_accumulation=grad_accumulation, zero_grad_after_forward=zero_grad_after_forward,
                   timeout_s=timeout_s, compile=compile)
    model = req.model
    notes, undo = prepare_hf_for_training(model)
    notes += tuple(n for n in (compiled_nothing_note(model),) if n)
    started = time.perf_counter()
    first = _MemoryFirst(req)
    try:
        # (not for a compiled loop: Dynamo warns about global module hooks and would trace them)
        with preserved(model, on_success=False), eager_submodules(model), \
                forwards_counted(model) if req.loop is None else contextlib.nullcontext({}) as runs:
            profile = _make_profile(model, req.args, req.kwargs, loss_fn=req.loss_fn, optimizer=optimizer,
                                    device=req.device, output_alive=output_alive, wrapping=req.wrapping,
                                    memory_known=first if req.loop is None else None)
            profile = loop_grads(profile, grad_accumulation, zero_grad_after_forward)
            profiled = time.perf_counter()
            notes += (req.default.note,) if req.default is not None and req.default.note else ()
            plan, chosen_notes = _choose(req, req.planner(profile, regions=req.loop is None), profile, first)
            notes += chosen_notes + _planning_notes(req, profile, started, profiled, runs)
            plan = dataclasses.replace(plan, model_signature=model_signature(model), notes=plan.notes + notes)
            with stage("rewrite", model, req.args, req.kwargs, req.loss_fn):
                remove_checkpointing(model)
                checkpoint_plan(model, plan)
    except BaseException:
        undo()
        raise
    log.info("remat: checkpointed %d units; predicted peak %d bytes", len(plan.checkpointed),
             plan.predicted_peak_bytes)
    return plan


@dataclasses.dataclass(frozen=True)
class _Request:
    """One call of :func:`optimize_checkpointing`, its arguments checked: what each of its steps reads."""

    #: the module itself (``torch.compile``'s wrapper looked through)
    model: nn.Module
    budget_bytes: int
    args: tuple
    kwargs: dict
    device: torch.device
    loss_fn: LossFn
    #: the default loss, when the user gave none (its note goes into the plan)
    default: DefaultLoss | None
    #: how the loop compiles the model; None: eager
    loop: CompiledLoop | None
    wrapping: Wrapping
    #: the other ranks, when distributed
    ranks: Ranks | None
    time_limit_s: float | None
    check: bool
    granularity: str
    grad_accumulation: bool
    zero_grad_after_forward: bool

    def planner(self, profile: Profile, **kwargs: Any) -> Planner:
        """The planner over ``profile`` for this call (every rank's profile gathered, when distributed)."""
        return Planner(profile, time_limit_s=self.time_limit_s, granularity=self.granularity,
                       ranks=self.ranks.gather(profile) if self.ranks is not None else None, **kwargs)


def _request(given: nn.Module, budget_gb: float, example_inputs: Any, *, loss_fn: LossFn | None,
             optimizer: torch.optim.Optimizer | None, time_limit_s: float | None, check: bool, granularity: str,
             output_alive: bool, grad_accumulation: bool, zero_grad_after_forward: bool, timeout_s: float | None,
             compile: bool | dict | None) -> _Request:
    """The arguments checked, the loop's compilation found, and the other ranks met (every rank must ask the same)."""
    model = uncompiled(given)
    budget_bytes, args, kwargs, device = validate(model, budget_gb, example_inputs)
    default = DefaultLoss() if loss_fn is None else None
    loop = compiled_loop(given, model, compile)
    wrapping, ranks = ranks_for(model, timeout_s, same=dict(
        budget_gb=budget_gb, granularity=granularity, output_alive=output_alive, check=check,
        grad_accumulation=grad_accumulation, zero_grad_after_forward=zero_grad_after_forward,
        time_limit_s=time_limit_s, optimizer=None if optimizer is None else type(optimizer).__name__,
        compiled=str(loop)))
    return _Request(model=model, budget_bytes=budget_bytes, args=args, kwargs=kwargs, device=device,
                    loss_fn=loss_fn or default, default=default, loop=loop, wrapping=wrapping, ranks=ranks,
                    time_limit_s=time_limit_s, check=check, granularity=granularity,
                    grad_accumulation=grad_accumulation, zero_grad_after_forward=zero_grad_after_forward)


class _MemoryFirst:
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

    def __init__(self, req: _Request) -> None:
        self.req = req
        #: checked peaks by plan
        self.checked: dict[tuple[str, ...], int] = {}
        #: the planner over the profile as memory alone gave it
        self.by_memory: list[Planner] = []

    def __call__(self, memory: Profile) -> None:
        req = self.req
        memory = loop_grads(memory, req.grad_accumulation, req.zero_grad_after_forward)
        planner = req.planner(memory)
        self.by_memory.append(planner)
        if req.budget_bytes >= planner.min_peak_bytes:
            return
        if not req.check:
            raise planner.infeasible(req.budget_bytes)
        with stage("check", req.model, req.args, req.kwargs, req.loss_fn):
            promise = least_checked(req.model, req.args, req.kwargs, req.loss_fn, req.device, planner,
                                    req.budget_bytes, ranks=req.ranks, checked=self.checked)
        if req.budget_bytes < promise:
            raise planner.infeasible(req.budget_bytes, least_bytes=promise,
                                     steps=max(steps_checked(req.model, req.device), 1))

    def least(self, planner: Planner) -> list[Plan]:
        """The least-memory plan as memory alone chooses it (its units, timed by the full profile's planner)."""
        if not self.by_memory:
            return []
        return [planner.make_plan(self.by_memory[0].least_memory().checkpointed, "least-memory")]


def _choose(req: _Request, planner: Planner, profile: Profile, first: _MemoryFirst) -> tuple[Plan, tuple[str, ...]]:
    """The plan for the budget: checked on compiled steps and proved (a compiled loop), checked on real steps, or
    as predicted (``check=False``); one for every rank. Returns it with its notes."""
    model, args, kwargs, loss_fn, device, ranks = req.model, req.args, req.kwargs, req.loss_fn, req.device, req.ranks
    notes: tuple[str, ...] = ()
    if req.check and req.loop is not None:
        loop = req.loop
        compare = CompiledComparison(loop) if ranks is None else None
        with stage("check", model, args, kwargs, loss_fn):
            plan = plan_compiled(
                planner, req.budget_bytes, lambda p: _ranks_reading(ranks, checked_reading(
                    model, p, args, kwargs, loss_fn, device, profile, loop, compare=compare)),
                agree=ranks.broadcast if ranks is not None else (lambda p: p), loop=str(loop))
            notes += (proved_compiled(model, plan, args, kwargs, loss_fn, loop, compare),)
    elif req.check:
        with stage("check", model, args, kwargs, loss_fn):
            plan = plan_checked(model, args, kwargs, loss_fn, device, planner, req.budget_bytes, ranks=ranks,
                                checked=first.checked, more_fallbacks=lambda: first.least(planner))
    else:
        plan = planner.plan_for_budget(req.budget_bytes)
        plan = ranks.broadcast(plan) if ranks is not None else plan
    return plan, notes


def _planning_notes(req: _Request, profile: Profile, started: float, profiled: float, runs: dict) -> tuple[str, ...]:
    """What the plan's notes say of how it was made: one plan for every rank, regions left out under compile, where
    the time went."""
    notes: tuple[str, ...] = ()
    if req.ranks is not None:
        notes += (f"one plan for every rank ({req.wrapping}): the per-rank budget holds on the worst rank",)
    if req.loop is not None and any(u.is_region for u in profile.candidates()):
        notes += ("regions of modules' forwards (Note [Regions] in remat.capture) are not offered for a "
                  "compiled loop: their forward runs a traced graph node by node, untested under compile",)
    notes += (f"planning took {time.perf_counter() - started:.1f} s: profile {profiled - started:.1f} s, "
              f"solve{' and check' if req.check else ''} {time.perf_counter() - profiled:.1f} s (one plain step "
              f"measured {profile.step_time_s:.3f} s)" + (
                  f"; the model's forward ran {runs['real']} times for real (training steps, and forward-only "
                  f"passes that check the recording) and {runs['fake']} on fake tensors (no kernels)"
                  if runs else ""),)
    return notes
