"""The measured costs of one training step, as plain numbers (no torch).

``remat.profile`` produces a :class:`Profile` (its :class:`UnitCost` per candidate unit derived from
the step's Recording by ``remat.costs.effects``); the simulator, the solver and the report read it. Bytes are integers, times are seconds, and a *timeline index*
is the position of an operator in the step's sequence of dispatched operators
(forward first, then backward); see Note [Timeline] in ``remat.profile.recorder``.

Note [Accumulated gradients]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With gradient accumulation (Hugging Face's ``gradient_accumulation_steps``, Lightning's
``accumulate_grad_batches``) every micro-batch after the first runs forward and backward with all
gradients already allocated: the forward peak grows by their size, and in backward each new gradient
is a temporary until ``AccumulateGrad`` adds it in place (in the first micro-step it *becomes* the
``.grad``, with no copy). ``Profile.with_held_grads`` turns the recorded first step into such a
micro-step: after operator ``i``, every gradient plus those operator ``i`` created; the plan is then
made for the worst micro-step, and the checked step runs with gradients present
(``remat.api.measure_checked_peak``). Lightning's automatic optimization calls ``zero_grad`` between the
forward and the backward (its closure: ``training_step``, ``zero_grad``, ``backward``), so there the
previous step's gradients are alive through every forward and freed before backward
(``with_held_grads(through_backward=False)``: found by measuring Lightning's own step, 0.35 MB over a
plan made for gradients that start as None).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from remat.costs.recording import recompute_growth  # noqa: F401 - re-exported: importable from here as before
from remat.costs.step_time import plan_step_time_s
from remat.costs.tensor_info import TensorInfo  # noqa: F401 - re-exported: importable from here as before
from remat.costs.unit_names import (  # noqa: F401 - re-exported: what the other stages take from here
    SELECTIVE, inner_unit, is_selective, nest_key, op_key, parse_region, parse_segment,
    region_name, segment_name)


@dataclass(frozen=True)
class Drop:
    """One storage that checkpointing its unit frees during forward and rebuilds in backward."""

    nbytes: int
    #: first timeline index at which the storage is no longer alive if its unit is checkpointed
    free_from: int
    #: first timeline index at which it is alive again (its call's recomputation); None: the unit's
    #: ``recompute_at`` (units called once)
    until_index: int | None = None
    #: the storage's index in the recording (Profile.tensors names it); None when not known. Not part of
    #: the cost: two drops of equal bytes and times compare equal
    storage: int | None = field(default=None, compare=False)
    #: the operator of the unit's forward that made it, as a selective policy names it (``aten.mm.default#1``);
    #: None when not named (a random operator's product) or the unit runs more than once. What an offload of
    #: some of a unit's operators moves (Note [Offload in the memory model] in remat.costs.offload)
    op: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class CallSpan:
    """A second or later forward call of a unit that runs more than once per step (Note [Reused
    modules] in remat.costs.effects): each call is checkpointed, and recomputed, on its own."""

    forward_start: int
    forward_end: int
    #: timeline index of the backward operator that first reads a tensor this call saved; None if none
    recompute_at: int | None
    #: peak growth of live memory during this call's forward (bytes)
    recompute_peak_bytes: int


@dataclass(frozen=True)
class Keep:
    """An input of a unit that checkpointing keeps alive longer than the plain step does: checkpoint
    holds its inputs until the unit's backward has run, even where no operator saves them."""

    nbytes: int
    #: first timeline index at which the plain step no longer holds the storage
    from_index: int
    #: first timeline index at which the checkpoint no longer holds it (the unit's backward is done)
    until_index: int


@dataclass(frozen=True)
class Made:
    """A storage a unit's forward makes that outlives it in the plain step (its output, what it saves for
    backward), and what outside the unit holds it: what a block compiled on its own replaces with what its
    compiled forward returns (Note [Blocks compiled one by one] in remat.costs.compiled_memory)."""

    nbytes: int
    #: first timeline index at which the plain step no longer holds it; None: alive when the step ends
    free_index: int | None
    #: saved for backward by an operator inside the unit
    saved_inside: bool
    #: the last forward operator outside the unit that reads it; None: none does
    used_until: int | None
    #: the tensors on it that operators outside the unit save: (the units running when it was saved, outermost
    #: first; where backward first reads it back, None: never)
    saved_outside: tuple[tuple[tuple[str, ...], int | None], ...] = ()

    @property
    def output(self) -> bool:
        """Something outside the unit uses or saves it (else only the unit's own backward needs it)."""
        return self.used_until is not None or bool(self.saved_outside) or self.free_index is None


