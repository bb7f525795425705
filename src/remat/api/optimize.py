"""``optimize_checkpointing``: the whole pipeline, in place (capture, profile, cost model, solve, check, rewrite).

In: the model, ``budget_gb``, example inputs and the loop's settings. Out: the model checkpointed in place and
its :class:`~remat.solve.plan.Plan`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from remat.api.inputs import loop_grads, model_signature, stage
from remat.api.hf import prepare_hf_for_training
from remat.api.profiling import forwards_counted
from remat.api.request import Request, request
from remat.costs.unit_costs import Profile, parse_region
from remat.rewrite import checkpoint_plan, remove_checkpointing
from remat.rewrite import compiled_nothing_note, eager_submodules
from remat.runtime.measure import LossFn
from remat.runtime.state import preserved
from remat.solve.plan import Plan
from remat.target import ModelledTarget, Target

log = logging.getLogger(__name__)


def optimize_checkpointing(
    model: nn.Module, budget_gb: float, example_inputs: Any, *, loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None, time_limit_s: float | None = 60.0, check: bool = True,
    granularity: str = "op", output_alive: bool = True, grad_accumulation: bool = False,
    zero_grad_after_forward: bool = False, timeout_s: float | None = None, compile: bool | dict | None = None,
    target: Target | None = None, offload: bool | str = False,
) -> Plan:
    """Checkpoint ``model``'s submodules in place so a training step fits ``budget_gb``.

    ``budget_gb`` is GiB (2**30 bytes) of peak memory on the model's device during one whole training step --
    forward, backward and optimizer step: parameters + gradients + optimizer state + activations saved for
    backward + temporaries. ``example_inputs``: a tensor, a tuple of positional or a dict of keyword arguments.
    ``loss_fn(output)`` gives the scalar loss (default: :func:`default_loss`). ``optimizer``'s state after a
    step counts in the budget (None: not counted); remat never calls it (Note [Never call the user's optimizer]).

    ``output_alive`` says how the training loop treats the model's output (Note [Loop style] in remat.profile):
    True (the default) when it stays referenced until the step ends (``out = model(x); loss = crit(out, y);
    loss.backward(); opt.step()``: nanoGPT, most hand-written loops, Lightning's ``training_step`` when it returns
    the output), False when only the loss survives the forward (Hugging Face Trainer, torchtitan's ``del pred``);
    for language models the output (logits) is often the largest single tensor. ``grad_accumulation``: the
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
    recompute (Note [Selective margin] in remat.solve); ``"block"`` checkpoints whole units only ("op" is the
    default: docs/plans.md#selective-op-level-checkpointing says why).

    Mutates ``model`` (the chosen submodules' ``forward`` is checkpointed) and returns the :class:`Plan`. On any
    error the model, its gradients, buffers and the RNG state are left as they were. Raises
    ``InfeasibleBudgetError`` (with the least achievable peak) when no plan fits, ``InvalidInputError`` for bad
    arguments.

    ``compile``: the loop trains the model compiled, so the plan is made and checked for the compiled step
    (Note [Compiled steps] in remat.solve.calibrated): True (``torch.compile``'s defaults), or a dict of the
    ``torch.compile`` settings the loop uses (``backend``, ``mode``, ``options``, ``fullgraph``, ``dynamic``).
    None (the default) detects it: a model wrapped by ``torch.compile`` or with submodules compiled in place
    (``block.compile()``, torchtitan's order) is planned for its compiled step; False plans the eager step.
    The predicted and checked peaks are then the compiled step's, measured by allocator events on compiled steps
    of 1-7 plans; the model is profiled eagerly and recompiles on its next call (docs/compile.md).

    Distributed training (FSDP2 ``fully_shard``, DDP): call it on every rank, on the model as it will train;
    ``budget_gb`` is per rank. Every rank gets the same plan (Note [One plan for every rank] in
    remat.runtime.distributed); ``timeout_s`` bounds the wait for the other ranks (default 300 s). ``target``: plan
    for a device and world that are not here (:class:`remat.Target`, docs/targets.md). ``offload``: units'
    activations may also go to host memory (docs/offload.md): False (default), True, "auto".
    """
    req = request(model, budget_gb, example_inputs, loss_fn=loss_fn, optimizer=optimizer, time_limit_s=time_limit_s,
                  check=check, granularity=granularity, output_alive=output_alive, grad_accumulation=grad_accumulation,
                  zero_grad_after_forward=zero_grad_after_forward, timeout_s=timeout_s, compile=compile, offload=offload,
                  source=None if target is None else ModelledTarget(target))
    model = req.model
    with planned_in_training(model) as trained_notes:
        return _optimize(req, model, trained_notes)


def _optimize(req: Request, model: nn.Module, trained_notes: tuple[str, ...]) -> Plan:
    notes, undo = prepare_hf_for_training(model)
    notes += trained_notes
    notes += tuple(n for n in (compiled_nothing_note(model),) if n)
    started = time.perf_counter()
    try:
        # (not for a compiled loop: Dynamo warns about global module hooks and would trace them)
        with preserved(model, on_success=False), eager_submodules(model), \
                forwards_counted(model) if req.loop is None else contextlib.nullcontext({}) as runs:
            profile = req.source.profile(req)
            profile = loop_grads(profile, req.grad_accumulation, req.zero_grad_after_forward)
            profiled = time.perf_counter()
            notes += (req.default.note,) if req.default is not None and req.default.note else ()
            plan, chosen_notes = req.source.choose(req, req.planner(profile, regions=req.loop is None), profile)
            notes += chosen_notes + req.offload_notes + _planning_notes(req, profile, plan, started, profiled, runs)
            plan = dataclasses.replace(plan, model_signature=model_signature(model), notes=plan.notes + notes)
            with stage("rewrite", model, req.args, req.kwargs, req.loss_fn):
                remove_checkpointing(model)
                checkpoint_plan(model, plan)
    except BaseException:
        undo()
        raise
    log.info("remat: checkpointed %d units, offloaded %d", len(plan.checkpointed), len(plan.offloaded))
    return plan


@contextlib.contextmanager
def planned_in_training(model: nn.Module) -> Iterator[tuple[str, ...]]:
    """Note [Planned in training mode]: ``optimize_checkpointing`` plans a training step, and a model wholly in eval
    mode (every module's ``training`` False: ``model.eval()``, or Hugging Face's ``from_pretrained``) was recorded
    as it was -- no dropout, normalisation layers as they evaluate -- and that plan then applied to training (issue
    #62). So such a model is put in training mode (as ``model.train()`` does) while it is planned, the plan's notes
    say so, and every module's flag is given back as it was, on success and on failure. A model with some modules in
    eval mode (frozen normalisation layers) is planned as it is: that is a choice of the loop's."""
    flags = [(m, m.training) for m in model.modules()]
    if any(training for _, training in flags):
        yield ()
        return
    for m, _ in flags:  # (the flags themselves: a module's own train() is the user's code)
        m.training = True
    try:
        yield ("the model was in eval mode (model.eval(), or as Hugging Face's from_pretrained returns it): planned "
               "for its training step (model.train(): dropout drawing, normalisation layers in training mode), and "
               "given back in eval mode; a loop that trains it in eval mode runs another step (no dropout masks)",)
    finally:
        for m, training in flags:
            m.training = training


def _planning_notes(req: Request, profile: Profile, plan: Plan, started: float, profiled: float,
                    runs: dict) -> tuple[str, ...]:
    """What the plan's notes say of how it was made: one plan for every rank, regions left out under compile (or
    checkpointed whole if an eager plan is compiled later), where the time went."""
    notes: tuple[str, ...] = ()
    if req.ranks is not None:
        notes += (f"one plan for every rank ({req.wrapping}): the per-rank budget holds on the worst rank",)
    regions = [u for u in plan.checkpointed if parse_region(u) is not None]
    if req.loop is None and regions:  # Note [Regions under torch.compile] in remat.rewrite.forwards
        notes += (f"if the model is compiled later (torch.compile), each module cut into regions ({', '.join(regions)})"
                  " is checkpointed whole in the compiled step: Dynamo cannot trace a region's program",)
    if req.loop is not None and any(u.is_region for u in profile.candidates()):
        notes += ("regions of modules' forwards (Note [Regions] in remat.capture) are not offered for a "
                  "compiled loop: their forward runs a traced graph node by node, untested under compile",)
    if isinstance(req.source, ModelledTarget):
        return notes + (f"planning took {time.perf_counter() - started:.1f} s on this machine: the step recorded "
                         f"on fake tensors {profiled - started:.1f} s, solve and the allocator's replay "
                         f"{time.perf_counter() - profiled:.1f} s; nothing ran for real",)
    notes += (f"planning took {time.perf_counter() - started:.1f} s: profile {profiled - started:.1f} s, "
              f"solve{' and check' if req.check else ''} {time.perf_counter() - profiled:.1f} s (one plain step "
              f"measured {profile.step_time_s:.3f} s)" + (
                  f"; the model's forward ran {runs['real']} times for real (training steps, and forward-only "
                  f"passes that check the recording) and {runs['fake']} on fake tensors (no kernels)"
                  if runs else ""),)
    return notes
