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
from remat.errors import InvalidInputError, MissingDependencyError
from remat.plan import GiB, Plan

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
    #: the plan applied, once the first batch has been seen
    applied: Plan | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if (self.budget_gb is None) == (self.plan is None):
            raise InvalidInputError(
                "RematCallback needs exactly one of budget_gb= (GiB per training step, to plan on the first "
                f"batch) and plan= (a remat.Plan or the path of a saved one); got budget_gb={self.budget_gb!r}, "
                f"plan={self.plan!r}")
        if isinstance(self.plan, (str, Path)):
            self.plan = Plan.load(self.plan)

    def run(self, model: nn.Module, example_inputs: Any, *, optimizer: Any, output_alive: bool,
            grad_accumulation: bool, autocast: ContextManager | None = None) -> Plan:
        """Plan ``model`` on ``example_inputs`` (or apply the saved plan) and remember the plan."""
        if self.plan is not None:
            apply_plan(model, self.plan)
            self.applied = self.plan
            return self.plan
        with autocast if autocast is not None else contextlib.nullcontext():
            self.applied = optimize_checkpointing(
                model, self.budget_gb, example_inputs, loss_fn=self.loss_fn,
                optimizer=underlying_optimizer(optimizer), check=self.check, granularity=self.granularity,
                output_alive=output_alive, grad_accumulation=grad_accumulation)
        return self.applied

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
        return out

    def summary(self) -> str:
        p = self.applied
        if p is None:
            return "remat: no plan yet"
        checked = "" if p.checked_peak_bytes is None else f", checked {p.checked_peak_bytes / GiB:.3f} GiB"
        budget = "" if p.budget_bytes is None else f"budget {p.budget_bytes / GiB:.3f} GiB, "
        return (f"remat: checkpointing {len(p.checkpointed)} units ({', '.join(p.checkpointed[:6])}"
                f"{', ...' if len(p.checkpointed) > 6 else ''}); {budget}predicted peak "
                f"{p.predicted_peak_bytes / GiB:.3f} GiB{checked} (no checkpointing: {p.baseline_peak_bytes / GiB:.3f} GiB)")


def missing_framework(extra: str, package: str, error: ImportError) -> MissingDependencyError:
    return MissingDependencyError(f"remat.integrations.{extra if extra != 'hf' else 'transformers'} needs {package}, "
                                  f"which is not installed: pip install 'remat[{extra}]' ({error})")
