"""Profiling for a modelled target (remat.target): the step recorded on the fake model in the target's world,
timed by the target's device model instead of this machine's clock (Note [Where costs come from] in
remat.api.source)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from remat.costs.device_time import HostCosts
from remat.costs.recording import CheckpointOverhead, ForwardOp, Recording, UnitTimes
from remat.profile.optimizer import OptimizerCost


@dataclass(frozen=True)
class Modelled:
    """What a modelled target (remat.target) gives profiling in place of this machine's measurements."""

    #: the optimizer's state and step on the target (recorded on fake tensors there)
    optimizer: OptimizerCost
    #: seconds of one forward operator on the target (a model, not a measurement)
    op_seconds: Callable[[ForwardOp], float]
    #: checkpoint's own bookkeeping on the target
    overhead: CheckpointOverhead
    #: the recording as the target's allocator counts it (e.g. blocks rounded to 512 bytes on CUDA)
    counted: Callable[[Recording], Recording]
    #: how the recording and times were made, for the profile's notes
    note: str
    #: the plain step's (forward seconds, backward seconds, FLOPs) on the target from its recording (operators
    #: and communication, remat.target.timing); None: backward twice the forward, FLOPs unknown
    step_time: Callable[[Recording], tuple[float, float, int]] | None = None
    #: the device's host seconds per operator (Note [Host time decomposed] in remat.costs.host_time); None: the
    #: host is not modelled
    host: HostCosts | None = None
    #: what checkpointing adds to the host, measured on this machine (per call, per saved tensor, per operator of
    #: a selective unit); given where ``host`` is
    host_bookkeeping: CheckpointOverhead | None = None


def times_of_ops(rec: Recording, units: list[str]) -> UnitTimes:
    """Units' times as the sums of their forward operators' seconds (recomputation: the same; backward: twice,
    as a matrix product's), and the buffers each unit's forward writes (which its checkpoint snapshots)."""
    forward_s = {u: sum(rec.forward_ops[i].seconds for a, b in rec.spans[u] for i in range(a, b + 1)
                        if i < len(rec.forward_ops)) for u in units}
    mutated: dict[str, tuple[str, ...]] = {}
    for u in units:
        prefix = f"{u}." if u else ""
        mutated[u] = tuple(dict.fromkeys(
            w.preexisting[1].removeprefix(prefix) for w in rec.writes
            if u in w.stack and w.preexisting is not None and w.preexisting[0] == "buffer"
            and w.preexisting[1].startswith(prefix)))
    step_forward_s = sum(op.seconds for op in rec.forward_ops)
    return UnitTimes(forward_s=forward_s, recompute_s=dict(forward_s), backward_s={u: 2 * s for u, s in forward_s.items()},
                     mutated_buffers=mutated, step_forward_s=step_forward_s, step_backward_s=2 * step_forward_s)