@dataclass(frozen=True)
class UnitCost:
    """Measured costs of one candidate unit (a submodule, by qualified name)."""

    #: the unit: a qualified module name, a segment ``blocks[0:4]``, a region ``up.2[conv1:conv2]``, or a selective option ``h.3@ops2``
    name: str
    #: qualified name of the closest enclosing unit, or None for a top-level unit
    parent: str | None
    #: measured wall time of the unit's forward (seconds)
    forward_s: float
    #: measured wall time of the unit's recomputation in backward, or the forward time when
    #: the unit was not checkpointed while profiling (seconds)
    recompute_s: float
    #: measured time between the gradient reaching the unit's output and its input, None if unmeasured
    backward_s: float | None
    #: floating-point operations of the unit's forward (torch.utils.flop_counter)
    flops: int
    #: timeline index of the unit's first forward operator
    forward_start: int
    #: timeline index of the unit's last forward operator
    forward_end: int
    #: timeline index of the backward operator that first reads a tensor saved inside the unit
    #: (where checkpointing recomputes it); None if the unit saves nothing
    recompute_at: int | None
    #: storages saved for backward only by this unit, freed early when it is checkpointed
    drops: tuple[Drop, ...]
    #: peak growth of live memory during the unit's forward: what a recomputation adds (bytes)
    recompute_peak_bytes: int
    #: bytes of all storages saved for backward by operators inside the unit, deduplicated
    saved_bytes: int
    #: why this unit may not be checkpointed, or None if it may
    excluded: str | None = None
    #: buffers (names relative to the unit) its forward mutates in place, replayed on recompute
    mutated_buffers: tuple[str, ...] = ()
    #: for a segment of an nn.Sequential (``blocks[0:4]``), the children it runs; empty for a module
    members: tuple[str, ...] = ()
    #: inputs that checkpointing the unit keeps alive longer than the plain step
    keeps: tuple[Keep, ...] = ()
    #: checkpoint's own bookkeeping for this unit, beyond the recompute (seconds; Note [Checkpoint
    #: overhead] in remat.profile.timing)
    overhead_s: float = 0.0
    #: for a selective unit (``h.3@ops2``), the operators whose outputs its policy keeps, as the rewrite
    #: names them (``aten.addmm.default#1``; Note [Selective checkpointing] in remat.rewrite)
    saved_ops: tuple[str, ...] = ()
    #: the second and later forward calls of a module called more than once per step (its first call is
    #: described by the fields above; ``drops`` and ``keeps`` cover every call)
    later_calls: tuple[CallSpan, ...] = ()
    #: timeline index of the last forward operator a recomputation runs (Note [Early stop] in
    #: remat.costs.effects); None: ``forward_end``
    recompute_end: int | None = None
    #: what a recomputation holds on top of its forward's growth (bytes): checkpoint's copy of the RNG state
    #: (``fork_rng``) and the copies of the buffers it replays (Note [Recomputation transients] in remat.costs.effects)
    recompute_extra_bytes: int = 0
    #: the collectives its recomputation runs again, as (operator, bytes it makes), e.g. a tensor-parallel
    #: block's all_reduce: communication that checkpointing adds (Note [Recomputed communication] in
    #: remat.costs.effects); their time is in ``recompute_s``, measured with them
    recomputed_collectives: tuple[tuple[str, int], ...] = ()
    #: (timeline index, bytes) of storages made before the unit's forward that the plain forward freed during
    #: it, up to ``recompute_end``: a recomputation does not free them (Note [Growth of a recomputation] in
    #: remat.costs.effects)
    freed_outside: tuple[tuple[int, int], ...] = ()
    #: what its first forward call makes that outlives it (Note [Blocks compiled one by one] in
    #: remat.costs.compiled_memory)
    made: tuple[Made, ...] = ()
    #: timeline index of the last backward operator that reads a tensor saved inside its first call (where its
    #: backward ends); None if it saves nothing or one is never read back
    backward_end: int | None = None
    #: its forward runs an operator that draws random numbers (dropout): under torch.compile such a unit's plan
    #: has two programs (Note [Random operators under compile] in remat.rewrite)
    draws_random: bool = False
    #: host seconds of its recomputation where the host is modelled (Note [Host time in the plan]), else 0
    recompute_host_s: float = 0.0
    #: host seconds its selective dispatch mode adds to the forward where the host is modelled, else 0
    forward_host_s: float = 0.0

    @property
    def calls(self) -> int:
        """How many times the unit's forward runs in one step."""
        return 1 + len(self.later_calls)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """Forward span (first, last timeline index) of every call."""
        return ((self.forward_start, self.forward_end),
                *((c.forward_start, c.forward_end) for c in self.later_calls))

    @property
    def recomputations(self) -> tuple[tuple[int, int], ...]:
        """(timeline index, peak growth in bytes) of every recomputation checkpointing this unit causes."""
        firsts = ((self.recompute_at, self.recompute_peak_bytes),) + tuple(
            (c.recompute_at, c.recompute_peak_bytes) for c in self.later_calls)
        return tuple((at, b) for at, b in firsts if at is not None)

    def drop_until(self, drop: Drop) -> int | None:
        """First timeline index at which ``drop``'s storage is alive again (None: never dropped)."""
        return self.recompute_at if drop.until_index is None else drop.until_index

    @property
    def cost_s(self) -> float:
        """Predicted extra step time of checkpointing it, seconds (Note [Host time in the plan])."""
        return max(self.recompute_s + self.overhead_s, self.recompute_host_s) + self.forward_host_s

    @property
    def is_segment(self) -> bool:
        """A segment of a Sequential or a region of a forward: a unit whose members are submodules."""
        return bool(self.members)

    @property
    def is_region(self) -> bool:
        """A region of a module's forward (Note [Regions] in remat.capture)."""
        return parse_region(self.name) is not None

    @property
    def droppable_bytes(self) -> int:
        """Bytes of saved activations that checkpointing this unit frees during forward."""
        return sum(d.nbytes for d in self.drops)


