"""The profile stage's front: a model's training step profiled (remat.profile) after Hugging Face specifics are
set aside, and a count of the forwards it ran.

In: the model, inputs, loss, optimizer and loop style. Out: a :class:`~remat.costs.unit_costs.Profile`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from remat._compat import uncompiled
from remat.api.inputs import loop_grads, stage, validate
from remat.capture import ModelGraph, capture
from remat.costs.unit_costs import Profile
from remat.profile import Modelled, profile_model
from remat.rewrite import remove_checkpointing
from remat.runtime.compiled import eager_submodules
from remat.runtime.distributed import Wrapping, wrapping_of
from remat.runtime.measure import LossFn, default_loss, found_storages_are_fresh
from remat.runtime.state import preserved

if TYPE_CHECKING:
    from remat.target import Target


def make_profile(
    model: nn.Module, example_inputs: Any, *, loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None, output_alive: bool = True, grad_accumulation: bool = False,
    zero_grad_after_forward: bool = False, target: Target | None = None,
) -> Profile:
    """Capture and profile one training step of ``model`` on ``example_inputs`` (a tensor, a tuple of
    positional arguments or a dict of keyword arguments), for :class:`remat.Planner`: the measured
    costs every plan is predicted from. Arguments as in :func:`optimize_checkpointing`.

    The model is left as it was, remat's own checkpointing included, and so are its gradients, buffers,
    ``optimizer`` (never called) and the RNG state. The step is profiled as remat will run it: without a
    KV cache or the model's own gradient checkpointing (Note [Hugging Face]), which are given back
    afterwards. ``target``: the step's costs predicted for a device and world that are not here (as in
    :func:`optimize_checkpointing`)."""
    if target is not None:
        from remat.target.source import modelled_request

        req = modelled_request(model, example_inputs, target, loss_fn=loss_fn, optimizer=optimizer,
                               output_alive=output_alive, grad_accumulation=grad_accumulation,
                               zero_grad_after_forward=zero_grad_after_forward)
        return loop_grads(req.source.profile(req), grad_accumulation, zero_grad_after_forward)
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
    modelled: Modelled | None = None,
) -> Profile:
    """``graph``: the model's capture, when already made (on another batch of the same model: its units do not
    depend on the batch). ``memory_known``, ``modelled``: see :func:`remat.profile.profile_model`."""
    wrapping = wrapping or Wrapping()
    wrapped = None if wrapping.kind == "none" else f"the model is wrapped by {wrapping}"
    with preserved(model), found_storages_are_fresh(wrapping.kind == "fsdp2"):
        remove_checkpointing(model)
        with stage("profile", model, args, kwargs, loss_fn, judge=modelled is None):
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
                                 sharded=tuple(name for name, _ in wrapping.fsdp), memory_known=memory_known,
                                 modelled=modelled)


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
