"""What the framework callbacks share: plan (or apply a saved plan) on the first real training batch.

Note [Plan on the first batch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A framework builds the batch, the optimizer, the precision context and the gradient-accumulation loop
itself; remat needs all of them to plan, and must not change what the run does. So the callbacks wait
for the first training batch the framework produces (Lightning hands it to ``on_train_batch_start``; the
Hugging Face Trainer hands its callbacks no batch, so a one-shot forward pre-hook on the model sees the
keyword arguments of its first training forward) and plan on exactly that batch, inside the framework's
autocast context. Drawing a batch from the data loader instead would move its sampler's RNG and change
the run. ``optimize_checkpointing`` gives back the RNG state, gradients, buffers, optimizer and scheduler
(it never calls them), so the run trains exactly as it would without remat, with the plan applied before
the first step's forward.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from remat.api import apply_plan, optimize_checkpointing
from remat.runtime.compiled import DetectedCompile
from remat.errors import InvalidInputError, MissingDependencyError
from remat.runtime.measure import AllocatorMeter, StepMeter, input_tensors, model_device, tensor_bytes
from remat.solve.plan import GiB, Plan, fmt_bytes, policy_summary

log = logging.getLogger(__name__)


def underlying_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside a framework's wrapper (accelerate's ``AcceleratedOptimizer.optimizer``,
    Lightning's ``LightningOptimizer._optimizer``), read as attributes: nothing is called."""
    for _ in range(4):
        if optimizer is None:
            return None
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            optimizer = inner
            continue
        break
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


@dataclass
class FirstStep:
    """The settings a callback plans with, and what it did (``plan``, ``metrics``)."""

    budget_gb: float | None = None
    #: a Plan, or the path of a saved one (``plan.save``), applied instead of planning
    plan: Plan | str | Path | None = None
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    granularity: str = "op"
    check: bool = True
    #: how the loop compiles the model (``optimize_checkpointing``'s ``compile``; None: the framework's settings)
    compile: bool | dict | None = None
    #: the plan applied, once the first batch has been seen
    applied: Plan | None = field(default=None, init=False)
    #: bytes of the budget set aside for DDP's gradient buckets (Note [DDP buckets reserved])
    reserved_bytes: int = field(default=0, init=False)
    #: the measured peak of the second training step with the plan applied (Note [The first step measured])
    measured_peak_bytes: int | None = field(default=None, init=False)
    _meter: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.budget_gb is None) == (self.plan is None):
            raise InvalidInputError(
                "RematCallback needs exactly one of budget_gb= (GiB per training step, to plan on the first "
                f"batch) and plan= (a remat.Plan or the path of a saved one); got budget_gb={self.budget_gb!r}, "
                f"plan={self.plan!r}")
        if isinstance(self.plan, (str, Path)):
            self.plan = Plan.load(self.plan)

    def run(self, model: nn.Module, example_inputs: Any, *, optimizer: Any, output_alive: bool,
            grad_accumulation: bool, zero_grad_after_forward: bool = False,
            autocast: ContextManager | None = None, ddp: bool = False,
            compile: bool | dict | DetectedCompile | None = None) -> Plan:
        """Plan ``model`` on ``example_inputs`` (or apply the saved plan) and remember the plan. ``ddp``: the
        framework trains ``model`` inside DistributedDataParallel (Note [DDP buckets reserved]); ``compile``: how
        the framework compiles it (the callback's own ``compile`` argument, when given, wins)."""
        if self.plan is not None:
            apply_plan(model, self.plan)
            self.applied = self.plan
            return self.plan
        self.reserved_bytes = ddp_bucket_bytes(model) if ddp else 0
        budget_gb = self.budget_gb - self.reserved_bytes / GiB
        if budget_gb <= 0:
            raise InvalidInputError(
                f"budget_gb={self.budget_gb} does not cover DistributedDataParallel's gradient buckets "
                f"({self.reserved_bytes / GiB:.3f} GiB, a copy of the gradients): raise it")
        with autocast if autocast is not None else contextlib.nullcontext():
            self.applied = optimize_checkpointing(
                model, budget_gb, example_inputs, loss_fn=self.loss_fn,
                optimizer=underlying_optimizer(optimizer), check=self.check, granularity=self.granularity,
                output_alive=output_alive, grad_accumulation=grad_accumulation,
                zero_grad_after_forward=zero_grad_after_forward,
                compile=self.compile if self.compile is not None else compile)
        return self.applied

    def start_measuring(self, model: nn.Module, optimizer: Any, example_inputs: Any) -> None:
        """Note [The first step measured]: the framework's second optimizer step (the first that starts with
        the optimizer's state, as the budget assumes; the first creates it) runs, with the plan applied, every
        micro-batch of it and the optimizer step, under remat's memory meter
        (``remat.runtime.measure.StepMeter``: the same count as remat's checked step; the previous step's gradients
        followed until the loop frees them); its peak, with what was alive when it began (parameters,
        buffers, gradients, optimizer state, the batch), is ``measured_peak_bytes``: the loop's own step,
        measured, next to the prediction (None when training stops after one step)."""
        opt = underlying_optimizer(optimizer)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        state = [*model.parameters(), *model.buffers(),
                 *(t for s in (opt.state.values() if opt is not None else ()) for t in s.values() if torch.is_tensor(t)),
                 *input_tensors((example_inputs,), {})]
        # compiled code allocates outside the dispatcher (Note [Compiled steps] in remat.solve.calibrated)
        compiled = self.applied is not None and self.applied.compiled
        self._meter = (AllocatorMeter if compiled else StepMeter)(model_device(model))
        self._meter.start(state, follow=grads)

    def stop_measuring(self) -> None:
        if self._meter is not None:
            self.measured_peak_bytes = self._meter.stop()
            self._meter = None

    def metrics(self) -> dict[str, float]:
        """The applied plan as numbers for the framework's logger."""
        p = self.applied
        if p is None:
            return {}
        out = {"remat/units": float(len(p.checkpointed)), "remat/predicted_peak_gb": p.predicted_peak_bytes / GiB,
               "remat/baseline_peak_gb": p.baseline_peak_bytes / GiB}
        if p.budget_bytes is not None:
            out["remat/budget_gb"] = p.budget_bytes / GiB
        if p.checked_peak_bytes is not None:
            out["remat/checked_peak_gb"] = p.checked_peak_bytes / GiB
        if self.measured_peak_bytes is not None:
            out["remat/measured_peak_gb"] = self.measured_peak_bytes / GiB
        if self.reserved_bytes:
            out["remat/ddp_buckets_gb"] = self.reserved_bytes / GiB
        return out

    def summary(self) -> str:
        """The one line users see: the units (nesting and selective policies said, as ``str(plan)`` says them),
        the budget, the predicted, checked and measured peaks."""
        p = self.applied
        if p is None:
            return "remat: no plan yet"

        def unit(name: str) -> str:
            out = name
            if name in p.saved_ops:
                out += f" (selective: {policy_summary(p.saved_ops[name])})"
            if name in p.nested_in:
                out += f" inside {p.nested_in[name]}"
            return out

        units = ", ".join(unit(u) for u in p.checkpointed[:6]) + (", ..." if len(p.checkpointed) > 6 else "")
        checked = "" if p.checked_peak_bytes is None else f", checked {fmt_bytes(p.checked_peak_bytes)}"
        if self.measured_peak_bytes is not None:
            checked += f", measured on the second training step {fmt_bytes(self.measured_peak_bytes)}"
        budget = "" if p.budget_bytes is None else f"budget {fmt_bytes(p.budget_bytes)}, "
        if self.reserved_bytes:
            budget += f"plus {fmt_bytes(self.reserved_bytes)} set aside for DDP's gradient buckets, "
        compiled = " for the compiled step" if p.compiled else ""
        return (f"remat: checkpointing {len(p.checkpointed)} units{compiled} ({units}); {budget}predicted peak "
                f"{fmt_bytes(p.predicted_peak_bytes)}{checked} (no checkpointing: {fmt_bytes(p.baseline_peak_bytes)})")


