"""One call of :func:`remat.optimize_checkpointing`, its arguments checked: what each step of the pipeline reads.

In: the user's arguments. Out: a frozen :class:`Request` (the model, the budget in bytes, the inputs, the loss, the
loop: compiled or not, distributed or not, and where the step's costs come from).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from remat._compat import uncompiled
from remat.api.inputs import UserLoss, check_optimizer, validate
from remat.api.offloading import host_link
from remat.api.source import CostSource, MeasuredHere
from remat.costs.offload import HostLink
from remat.costs.unit_costs import Profile
from remat.runtime.compiled import CompiledLoop, compiled_loop
from remat.runtime.distributed import Ranks, Wrapping, ranks_for
from remat.runtime.measure import DefaultLoss, LossFn
from remat.solve import Planner


@dataclasses.dataclass(frozen=True)
class Request:
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
    #: where the step's costs come from (Note [Where costs come from] in remat.api.source)
    source: CostSource
    optimizer: torch.optim.Optimizer | None
    output_alive: bool
    time_limit_s: float | None
    check: bool
    granularity: str
    grad_accumulation: bool
    zero_grad_after_forward: bool
    #: the link plans may offload activations over (None: keep or recompute only; remat.api.offloading)
    offload: HostLink | None = None
    #: what the plan's notes say of offloading
    offload_notes: tuple[str, ...] = ()

    def planner(self, profile: Profile, **kwargs: Any) -> Planner:
        """The planner over ``profile`` for this call (every rank's profile gathered, when distributed)."""
        return Planner(profile, time_limit_s=self.time_limit_s, granularity=self.granularity,
                       ranks=self.ranks.gather(profile) if self.ranks is not None else None, offload=self.offload,
                       **kwargs)


def request(given: nn.Module, budget_gb: float, example_inputs: Any, *, loss_fn: LossFn | None,
             optimizer: torch.optim.Optimizer | None, time_limit_s: float | None, check: bool, granularity: str,
             output_alive: bool, grad_accumulation: bool, zero_grad_after_forward: bool, timeout_s: float | None,
             compile: bool | dict | None, source: CostSource | None = None, offload: Any = False) -> Request:
    """The arguments checked, the loop's compilation found, and the other ranks met (every rank must ask the same)."""
    model = uncompiled(given)
    budget_bytes, args, kwargs, device = validate(model, budget_gb, example_inputs)
    check_optimizer(model, optimizer)
    default = DefaultLoss() if loss_fn is None else None
    loop = compiled_loop(given, model, compile)
    wrapping, ranks = ranks_for(model, timeout_s, same=dict(
        budget_gb=budget_gb, granularity=granularity, output_alive=output_alive, check=check,
        grad_accumulation=grad_accumulation, zero_grad_after_forward=zero_grad_after_forward,
        time_limit_s=time_limit_s, optimizer=None if optimizer is None else type(optimizer).__name__,
        compiled=str(loop), offload=offload))
    link, link_notes = host_link(offload, device=device, target=getattr(source, "target", None),
                                 compiled=str(loop) if loop is not None else "",
                                 tensor_parallel=wrapping.kind == "tp" or "tp=" in wrapping.mesh)
    return Request(model=model, budget_bytes=budget_bytes, args=args, kwargs=kwargs, device=device,
                    loss_fn=default if loss_fn is None else UserLoss(loss_fn), default=default, loop=loop,
                    wrapping=wrapping, ranks=ranks,
                    source=source if source is not None else MeasuredHere(), optimizer=optimizer,
                    output_alive=output_alive,
                    time_limit_s=time_limit_s, check=check, granularity=granularity,
                    grad_accumulation=grad_accumulation, zero_grad_after_forward=zero_grad_after_forward,
                    offload=link, offload_notes=link_notes)
