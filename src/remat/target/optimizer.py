"""The user's optimizer on a GPU target, never called (Note [Never call the user's optimizer]): an independent
optimizer of its class and settings over the fake (sharded) parameters, its state and step's temporaries as the
target's allocator counts them and its step timed by the device model (for remat.target.source)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.costs.device_time import DeviceRates
from remat.profile.optimizer import NO_OPTIMIZER, OptimizerCost, hyperparameters, independent_copy, optimizer_costs
from remat.runtime.measure import allocated_bytes
from remat.target.timing import OperatorTimes

if TYPE_CHECKING:
    from remat.target.world import Target

__all__ = ["fake_optimizer", "optimizer_cost", "optimizer_seconds"]


def _cuda_bytes(nbytes: int) -> int:
    """``nbytes`` as the CUDA caching allocator's block (Note [CUDA block size] in remat.runtime.tracker)."""
    return allocated_bytes(nbytes, torch.device("cuda"))


def optimizer_seconds(optimizer: torch.optim.Optimizer | None, user_model: nn.Module, fake: nn.Module,
                       target: Target, rates: DeviceRates) -> float:
    """The optimizer step's predicted seconds on the target (gradient clipping included when the target clips):
    a steady-state step (the second) of an independent optimizer of the same class and settings over the fake
    (sharded) parameters, each operator timed by the device model."""
    opt = fake_optimizer(optimizer, user_model, fake, target)
    if opt is None:
        return 0.0
    params = [p for g in opt.param_groups for p in g["params"]]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        type(opt).step(opt)  # the first step creates the state
        with OperatorTimes(rates, target) as timed:
            if target.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, target.clip_grad_norm, foreach=True)
            type(opt).step(opt)
        return timed.seconds
    finally:
        for p in params:
            p.grad = None


def fake_optimizer(optimizer: torch.optim.Optimizer | None, user_model: nn.Module, fake: nn.Module,
                    target: Target) -> torch.optim.Optimizer | None:
    """An independent optimizer of ``optimizer``'s class and settings over the fake model's parameters (Note
    [Never call the user's optimizer]), ``foreach`` on a CUDA target unless the user's says otherwise."""
    if optimizer is None:
        return None
    names = {id(p): n for n, p in user_model.named_parameters()}
    fakes = dict(fake.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        hp = hyperparameters(group)
        if target.is_cuda and hp.get("foreach") is None and not hp.get("fused"):
            hp["foreach"] = True  # torch's default for CUDA tensors (Note [Target kernels])
        params = [fakes[names[id(p)]] for p in group["params"] if id(p) in names and p.requires_grad]
        if params:
            groups.append({**hp, "params": params})
    if not groups:
        return None
    first = {k: v for k, v in groups[0].items() if k != "params"}
    opt = independent_copy(optimizer, first, groups[0]["params"])
    for g in groups[1:]:
        opt.add_param_group(g)
    return opt


def optimizer_cost(optimizer: torch.optim.Optimizer | None, user_model: nn.Module, fake: nn.Module, mode: Any,
                    target: Target) -> OptimizerCost:
    """The optimizer's state and one step's temporaries on the target, as remat accounts them where it runs
    (``optimizer_costs``: shadows of each parameter stepped twice), on shadows like the fake (sharded) parameters,
    ``foreach`` on a CUDA target (Note [Target kernels]); blocks rounded as the target's allocator rounds them."""
    if optimizer is None:
        return NO_OPTIMIZER
    fakes = dict(fake.named_parameters())
    like = {id(p): fakes[n] for n, p in user_model.named_parameters() if n in fakes}
    with mode:
        cost = optimizer_costs(optimizer, torch.device("cpu"), like=like, foreach=True if target.is_cuda else None)
    if not target.is_cuda:
        return dataclasses.replace(cost, step_s=0.0)
    # (rounded as wholes: AdamW's step counters, a few bytes each, live in host memory on CUDA)
    return OptimizerCost(_cuda_bytes(cost.state_bytes), _cuda_bytes(cost.step_bytes), 0.0, cost.label)
