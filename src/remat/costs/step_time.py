"""A plan's predicted step time where the host is modelled (issue #56): each phase the longer of its GPU's and its
host's time (Note [Host time in the plan]), and the host seconds of each unit. Torch-free."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from remat.costs.device_time import HostCosts
from remat.costs.unit_names import is_selective

if TYPE_CHECKING:
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


def with_host_times(units: Iterable[UnitCost], host: HostCosts) -> tuple[UnitCost, ...]:
    """``units`` with their host seconds (Note [Host time model] in remat.costs.device_time), from how many
    recorded operators each runs: a recomputation its forward's (up to where it stops early), each at
    ``host.forward_op_s``; a selective unit's dispatch mode adds ``selective_forward_op_s`` to every operator of
    its forward and ``selective_recompute_op_s`` to every one of its recomputation."""
    out = []
    for u in units:
        first = (u.recompute_end if u.recompute_end is not None else u.forward_end) - u.forward_start + 1
        recomputed = first + sum(c.forward_end - c.forward_start + 1 for c in u.later_calls)
        forward = sum(e - s + 1 for s, e in u.spans)
        selective = is_selective(u.name)
        out.append(dataclasses.replace(
            u, recompute_host_s=recomputed * (host.forward_op_s + (host.selective_recompute_op_s if selective else 0.0)),
            forward_host_s=forward * host.selective_forward_op_s if selective else 0.0))
    return tuple(out)
