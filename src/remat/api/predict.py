"""Predictions for a target outside :func:`remat.optimize_checkpointing` (a front door: the request made as the
call makes it, its source a fresh :class:`~remat.target.source.ModelledTarget`): a profile's request and the
allocator's peaks replayed for a plan."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat.api.request import Request, request
from remat.costs.allocator import AllocatorPeaks
from remat.solve.plan import Plan
from remat.target.source import ModelledTarget
from remat.target.world import Target

__all__ = ["modelled_request", "predict_peaks"]


def predict_peaks(model: nn.Module, example_inputs: Any, target: Target, *, loss_fn: Any = None,
                  optimizer: torch.optim.Optimizer | None = None, output_alive: bool = True,
                  plan: Plan | None = None) -> AllocatorPeaks:
    """The peaks the target's CUDA caching allocator is predicted to reach over two training steps of ``model``
    (with ``plan`` applied, or as it is: its own checkpointing included), recorded on fake tensors in the
    target's world: predicted, not measured. Changes nothing of the user's."""
    req = modelled_request(model, example_inputs, target, loss_fn=loss_fn, optimizer=optimizer,
                           output_alive=output_alive)
    return req.source.replay(req, plan)


def modelled_request(model: nn.Module, example_inputs: Any, target: Target, *, loss_fn: Any, optimizer: Any,
                     output_alive: bool, grad_accumulation: bool = False,
                     zero_grad_after_forward: bool = False) -> Request:
    """The checked arguments of a step planned for ``target`` outside :func:`remat.optimize_checkpointing` (no
    budget: profiles and replays), its source a fresh :class:`ModelledTarget`."""
    return request(model, 1.0, example_inputs, loss_fn=loss_fn, optimizer=optimizer, time_limit_s=None, check=False,
                   granularity="op", output_alive=output_alive, grad_accumulation=grad_accumulation,
                   zero_grad_after_forward=zero_grad_after_forward, timeout_s=None, compile=False,
                   source=ModelledTarget(target))
