"""remat for Lightning (``lightning.Trainer`` or ``pytorch_lightning.Trainer``): ``pip install 'remat[lightning]'``.

    from remat.integrations.lightning import RematCallback
    trainer = lightning.Trainer(max_steps=1000, precision="bf16-mixed", callbacks=[RematCallback(budget_gb=20)])

The callback plans in ``on_train_batch_start`` of the first training batch (Note [Plan on the first batch]
in remat.integrations.first_step): the training step remat profiles is your ``training_step`` on that batch
(its returned loss, or ``loss`` of the dict it returns), under the Trainer's precision context
(``precision="bf16-mixed"``, ``"16-mixed"``), with the Trainer's optimizer (never called) and its
``accumulate_grad_batches``, and its ``zero_grad`` between the forward and the backward (the previous
step's gradients are alive through the forward); a module passed to ``fit`` compiled (``torch.compile(module)``)
is planned for its compiled training step, with the settings it was compiled with (read from Dynamo's context,
which Lightning keeps; ``compile={...}`` overrides them). While remat profiles, ``self.log``/``self.log_dict`` of the module do nothing (a
profiling step is not a training step), and what its ``training_step`` calls (11 on a 2-block GPT; 6 when the
step's times are in remat's timing cache, Note [Timing cache] in remat.profile.cache; where a hand rule meets the
budget and the model cannot tell it from the plan, up to 2 more, the rules' checked steps (on a CPU only for a rule
measured faster), and, where those steps do not confirm the model's ranking (on CUDA they can), timed passes: 3
where the first pair confirms it, 33 at most (11 rounds of the plan and two rules; 21 for a step of a second or
more), counted in ``plan.rules_timing_passes``; Note [Plans timed beside the hand rules] in
remat.api.hand_rules) did to the
module's attributes is undone afterwards (Note [Attributes kept] in remat.runtime.state: tensors, lists, dicts, sets,
numbers, torchmetrics metrics); other side effects (prints, your own loggers, files) are not, and the plan's
notes give the count of calls. The plan is logged (``remat/*`` metrics and an info line) and kept
in ``callback.plan``, with the measured peak of the second optimizer step (the first with the optimizer's state) in
``callback.measured_peak_bytes``; its unit names are the LightningModule's own, so ``plan.save(path)`` and
``RematCallback(plan=path)`` (or ``remat.apply_plan(module, plan)``) reuse it. Manual optimization is not
supported (the training step runs its own backward).

``RematCallback`` derives from ``lightning.pytorch.Callback`` when the ``lightning`` package is installed,
otherwise from ``pytorch_lightning.Callback``; ``PLRematCallback`` is the ``pytorch_lightning`` one when both are.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from remat._compat import compile_settings, lightning_compiled
from remat.runtime.compiled import DetectedCompile
from remat.errors import UnsupportedError
from remat.integrations.first_step import RematCallbackBase, missing_framework
from remat.solve.plan import Plan
from remat.runtime.state import kept_attributes

log = logging.getLogger(__name__)

try:
    import lightning.pytorch as _lightning
except ImportError:
    _lightning = None
try:
    import pytorch_lightning as _pytorch_lightning
except ImportError:
    _pytorch_lightning = None
if _lightning is None and _pytorch_lightning is None:  # pragma: no cover - exercised without lightning
    raise missing_framework("lightning", "lightning (or pytorch_lightning)", ImportError("No module named 'lightning'"))

PREFIX = "module."


class _TrainingStep(nn.Module):
    """The LightningModule's ``training_step`` on one batch, as the model remat profiles: its units are the
    module's submodules under ``module.`` (stripped from the plan given back: ``_own_names``)."""

    def __init__(self, module: nn.Module, batch_idx: int) -> None:
        super().__init__()
        self.module = module
        self.batch_idx = batch_idx
        self.counter = _Calls()

    @property
    def calls(self) -> int:
        return self.counter.n

    def forward(self, batch):
        self.counter.n += 1
        return self.module.training_step(batch, self.batch_idx)


class _Calls:
    """A call count that copies of the module it counts for share (remat measures some steps on a copy)."""

    def __init__(self) -> None:
        self.n = 0

    def __deepcopy__(self, memo) -> "_Calls":
        return self


def _own_names(plan: Plan) -> Plan:
    """``plan`` with unit and parameter names relative to the LightningModule (``module.h.0`` -> ``h.0``)."""
    def own(name: str) -> str:
        return name[len(PREFIX):] if name.startswith(PREFIX) else ("" if name == PREFIX[:-1] else name)

    return dataclasses.replace(
        plan, checkpointed=tuple(own(n) for n in plan.checkpointed),
        saved_ops={own(k): v for k, v in plan.saved_ops.items()},
        mutated_buffers={own(k): v for k, v in plan.mutated_buffers.items()},
        model_signature=tuple((own(n), s) for n, s in plan.model_signature))


