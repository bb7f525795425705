"""A plan's predicted step time where the host is modelled (issue #56): each phase the longer of its GPU's and its
host's time (Note [Host time in the plan]), and the host seconds of each unit. Torch-free."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from remat.costs.device_time import HostCosts
from remat.costs.host_time import HostWork
from remat.costs.unit_names import is_selective

if TYPE_CHECKING:
    from remat.costs.recording import CheckpointOverhead
    from remat.costs.unit_costs import Profile, UnitCost

__all__ = ["plan_step_time_s", "with_host_times"]


# Note [Host time in the plan]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Where the host is modelled (a GPU target: Note [Host time model] in remat.costs.device_time), a phase takes the
# longer of the GPU's work and the host's: a plan's forward is max(GPU forward, host forward + what its selective
# units' dispatch mode adds), its backward max(GPU backward + recomputations, host backward + the recomputations'
# host time). Measured on the H200 (issue #56): a 1B Llama's 16 selective units made the forward's host 106 ms
# against 52 ms of GPU work. The solver's objective is a sum over units; there each unit costs the longer of its
# recomputation's GPU and host time plus its forward's dispatch-mode time (``UnitCost.cost_s``): a unit whose host
# time a GPU-bound phase would hide is charged as if none were hidden (an upper bound), and the plan's
# predicted step time is the phases' (:func:`plan_step_time_s`).


def plan_step_time_s(profile: Profile, units: Iterable[UnitCost]) -> float:
    """Predicted seconds of one step with ``units`` checkpointed (recomputed whole or selectively; Note [Host time
    in the plan]): each phase the longer of its GPU's and its host's time, plus the optimizer's. Without a
    modelled host: the plain step plus each unit's recompute and bookkeeping."""
    units = tuple(units)
    forward = max(profile.forward_s, (profile.forward_host_s + sum(u.forward_host_s for u in units))
                  if profile.forward_host_s else 0.0)
    backward = max(profile.backward_s + sum(u.recompute_s + u.overhead_s for u in units),
                   (profile.backward_host_s + sum(u.recompute_host_s for u in units)) if profile.backward_host_s
                   else 0.0)
    return forward + backward + profile.optimizer_s


def with_host_times(units: Iterable[UnitCost], host: HostCosts, work: HostWork,
                    bookkeeping: CheckpointOverhead) -> tuple[UnitCost, ...]:
    """``units`` with their host seconds (Note [Host time decomposed] in remat.costs.host_time): a recomputation
    runs its forward's operators again (up to where it stops early), each at the model's own host work per
    operator (``work``) and the device's (``host.forward_op_s``); checkpointing one adds its bookkeeping to the forward
    (``bookkeeping``, measured on the planning machine: per call and per tensor it saves), and a selective unit's
    dispatch mode ``host.selective_forward_op_s`` to every operator of its forward and
    ``host.selective_recompute_op_s`` to every one of its recomputation (where the device's host gives them, else
    ``bookkeeping``'s)."""
    out = []
    per_op = work.forward_python_per_op_s + host.forward_op_s
    for u in units:
        first = (u.recompute_end if u.recompute_end is not None else u.forward_end) - u.forward_start + 1
        recomputed = first + sum(c.forward_end - c.forward_start + 1 for c in u.later_calls)
        forward = sum(e - s + 1 for s, e in u.spans)
        sel_forward = sel_recompute = 0.0
        if is_selective(u.name):
            here = bookkeeping.per_selective_op_s
            sel_forward = here if host.selective_forward_op_s is None else host.selective_forward_op_s
            sel_recompute = here if host.selective_recompute_op_s is None else host.selective_recompute_op_s
        out.append(dataclasses.replace(
            u, recompute_host_s=recomputed * (per_op + sel_recompute),
            forward_host_s=u.calls * bookkeeping.per_call_s + len(u.drops) * bookkeeping.per_saved_tensor_s
            + forward * sel_forward))
    return tuple(out)
