"""The profile stage's front: a model's training step profiled (remat.profile) after Hugging Face specifics are
set aside, and a count of the forwards it ran.

In: the model, inputs, loss, optimizer and loop style. Out: a :class:`~remat.costs.unit_costs.Profile`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat._compat import uncompiled
from remat.api.hf import prepare_hf_for_training
from remat.api.inputs import loop_grads, validate
from remat.api.source import profile_step
from remat.costs.unit_costs import Profile
from remat.rewrite import eager_submodules
from remat.runtime.distributed import wrapping_of
from remat.runtime.measure import LossFn, default_loss

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
        from remat.api.predict import modelled_request

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
            profile = profile_step(model, args, kwargs, loss_fn=loss_fn, optimizer=optimizer, device=device,
                                    output_alive=output_alive, wrapping=wrapping_of(model))
        return loop_grads(profile, grad_accumulation, zero_grad_after_forward)
    finally:
        undo()


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
