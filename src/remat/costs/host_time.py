"""The host's work in an eager step, decomposed by what causes it (issue #60). Torch-free: the figures come from
remat.profile.host_work (the model's own Python, measured on the planning machine), remat.target.measure_device
(a device's cost per operator, measured by ``remat calibrate``) and remat.target.host_trace (the same figure read
from a profiled step's trace, the built-in H200's).

Note [Host time decomposed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
In eager mode the host runs, for every operator, two kinds of work (Note [Host time model] in
remat.costs.device_time says how they meet the GPU's):

* **the model's own**: its Python, ``nn.Module.__call__`` and hooks, autograd's records in the forward and its
  engine and formulas in the backward, FSDP2's hooks: everything above the dispatcher's Python key. It depends on
  the model's code, not only on its operator count (issue #60: a Hugging Face model and torchtitan's of the same
  widths differ), so it is measured on the model being planned: its forward and backward run on fake tensors
  (every line of the model runs, no kernel does) under a dispatch mode that reads the clock as each operator
  enters and leaves; the time *between* operators is the model's (remat.profile.host_work). What the mode itself
  adds to each call it sees (metadata queries included, which fake tensors dispatch and real ones do not) is
  measured on a loop of bare operators and taken out (``call_s``).
* **the device's**: what one operator costs below that line on the device's host: the dispatcher, the operator's
  host code, the caching allocator, the kernel's launch (``HostCosts.op_s``). A property of the device, its
  driver and host, measured there: ``remat calibrate`` times a block of training size on the GPU, unprofiled, and
  takes the block's own Python out the same way (:func:`op_s_from_phase`); the built-in H200 figure comes from
  the shared profiled traces through the same function, with the profiler's own cost per event (measured here,
  the same events profiled and not) and checkpointing's bookkeeping (measured here) taken out.

Checkpointing adds to the host what it adds on any machine (torch.utils.checkpoint's bookkeeping per call and per
saved tensor, a selective policy's dispatch mode per operator: ``CheckpointOverhead``, measured on the planning
machine), and a recomputation runs its operators again, each at the model's own cost per operator plus the
device's. No figure is fitted to a step time. What it leaves out: the planning machine's host runs the model's
Python as fast as the target's (no host ratio is measured), the Python of a recomputed unit is the model's mean
per operator (not the unit's own), and a profiler's per-event cost on the GPU's host (its CUDA callbacks) is
taken as the CPU events' measured here.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.errors import InvalidInputError

__all__ = ["HostWork", "op_s_from_phase", "phase_host_s"]


@dataclass(frozen=True)
class HostWork:
    """The model's own host work in one plain step (Note [Host time decomposed]), measured on the planning
    machine: seconds between operators in the forward (with the loss) and the backward, and the operators each
    phase dispatches."""

    forward_python_s: float
    backward_python_s: float
    forward_ops: int
    backward_ops: int
    #: how and where it was measured, for notes
    source: str = ""

    @property
    def forward_python_per_op_s(self) -> float:
        """The model's own host seconds per forward operator: what each recomputed operator costs again."""
        return self.forward_python_s / self.forward_ops if self.forward_ops else 0.0


def phase_host_s(python_s: float, ops: int, op_s: float) -> float:
    """Host seconds of a phase: the model's own work plus ``ops`` operators at the device's ``op_s``."""
    return python_s + ops * op_s


def op_s_from_phase(wall_s: float, python_s: float, ops: int, *, bookkeeping_s: float = 0.0,
                    profiler_events: int = 0, profiler_event_s: float = 0.0) -> float:
    """The device's host seconds per operator (Note [Host time decomposed]) from one phase's host wall time:
    ``wall_s`` less the model's own work (``python_s``), checkpointing's bookkeeping and the profiler's cost
    (``profiler_events`` at ``profiler_event_s`` each, where the phase was profiled), over its ``ops``
    operators. Raises InvalidInputError where nothing is left for the operators (the inputs do not describe one
    step)."""
    if ops <= 0:
        raise InvalidInputError(f"a phase of {ops} operators has no cost per operator: give the operators the "
                                "phase dispatched (the measuring mode's count)")
    left = wall_s - python_s - bookkeeping_s - profiler_events * profiler_event_s
    if left <= 0:
        raise InvalidInputError(
            f"the phase's wall time {wall_s * 1e3:.3f} ms is no more than the model's own work "
            f"({python_s * 1e3:.3f} ms), checkpointing's bookkeeping ({bookkeeping_s * 1e3:.3f} ms) and the "
            f"profiler's ({profiler_events} events x {profiler_event_s * 1e6:.2f} us): nothing is left for its "
            "operators: the figures describe different steps (measure the model's own work on the step whose wall "
            "was timed)")
    return left / ops
