"""The Plan: which units to checkpoint, and what that is predicted to cost (no torch)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remat.costs import simulate
from remat.costs.offload import offloaded_module
from remat.costs.simulate import HeldTensor, PeakBreakdown

GiB = 2**30
MiB = 2**20
PLAN_FORMAT = 1


def policy_summary(saved_ops: tuple[str, ...] | list[str]) -> str:
    """What a selective policy keeps, by operator: ``("aten.addmm.default#0", "aten.addmm.default#1",
    "aten.gelu.default#0")`` -> ``"keeps addmm x2, gelu"``."""
    counts: dict[str, int] = {}
    for key in saved_ops:
        name = key.split("#")[0].split(".")[1] if key.count(".") >= 2 else key.split("#")[0]
        counts[name] = counts.get(name, 0) + 1
    return "keeps " + ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items())


def fmt_bytes(n: int | float | None) -> str:
    """Human-readable bytes (GiB above 1 GiB, else MiB)."""
    return "-" if n is None else simulate.fmt_bytes(n)


@dataclass(frozen=True)
class Plan:
    """A checkpointing plan and its predictions. Every ``predicted_*`` figure comes from the memory
    simulator (``remat.costs.simulate``) over a measured profile (for a compiled loop, calibrated on measured
    compiled steps: Note [Compiled steps] in remat.solve.calibrated); ``checked_peak_bytes`` is measured on
    a real step with the plan."""

    #: the strategy that made the plan: "ilp", "none", "every_block", "every_2nd_block", "greedy", ...
    strategy: str
    #: qualified names of the checkpointed modules, in forward order
    checkpointed: tuple[str, ...]
    #: the budget asked for (bytes), or None for a strategy without one
    budget_bytes: int | None
    #: the peak predicted for the plan (bytes): the memory simulator's for an eager loop, the calibrated compiled prediction when ``compiled``
    predicted_peak_bytes: int
    #: predicted peak with nothing checkpointed (bytes)
    baseline_peak_bytes: int
    #: the least peak any plan reaches (bytes): measured where ``min_peak_checked``, else predicted
    min_peak_bytes: int
    #: the predicted peak split by category
    breakdown: PeakBreakdown
    #: the plain step measured while profiling plus the predicted recompute (seconds)
    predicted_step_time_s: float
    #: measured step time with nothing checkpointed (seconds)
    baseline_step_time_s: float
    #: the plan's predicted recompute time: its units' measured recomputations and checkpoint bookkeeping (seconds)
    predicted_recompute_s: float
    #: "optimal", "optimal within 1%" (large problems, Note [Solver gap] in remat.solve.ilp), "fits" (no
    #: checkpointing needed), "feasible" (time limit hit), "at least as good as the best flat plan" (nested
    #: search stopped: Note [Warm start]), "infeasible", "heuristic", "baseline"
    solver_status: str
    #: seconds the solver took for this plan
    solve_time_s: float
    #: how the model was captured: "fx", "export" or "hooks"
    capture_path: str = ""
    #: the device the profile was measured on, e.g. "cpu", "cuda:0"
    device: str = ""
    #: the optimizer whose state counts in the budget, e.g. "AdamW", or "none (...)"
    optimizer: str = ""
    #: peak of one real step with this plan: forward and ``loss.backward()`` measured, the optimizer's state
    #: and step temporaries added as predicted
    #: (bytes); None when the plan was not checked (see Note [Checked plans] in remat.api)
    checked_peak_bytes: int | None = None
    #: per checkpointed unit, the buffers its forward mutates (replayed on recompute)
    mutated_buffers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: per selective unit (``h.3@ops2``), the operators whose outputs its policy keeps (Note [Selective
    #: checkpointing] in remat.rewrite)
    saved_ops: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: per unit checkpointed inside another checkpointed unit, that unit (Note [Nested checkpoints] in
    #: remat.costs.memory_rows): recomputed within the outer unit's recomputation, and again in its own backward
    nested_in: dict[str, str] = field(default_factory=dict)
    #: the training loop it was planned for keeps the model's output until the step ends (False: drops
    #: it after the loss; Note [Loop style] in remat.profile)
    output_alive: bool = True
    #: planned for gradient accumulation: gradients held from the start of every micro-step (Note
    #: [Accumulated gradients] in remat.costs.unit_costs)
    grads_held: bool = False
    #: planned for a loop that zeroes gradients after the forward (Lightning): the previous step's gradients
    #: alive through the forward
    grads_held_in_forward: bool = False
    #: processes the plan was made for (one plan for every rank; checked by apply_plan)
    world_size: int = 1
    #: how the model was wrapped for distributed training, e.g. "FSDP2 over 2 ranks (...)" ("" for one process)
    wrapping: str = ""
    #: how the training loop compiles the model, when the plan was made for the compiled step ("" for an eager
    #: loop); then ``predicted_peak_bytes`` and ``checked_peak_bytes`` are the compiled step's, the breakdown is
    #: the eager step's (Note [Compiled steps] in remat.solve.calibrated)
    compiled: str = ""
    #: under torch.compile, what the checkpointed units do with the outputs of operators that draw random numbers
    #: (dropout): "keep" them (Note [Random operators under compile] in remat.rewrite) or "recompute" them, as
    #: torch's own checkpoint does, where the compiled planned step was proved to draw the plain compiled step's
    #: numbers (Note [Two programs per plan] in remat.solve.calibrated); eager steps always recompute them
    compiled_random: str = "keep"
    #: parameter names and shapes of the model the plan was made for (checked by apply_plan)
    model_signature: tuple[tuple[str, tuple[int, ...]], ...] = field(default_factory=tuple)
    #: the device and world the plan was made for when they were modelled, not here (remat.target), e.g. "NVIDIA
    #: H100 SXM 80GB (79.2 GiB) x 8 ranks (FSDP 8)"; "" for a plan made where the model runs
    target: str = ""
    #: for a modelled target, the peak the CUDA caching allocator is predicted to reserve with this plan (bytes; the
    #: budget applies to it); None otherwise
    predicted_reserved_bytes: int | None = None
    #: for a modelled GPU target, the device memory its CUDA caching allocator can get (bytes); the plan fits the
    #: device when ``predicted_reserved_bytes`` is within it (:attr:`fits_device`); None otherwise
    device_memory_bytes: int | None = None
    #: tokens one device trains on per step, FLOPs of one plain step there and the device's peak FLOP/s (from the
    #: profile: remat.costs.unit_costs.Profile), for tokens/s and MFU; None / 0 where unknown
    tokens_per_step: int | None = None
    model_flops: int = 0
    peak_flops_per_s: float | None = None
    #: modules whose saved activations go to host memory in the forward and come back for the backward, in
    #: forward order (Note [Offloaded units] in remat.rewrite.offload): the third choice beside keeping and
    #: recomputing; none unless offloading was offered
    offloaded: tuple[str, ...] = ()
    #: for an offloaded part (``h.3~1``: Note [Offloaded parts] in remat.costs.offload), the operators of the
    #: module's forward whose outputs it moves (``aten.mm.default#1``); a whole module moves every saved storage
    offloaded_ops: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: per offloaded module, the offloaded module run right before it at its level, whose storages its backward
    #: starts bringing back (Note [Exposed copies] in remat.costs.offload: decided from the recorded order when the
    #: plan is made); a plan without it brings each unit back at its own backward
    offload_ahead: dict[str, str] = field(default_factory=dict)
    #: bytes the offloaded units move each way per step, predicted
    predicted_offload_bytes: int = 0
    #: seconds of those copies the compute does not hide, predicted (in ``predicted_step_time_s``: Note [Offload in
    #: the memory model] in remat.costs.offload)
    predicted_exposed_copy_s: float = 0.0
    #: what the user should know about the plan: assumptions, settings remat changed, how it was checked
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: forward and backward passes run to time the plan beside the hand rules, and their seconds with the rules'
    #: checked steps run for it, measured (Note [Plans timed beside the hand rules] in remat.api.hand_rules)
    rules_timing_passes: int = 0
    rules_timing_s: float = 0.0
    #: ``min_peak_bytes`` was measured on a real step (Note [Least peak is a promise] in remat.api.checking: only
    #: where the budget is near it or a plan failed), not predicted
    min_peak_checked: bool = False

    @property
    def choices(self) -> tuple[str, ...]:
        """The plan as the memory model's choices: the checkpointed units and ``offload:`` + each offloaded one."""
        return self.checkpointed + tuple("offload:" + u for u in self.offloaded)

    @property
    def variant(self) -> tuple[tuple[str, ...], str]:
        """What makes the plan's compiled program: its units and what they do with random operators' outputs."""
        return self.checkpointed, self.compiled_random

    @property
    def predicted_tokens_per_s(self) -> float | None:
        """Tokens per second per device at the predicted step time; None for a model without token ids."""
        if not self.tokens_per_step or self.predicted_step_time_s <= 0:
            return None
        return self.tokens_per_step / self.predicted_step_time_s

    @property
    def predicted_mfu(self) -> float | None:
        """Model FLOPs utilization at the predicted step time: the plain step's FLOPs (recomputation excluded) over
        the step time and the device's dense peak; None where the peak is unknown."""
        if not self.model_flops or not self.peak_flops_per_s or self.predicted_step_time_s <= 0:
            return None
        return self.model_flops / self.predicted_step_time_s / self.peak_flops_per_s

    @property
    def fits_device(self) -> bool | None:
        """For a modelled GPU target, whether the predicted reserved peak is within the device's memory (a plan whose
        replay ran out of it is never returned: remat.target.source); None where unknown (no target, or not
        replayed)."""
        if self.device_memory_bytes is None or self.predicted_reserved_bytes is None:
            return None
        return self.predicted_reserved_bytes <= self.device_memory_bytes

    @property
    def predicted_overhead(self) -> float:
        """Predicted step-time overhead over no checkpointing, as a fraction (0.1 = 10%)."""
        if self.baseline_step_time_s <= 0:
            return 0.0
        return self.predicted_step_time_s / self.baseline_step_time_s - 1.0

    def __str__(self) -> str:
        b = self.breakdown
        lines = [
            f"remat plan ({self.strategy}, solver {self.solver_status}, solved in {self.solve_time_s:.3f} s)",
            f"  budget:               {fmt_bytes(self.budget_bytes)}",
            *([f"  compiled step:        {self.compiled}"
               f"{'; random operators recomputed in checkpointed units' if self.compiled_random == 'recompute' else ''}"]
              if self.compiled else []),
            f"  predicted peak:       {fmt_bytes(self.predicted_peak_bytes)}{' (compiled)' if self.compiled else ''}"
            f"  (no checkpointing: {fmt_bytes(self.baseline_peak_bytes)}, least possible: {fmt_bytes(self.min_peak_bytes)} "
            f"{'measured' if self.min_peak_checked else 'predicted'})",
            *([f"  target:               {self.target} (predicted, not measured)",
               f"  predicted reserved:   {fmt_bytes(self.predicted_reserved_bytes)}  (the CUDA caching allocator "
               "replayed over two recorded steps; the budget applies to it)",
               *([f"  fits the device:      {'yes' if self.fits_device else 'NO'} ({fmt_bytes(self.device_memory_bytes)}"
                  " the allocator can get, predicted)" if self.fits_device is not None else
                  "  fits the device:      not replayed (check=False)"] if self.device_memory_bytes is not None
                 else [])] if self.target else []),
            *([f"  checked peak:         {fmt_bytes(self.checked_peak_bytes)}  (one real "
               f"{'compiled ' if self.compiled else ''}step: forward and backward measured, optimizer predicted)"]
              if self.checked_peak_bytes is not None else []),
            f"  predicted step time:  {self.predicted_step_time_s * 1e3:.1f} ms"
            f"  ({'predicted' if self.target else 'measured'} without checkpointing: "
            f"{self.baseline_step_time_s * 1e3:.1f} ms, "
            f"{self.predicted_overhead:+.1%})",
            *(["  predicted throughput: " + ", ".join(
                x for x in (f"{self.predicted_tokens_per_s:,.0f} tokens/s per device"
                            if self.predicted_tokens_per_s is not None else "",
                            f"MFU {self.predicted_mfu:.1%}" if self.predicted_mfu is not None else "") if x)
               + " (predicted, not measured)"]
              if self.target and (self.predicted_tokens_per_s is not None or self.predicted_mfu is not None) else []),
            f"  training loop:        {'output kept until the step ends' if self.output_alive else 'output dropped after the loss'}"
            f"{'; gradients accumulated (held from the start of each micro-step)' if self.grads_held else ''}"
            f"{'; zero_grad after the forward (last step gradients alive in it)' if self.grads_held_in_forward else ''}",
            f"  peak breakdown (predicted{', eager step' if self.compiled else ''}, at {b.phase}):",
        ]
        for key, label in [
            ("params_bytes", "parameters"),
            ("grads_bytes", "gradients"),
            ("optimizer_state_bytes", f"optimizer state [{self.optimizer or '?'}]"),
            ("buffers_bytes", "buffers"),
            ("inputs_bytes", "inputs"),
            *((("workspace_bytes", "library workspaces (cuBLAS)"),) if b.workspace_bytes else ()),
            ("saved_activations_bytes", "saved activations"),
            ("temporaries_bytes", "temporaries"),
        ]:
            lines.append(f"    {label:<31} {fmt_bytes(getattr(b, key))}")
        if b.largest:
            lines.append(f"  what holds the predicted peak (largest first; no plan frees {fmt_bytes(b.unfreeable_bytes)} of these):")
            lines += [f"    {h}" for h in b.largest]
        if self.checkpointed:
            lines.append(f"  checkpointed ({len(self.checkpointed)}): " + ", ".join(
                f"{u} (inside {self.nested_in[u]})" if u in self.nested_in else u for u in self.checkpointed))
            for unit, ops in self.saved_ops.items():
                lines.append(f"    {unit}: selective, {policy_summary(ops)}; recomputes the rest")
        else:
            lines.append("  checkpointed: nothing")
        if self.offloaded:
            lines.append(f"  offloaded to host ({len(self.offloaded)}): {', '.join(self.offloaded)}; "
                         f"{fmt_bytes(self.predicted_offload_bytes)} each way per step, "
                         f"{self.predicted_exposed_copy_s * 1e3:.1f} ms of copying not hidden behind compute "
                         "(predicted)")
            for part, ops in self.offloaded_ops.items():
                lines.append(f"    {part}: the outputs of {len(ops)} of {offloaded_module(part)}'s operators "
                             f"({', '.join(ops[:4])}{', ...' if len(ops) > 4 else ''}); the rest stays on the device")
        if self.rules_timing_passes or round(self.rules_timing_s, 1):
            lines.append(f"  timed beside hand rules: {self.rules_timing_passes} forward and backward passes, "
                         f"{self.rules_timing_s:.1f} s measured (the rules' checked steps included)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["format"] = PLAN_FORMAT
        # derived, for readers of --json (from_dict drops them)
        d["predicted_tokens_per_s"], d["predicted_mfu"] = self.predicted_tokens_per_s, self.predicted_mfu
        d["fits_device"] = self.fits_device
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        d = dict(d)
        for derived in ("format", "predicted_tokens_per_s", "predicted_mfu", "fits_device"):
            d.pop(derived, None)
        d["checkpointed"] = tuple(d["checkpointed"])
        d["offloaded"] = tuple(d.get("offloaded", ()))
        d["offloaded_ops"] = {k: tuple(v) for k, v in d.get("offloaded_ops", {}).items()}
        d["offload_ahead"] = dict(d.get("offload_ahead", {}))
        d["model_signature"] = tuple((n, tuple(s)) for n, s in d.get("model_signature", ()))
        d["notes"] = tuple(d.get("notes", ()))
        d["mutated_buffers"] = {k: tuple(v) for k, v in d.get("mutated_buffers", {}).items()}
        d["saved_ops"] = {k: tuple(v) for k, v in d.get("saved_ops", {}).items()}
        d["nested_in"] = dict(d.get("nested_in", {}))
        d["breakdown"] = PeakBreakdown(**{**d["breakdown"], "largest": tuple(
            HeldTensor(**{**h, "shape": tuple(h["shape"])}) for h in d["breakdown"].get("largest", ()))})
        return cls(**d)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON (``remat.Plan.load`` reads it back)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        from remat.errors import PlanMismatchError

        try:
            d = json.loads(Path(path).read_text())
            return cls.from_dict(d)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise PlanMismatchError(f"cannot read a remat plan from {path}: {e}") from e