@dataclass(frozen=True)
class Profile:
    """Everything the solver needs to know about one training step, measured on a real batch."""

    #: the costs of every candidate unit, in forward order
    units: tuple[UnitCost, ...]
    #: bytes allocated during the step (activations, gradients, temporaries) alive after each operator
    live_bytes: tuple[int, ...]
    #: of live_bytes: parameter gradients
    grad_bytes: tuple[int, ...]
    #: of live_bytes: storages saved for backward
    saved_bytes: tuple[int, ...]
    #: timeline index of the first backward operator
    backward_start: int
    #: bytes of the parameters (distinct storages)
    params_bytes: int
    #: parameter gradients at the end of backward (trainable parameters only)
    grads_bytes: int
    #: bytes of the buffers
    buffers_bytes: int
    #: example inputs (the batch), alive all step
    inputs_bytes: int
    #: optimizer state in steady state (after a step); 0 when no optimizer was given
    optimizer_state_bytes: int
    #: temporaries of the optimizer step on top of everything else alive then
    optimizer_step_bytes: int
    #: measured forward time of one plain step, the loss included (seconds)
    forward_s: float
    #: measured backward time of one plain step (seconds)
    backward_s: float
    #: measured time of the optimizer step, on shadow copies (seconds)
    optimizer_s: float
    #: where the profile was measured, e.g. "cpu"
    device: str
    #: how the graph was captured: "fx", "export" or "hooks"
    capture_path: str
    #: how memory was recorded: "fake" (FakeTensorMode, no device memory) or "real"
    memory_recorded_with: str
    #: what the optimizer accounting covers, e.g. "AdamW" or "none (no optimizer given)"
    optimizer: str
    #: what profiling found worth saying (paths taken, units left out)
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: the device and world the costs were modelled for (remat.target: predicted), "" when measured on ``device``
    target: str = ""
    #: bytes allocated during the step alive just before each operator runs (after the frees that follow
    #: the previous one): where a recomputation starts (Note [Between operators] in remat.costs.recording); None:
    #: ``live_bytes`` of the previous operator
    before_bytes: tuple[int, ...] | None = None
    #: bytes allocated during the step still alive once backward has returned (gradients, the output
    #: when the loop keeps it): what the optimizer step starts from; None: ``live_bytes[-1]``
    after_backward_bytes: int | None = None
    #: processes training the model, and how it is wrapped for that ("" for one process): the profile is
    #: this rank's (Note [One plan for every rank] in remat.runtime.distributed)
    world_size: int = 1
    #: how the model is wrapped for distributed training ("" for one process)
    wrapping: str = ""
    #: the training loop keeps the model's output referenced until the step ends (Note [Loop style] in
    #: remat.profile); False: it is dropped once the loss is computed
    output_alive: bool = True
    #: the loop accumulates gradients over micro-batches: every trainable parameter's gradient exists
    #: when the step starts (Note [Accumulated gradients])
    grads_held: bool = False
    #: the loop zeroes gradients between forward and backward (Lightning): the previous step's gradients are
    #: alive through the forward (Note [Accumulated gradients])
    grads_held_in_forward: bool = False
    #: the step's largest storages (Note [What holds the peak] in remat.costs.peak_breakdown); empty when not recorded
    tensors: tuple[TensorInfo, ...] = ()
    #: every trainable parameter's name and shape, to name a gradient made in backward that is shaped like one
    #: (a contribution to a weight used twice, e.g. a tied embedding, before it is summed into ``.grad``)
    parameter_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: tokens one device trains on per step (the batch's token ids, over the ranks of a tensor-parallel group
    #: that share them); None: not a token model, or unknown
    tokens_per_step: int | None = None
    #: floating-point operations of one plain step's forward and backward on one device, for MFU (0: unknown)
    model_flops: int = 0
    #: the device's dense peak FLOP/s in the step's compute dtype, for MFU (a modelled target's; None: unknown)
    peak_flops_per_s: float | None = None
    #: host seconds of the plain forward's operators (0: not modelled; Note [Host time in the plan])
    forward_host_s: float = 0.0
    #: host seconds of the plain backward's operators (0: not modelled)
    backward_host_s: float = 0.0
    #: BLAS workspaces held all step, measured on CUDA (Note [The budget on CUDA is absolute]); 0 elsewhere
    workspace_bytes: int = 0

    @property
    def fixed_bytes(self) -> int:
        """Memory alive during the whole step that no plan removes (bytes)."""
        return self.params_bytes + self.buffers_bytes + self.inputs_bytes + self.optimizer_state_bytes + \
            self.workspace_bytes

    @property
    def step_time_s(self) -> float:
        """Time of one plain step: forward + backward + optimizer, seconds (Note [Host time in the plan])."""
        return plan_step_time_s(self, ())

    def unit(self, name: str) -> UnitCost:
        for u in self.units:
            if u.name == name:
                return u
        from remat.errors import InvalidInputError

        raise InvalidInputError(f"no unit named {name!r} in this profile; its units: "
                                f"{[u.name for u in self.units][:8]}{' ...' if len(self.units) > 8 else ''}")

    def with_held_grads(self, *, through_backward: bool = True) -> "Profile":
        """This step as a micro-step of gradient accumulation (every gradient held from the start), or, with
        ``through_backward=False``, as a loop that zeroes gradients only after the forward (Note [Accumulated
        gradients])."""
        if self.grads_held or (self.grads_held_in_forward and not through_backward):
            return self
        held = self.grads_bytes
        n = self.backward_start if not through_backward else len(self.live_bytes)

        m = self.backward_start if self.grads_held_in_forward else 0  # forward rows that hold them already

        def shift(series: tuple[int, ...]) -> tuple[int, ...]:
            # after operator i: every gradient held, plus those created by operator i until they are added
            return tuple(b + held - (self.grad_bytes[i - 1] if i - 1 >= m else 0) if m <= i < n else b
                         for i, b in enumerate(series))

        if through_backward:
            note = f"gradient accumulation: every gradient ({held} bytes) held from the step's start"
            changes = dict(grads_held=True, grad_bytes=tuple(held for _ in self.grad_bytes))
        else:
            note = f"zero_grad after the forward: the previous step's gradients ({held} bytes) alive through it"
            changes = dict(grads_held_in_forward=True,
                           grad_bytes=tuple(held if i < n else g for i, g in enumerate(self.grad_bytes)))
        return dataclasses.replace(
            self, live_bytes=shift(self.live_bytes), **changes,
            before_bytes=None if self.before_bytes is None else shift(self.before_bytes),
            # the optimizer step starts once backward has returned: every gradient made and added
            after_backward_bytes=self.after_backward_bytes if self.after_backward_bytes is not None or not self.live_bytes
            else self.live_bytes[-1],
            notes=self.notes + (note,))

    def candidates(self) -> tuple[UnitCost, ...]:
        """Units that may be checkpointed and would free something."""
        return tuple(u for u in self.units if u.excluded is None and u.drops)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profile":
        d = dict(d)
        d["units"] = tuple(
            UnitCost(**{**{k: v for k, v in u.items() if k != "calls"}, "drops": tuple(Drop(**x) for x in u["drops"]),
                        "mutated_buffers": tuple(u.get("mutated_buffers", ())),
                        "members": tuple(u.get("members", ())),
                        "keeps": tuple(Keep(**k) for k in u.get("keeps", ())),
                        "saved_ops": tuple(u.get("saved_ops", ())),
                        "later_calls": tuple(CallSpan(**c) for c in u.get("later_calls", ())),
                        "recomputed_collectives": tuple((n, b) for n, b in u.get("recomputed_collectives", ())),
                        "freed_outside": tuple((i, b) for i, b in u.get("freed_outside", ())),
                        "made": tuple(Made(**{**m, "saved_outside": tuple((tuple(st), at) for st, at in m["saved_outside"])})
                                      for m in u.get("made", ()))})
            for u in d["units"]
        )
        for k in ("live_bytes", "grad_bytes", "saved_bytes", "notes"):
            d[k] = tuple(d[k])
        d["tensors"] = tuple(TensorInfo(**{**t, "shape": tuple(t["shape"])}) for t in d.get("tensors", ()))
        d["parameter_shapes"] = tuple((n, tuple(shape)) for n, shape in d.get("parameter_shapes", ()))
        if d.get("before_bytes") is not None:
            d["before_bytes"] = tuple(d["before_bytes"])
        return cls(**d)
