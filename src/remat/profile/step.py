"""The step the profile measures (:class:`ProfiledStep`: the model, its inputs, the modules its recordings hook), one
recording of it with its units (:class:`Recorded`), and the Profile assembled from them: what the measured path
(``profile_model``) and the modelled one (``profile_modelled``) of remat.profile share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from remat.capture import ModelGraph
from remat.costs.effects import UnitSpec, largest_tensors, unit_costs
from remat.costs.recording import Recording
from remat.costs.unit_costs import Profile, UnitCost
from remat.profile.optimizer import OptimizerCost
from remat.profile.recorder import record_step
from remat.profile.units import module_and_segment_specs, region_specs, selective_specs
from remat.runtime.measure import LossFn, input_tensors, tensor_bytes, trainable_parameters
from remat.runtime.meters import CudaAllocator
from remat.runtime.state import preserved

__all__ = ["ProfiledStep", "Recorded", "with_selective_specs", "assembled", "contains"]


@dataclass(frozen=True)
class ProfiledStep:
    """The training step profile_model measures, and the modules its recordings hook: what its steps share."""

    model: nn.Module
    args: tuple
    kwargs: dict
    loss_fn: LossFn
    device: torch.device
    graph: ModelGraph
    output_alive: bool
    sharded: tuple[str, ...]
    world_size: int
    wrapping: str
    sequentials: dict[str, list[str]]
    extra: list[str]
    hooked: list[str]

    @staticmethod
    def of(model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, graph: ModelGraph,
           output_alive: bool, sharded: tuple[str, ...], world_size: int, wrapping: str) -> ProfiledStep:
        mods = dict(model.named_modules())
        sequentials = {
            name: [f"{name}.{k}" if name else k for k in m._modules]
            for name, m in mods.items() if isinstance(m, nn.Sequential) and len(m) >= 2
        }
        extra = [c for children in sequentials.values() for c in children] + [c for c in sequentials if c]
        # the submodules regions start at and run (Note [Regions] in remat.capture): hooked for their spans only
        # (a region's time is its operators', its buffers its module's)
        region_calls = [c for calls in graph.region_calls.values() for c in calls]
        hooked = list(dict.fromkeys([*graph.units, *extra, *region_calls]))
        return ProfiledStep(model, args, kwargs, loss_fn, device, graph, output_alive, sharded, world_size, wrapping,
                     sequentials, extra, hooked)

    def record(self, fake: bool) -> tuple[Recording, list[str], list[UnitSpec]]:
        """One step recorded (``record_step``, looked up in this module), the units that ran and their specs."""
        graph, sharded = self.graph, self.sharded
        with preserved(self.model):
            rec = record_step(self.model, self.args, self.kwargs, self.loss_fn, self.device, self.hooked, fake=fake,
                              output_alive=self.output_alive)
        # the units that ran, in forward order: by each unit's first operator
        ran = sorted((u for u in graph.units if u in rec.spans and not contains(u, (u,), sharded)),
                     key=lambda u: (rec.first_span(u)[0], -rec.first_span(u)[1]))
        specs = [s for s in [*module_and_segment_specs(rec, ran, self.sequentials),
                             *region_specs(rec, ran, graph.cuts, graph.region_calls)]
                 if not contains(s.name, s.members, sharded)]
        return rec, ran, specs


@dataclass(frozen=True)
class Recorded:
    """A recording of the step, the units that ran in it (forward order), their specs, how memory was recorded
    (``"fake"`` or ``"real"``) and the units' memory costs (no times)."""

    rec: Recording
    ran: list[str]
    specs: list[UnitSpec]
    how: str
    memory: dict[str, UnitCost]

    @staticmethod
    def of(rec: Recording, ran: list[str], specs: list[UnitSpec], how: str) -> Recorded:
        return Recorded(rec, ran, specs, how, {c.name: c for c in unit_costs(rec, specs[:len(ran)])})


def with_selective_specs(step: ProfiledStep, recorded: Recorded, notes: list[str]) -> list[UnitSpec]:
    """Every candidate's spec: the module and segment units', then the selective (op-level) options', then the
    regions'."""
    specs, ran = recorded.specs, recorded.ran
    if step.graph.capture_path == "hooks":
        # a policy names operators by their position in the unit's forward, which must not depend on
        # the data (Note [Selective checkpointing]); without a captured graph that is not known
        selective = []
        notes.append("no selective (op-level) options: the model could not be captured as a graph (its "
                     "operator sequence may depend on the data), so policies naming operators by position "
                     "are not offered (" + "; ".join(step.graph.failures) + ")")
    else:
        # the module units' spans, exclusions and drops do not depend on the sizes calibrated above, and
        # the menus are ranked by FLOPs and bytes, not times (Note [Policy menus])
        selective = selective_specs(recorded.rec, list(recorded.memory.values()))
    return specs[:len(ran)] + selective + specs[len(ran):]


def assembled(step: ProfiledStep, rec: Recording, units: list[UnitCost], forward_s: float, backward_s: float, *,
               opt: OptimizerCost, recorded: str, notes: list[str], workspace_bytes: int = 0) -> Profile:
    """The Profile: the recording's timelines, the units, the step's sizes and times, the notes so far."""
    model, args, kwargs, device = step.model, step.args, step.kwargs, step.device

    def state_bytes(tensors: list, on: torch.device | None = None) -> int:  # as the check meters it (CUDA: blocks)
        return CudaAllocator(device).state_bytes(tensors) if device.type == "cuda" and torch.cuda.is_available() \
            else tensor_bytes(tensors, on)
    return Profile(
        units=units,
        live_bytes=rec.timeline(),
        before_bytes=rec.before_bytes(),
        after_backward_bytes=rec.after_backward_bytes,
        output_alive=step.output_alive,
        grad_bytes=rec.grad_timeline(),
        saved_bytes=rec.saved_timeline(),
        backward_start=rec.backward_start,
        # on CUDA as the allocator counts their blocks, as the check does (Note [The budget on CUDA is absolute])
        params_bytes=state_bytes(list(model.parameters())),
        grads_bytes=tensor_bytes(trainable_parameters(model)),
        buffers_bytes=state_bytes(list(model.buffers())),
        inputs_bytes=state_bytes(input_tensors(args, kwargs), device),
        world_size=step.world_size,
        wrapping=step.wrapping,
        optimizer_state_bytes=opt.state_bytes,
        optimizer_step_bytes=opt.step_bytes,
        forward_s=forward_s,
        backward_s=backward_s,
        optimizer_s=opt.step_s,
        device=str(device),
        capture_path=step.graph.capture_path,
        memory_recorded_with=recorded,
        optimizer=opt.label,
        notes=tuple(notes),
        tensors=largest_tensors(rec),
        parameter_shapes=tuple((n, tuple(q.shape)) for n, q in model.named_parameters() if q.requires_grad),
        workspace_bytes=workspace_bytes,
    )


def contains(name: str, members: tuple[str, ...], sharded: tuple[str, ...]) -> bool:
    """Whether a unit (``members``: its modules) contains an FSDP2-managed module other than itself."""
    return any(m != name and any(m == x or m.startswith(x + ".") for x in members) for m in sharded if m)