class _RematLightning(RematCallbackBase):
    """Plan activation checkpointing for ``budget_gb`` GiB per training step on the first training batch and
    apply it before the first step (or apply ``plan``: a Plan or a saved plan's path).

    ``loss_fn(output)`` maps what ``training_step`` returns to the loss (default: the tensor itself, or its
    ``"loss"`` entry); ``granularity``, ``check`` and ``compile`` as in ``remat.optimize_checkpointing``."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.first.applied is not None:
            if self._measuring(trainer, batch_idx)[0]:
                self.first.start_measuring(pl_module, trainer.optimizers[0] if trainer.optimizers else None, batch)
            return
        if not pl_module.automatic_optimization:
            raise UnsupportedError(
                "remat's Lightning callback needs automatic optimization: with automatic_optimization = False your "
                "training_step runs backward itself, so remat cannot run it as a forward; call "
                "remat.optimize_checkpointing(model, budget_gb, batch, optimizer=...) on the module yourself")
        if self.first.plan is not None:
            self.first.run(pl_module, None, optimizer=None, output_alive=True, grad_accumulation=False)
        else:
            optimizers = trainer.optimizers
            step = _TrainingStep(pl_module, batch_idx)
            names = ("log", "log_dict")
            # Note [Compiled LightningModule]: trainer.fit(torch.compile(module)) unwraps it and compiles the
            # module's forward and training_step in place (lightning's from_compiled: _compiler_ctx holds the
            # originals): remat profiles the originals and plans for the compiled training step
            originals = lightning_compiled(pl_module)
            compiled = originals is not None
            if compiled:
                names += ("forward", "training_step")
            quiet = {name: pl_module.__dict__.get(name) for name in names}
            pl_module.log = pl_module.log_dict = lambda *args, **kwargs: None
            if compiled:
                pl_module.forward, pl_module.training_step, _ = originals
            try:
                with kept_attributes(pl_module):  # Note [Attributes kept] in remat.runtime.state
                    plan = self.first.run(step, (batch,), optimizer=optimizers[0] if len(optimizers) == 1 else None,
                                          output_alive=True, grad_accumulation=trainer.accumulate_grad_batches > 1,
                                          # Lightning's closure: training_step, zero_grad, backward
                                          zero_grad_after_forward=True,
                                          autocast=trainer.precision_plugin.forward_context(),
                                          ddp=type(trainer.strategy).__name__ == "DDPStrategy",
                                          # the settings it was compiled with, read from Dynamo's context
                                          compile=DetectedCompile(
                                              compile_settings(originals[2]),
                                              "Lightning compiled the module (torch.compile(module) passed to "
                                              "fit)") if compiled else None)
            finally:
                for name, value in quiet.items():
                    if value is None:
                        pl_module.__dict__.pop(name, None)
                    else:
                        pl_module.__dict__[name] = value
            plan = dataclasses.replace(plan, notes=plan.notes + (
                f"training_step ran {step.calls} times on the first batch while remat planned; what it did to "
                "the module's attributes (tensors, lists, dicts, numbers, torchmetrics metrics) was undone and "
                "self.log did nothing, other side effects (prints, your own loggers, files) were not undone",))
            self.first.applied = _own_names(plan)
        log.info(self.first.summary())
        if trainer.logger is not None:
            pl_module.log_dict(self.first.metrics(), on_step=True, on_epoch=False, batch_size=1)

    def _measuring(self, trainer, batch_idx: int) -> tuple[bool, bool]:
        """Whether ``batch_idx`` starts / ends the second optimizer step (Note [The first step measured])."""
        k = trainer.accumulate_grad_batches
        return batch_idx == k, batch_idx == 2 * k - 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.first._meter is not None and self._measuring(trainer, batch_idx)[1]:
            self.first.stop_measuring()
            log.info(self.first.summary())
            if trainer.logger is not None:
                pl_module.log("remat/measured_peak_gb", self.first.measured_peak_bytes / 2**30, on_step=True,
                              on_epoch=False, batch_size=1)

    def on_train_end(self, trainer, pl_module) -> None:
        self.first.stop_measuring()


if _lightning is not None:
    class RematCallback(_RematLightning, _lightning.Callback):
        __doc__ = _RematLightning.__doc__

if _pytorch_lightning is not None:
    class PLRematCallback(_RematLightning, _pytorch_lightning.Callback):
        __doc__ = _RematLightning.__doc__ + "\n\nFor ``pytorch_lightning.Trainer``."

    if _lightning is None:
        RematCallback = PLRematCallback  # noqa: F811
