"""The tradeoff table for a target that is not here: plans per budget and the hand rules, each predicted for the
target (the allocator's reserved peak replayed over its recorded steps, step time by the target's device model:
remat.target.timing), nothing measured.

In: the model (meta device allowed), example inputs, a :class:`~remat.target.world.Target`. Out: one
:class:`PredictedRow` per plan, for ``remat tradeoff ... --device GPU``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.errors import InfeasibleBudgetError
from remat.solve import Planner
from remat.solve.plan import Plan
from remat.api.predict import predict_peaks
from remat.target.world import Target, as_target


@dataclass(frozen=True)
class PredictedRow:
    """One plan of the table, predicted for the target (bytes per rank, seconds)."""

    strategy: str
    #: the budget the plan was made for (None for a hand rule)
    budget_bytes: int | None
    checkpointed: tuple[str, ...]
    predicted_peak_bytes: int
    #: the CUDA caching allocator's reserved peak, replayed (None on a CPU target)
    predicted_reserved_bytes: int | None
    predicted_step_time_s: float
    #: the reserved (else allocated) peak is within the device's memory
    fits_device: bool
    #: tokens per second per device and model FLOPs utilization at the predicted step time (None: unknown)
    predicted_tokens_per_s: float | None = None
    predicted_mfu: float | None = None
    #: units whose activations the plan offloads to host memory, the bytes it moves each way and the copies'
    #: exposed seconds (Note [Offload in the memory model] in remat.costs.offload)
    offloaded: tuple[str, ...] = ()
    predicted_offload_bytes: int = 0
    predicted_exposed_copy_s: float = 0.0


def predicted_tradeoff(model: nn.Module, example_inputs: Any, target: Target, *, loss_fn: Any = None,
                       optimizer: torch.optim.Optimizer | None = None, output_alive: bool = True,
                       budgets: list[int] | None = None, points: int = 6,
                       offload: bool | str = False) -> list[PredictedRow]:
    """No checkpointing, every block, every second block, then remat's plan at ``budgets`` (default: ``points``
    budgets from the least predicted peak to no checkpointing's), each predicted for ``target``; ``offload``: as
    :func:`remat.optimize_checkpointing`'s, remat's plans may offload. Changes nothing of the user's."""
    from remat.api.offloading import host_link

    from remat.api.profiling import make_profile

    target = as_target(target)
    profile = make_profile(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, output_alive=output_alive,
                           target=target)
    link, _ = host_link(offload, device=torch.device("cpu"), target=target, tensor_parallel=target.tp > 1)
    planner = Planner(profile, granularity="op", offload=link)
    plans: list[Plan] = [planner.no_checkpointing(), planner.every_nth_block(1), planner.every_nth_block(2)]
    lo, hi = planner.min_peak_bytes, planner.baseline_peak_bytes
    if budgets is None:
        budgets = [int(lo + (hi - lo) * i / max(points - 1, 1)) for i in range(points)]
    for b in budgets:
        try:
            plans.append(planner.plan_for_budget(b))
        except InfeasibleBudgetError:
            continue
    rows, seen = [], {}
    for plan in plans:
        if plan.choices not in seen:
            seen[plan.choices] = predict_peaks(model, example_inputs, target, loss_fn=loss_fn,
                                                    optimizer=optimizer, output_alive=output_alive,
                                                    plan=plan if plan.choices else None)
        peaks = seen[plan.choices]
        reserved = peaks.reserved_peak_bytes if target.is_cuda else None
        # (the device's memory as the replay was limited to it: the allocator's capacity on a GPU)
        memory = target.allocator.capacity_bytes or target.spec.memory_bytes
        fits = peaks.oom is None and (reserved if reserved is not None else plan.predicted_peak_bytes) <= memory
        rows.append(PredictedRow(plan.strategy, plan.budget_bytes, plan.checkpointed, plan.predicted_peak_bytes,
                                 reserved, plan.predicted_step_time_s, fits, plan.predicted_tokens_per_s,
                                 plan.predicted_mfu, plan.offloaded, plan.predicted_offload_bytes,
                                 plan.predicted_exposed_copy_s))
    return rows