def ddp_bucket_bytes(model: nn.Module) -> int:
    """Note [DDP buckets reserved]: the callbacks see the framework's model inside its DistributedDataParallel
    wrapper, from within its forward, where remat cannot plan on the wrapper itself; they plan on the module
    and set aside what DDP adds: its gradient buckets, a flat copy of every trainable gradient allocated when
    the wrapper is built (``gradient_as_bucket_view=False``, the default in accelerate and Lightning). On 2
    gloo ranks under the Trainer, a plan made without the reserve measured 75.4 MiB against a 71.7 MiB
    budget, 3.7 MiB over: the Llama's gradients."""
    return tensor_bytes([p for p in model.parameters() if p.requires_grad], model_device(model))


class RematCallbackBase:
    """What both framework callbacks share: their arguments, ``plan`` and ``measured_peak_bytes``."""

    def __init__(self, budget_gb: float | None = None, *, plan: Plan | str | Path | None = None,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None, granularity: str = "op",
                 check: bool = True, compile: bool | dict | None = None) -> None:
        super().__init__()
        self.first = FirstStep(budget_gb, plan, loss_fn, granularity, check, compile)

    @property
    def plan(self) -> Plan | None:
        """The plan applied (None until the first training batch)."""
        return self.first.applied

    @property
    def measured_peak_bytes(self) -> int | None:
        """The measured peak of the second training step (the first with the optimizer's state) with the plan
        applied (Note [The first step measured]); None until it ends."""
        return self.first.measured_peak_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes of ``budget_gb`` set aside for DDP's gradient buckets (Note [DDP buckets reserved]): the
        plan's own budget is ``budget_gb`` less these."""
        return self.first.reserved_bytes


def missing_framework(extra: str, package: str, error: ImportError) -> MissingDependencyError:
    return MissingDependencyError(f"remat.integrations.{extra if extra != 'hf' else 'transformers'} needs {package}, "
                                  f"which is not installed: pip install 'remat[{extra}]' ({error})")
