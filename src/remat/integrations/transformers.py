"""remat for the Hugging Face ``Trainer`` (and accelerate under it): ``pip install 'remat[hf]'``.

    from remat.integrations.transformers import RematCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[RematCallback(budget_gb=20)])
    trainer.train()

The callback plans on the first training batch (Note [Plan on the first batch] in
remat.integrations.first_step): its shapes, the Trainer's optimizer (never called), its loss (the model's
``loss`` from ``labels``, or ``loss_fn``), the output dropped after the loss as ``compute_loss`` does, bf16
or fp16 autocast as accelerate applies it, and ``gradient_accumulation_steps``; with ``torch_compile=True`` the plan is made and checked for the step
compiled with the Trainer's ``torch_compile_backend`` and ``torch_compile_mode`` (Note [Compiled steps] in
remat.solve.calibrated). It takes over from
``gradient_checkpointing=True`` (remat's plan replaces the model's own checkpointing; a warning says so).
The plan is logged (the ``transformers`` logger, and ``remat/*`` entries in ``trainer.state.log_history``)
and kept in ``callback.plan``, with the measured peak of the second training step (the first with the optimizer's state: all its
micro-batches and the optimizer step, measured as remat measures its checked step) in
``callback.measured_peak_bytes``; ``plan=`` applies a saved plan instead (``plan.save(path)``).

Under distributed training (accelerate's DDP: ``torchrun ... train.py``) every rank plans on its own
first batch and all ranks agree on one plan (Note [One plan for every rank] in remat.runtime.distributed); the
plan is made on the unwrapped model with DDP's gradient buckets set aside from the budget (Note [DDP
buckets reserved] in remat.integrations.first_step).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from remat.integrations.first_step import RematCallbackBase, missing_framework

try:
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
except ImportError as e:  # pragma: no cover - exercised without transformers installed
    raise missing_framework("hf", "transformers", e) from e

logger = hf_logging.get_logger(__name__)


def trains_in_ddp(args) -> bool:
    """Whether the Trainer wraps the model in DistributedDataParallel (launched distributed, neither FSDP nor
    DeepSpeed), read from its arguments."""
    from transformers.training_args import ParallelMode

    return (getattr(args, "parallel_mode", None) == ParallelMode.DISTRIBUTED and not getattr(args, "fsdp", None)
            and not getattr(args, "deepspeed", None))


class RematCallback(RematCallbackBase, TrainerCallback):
    """Plan activation checkpointing for ``budget_gb`` GiB per training step on the Trainer's first batch
    and apply it before the first step (or apply ``plan``, a Plan or a saved plan's path).

    ``loss_fn(output)`` as in ``remat.optimize_checkpointing`` (default: the model's ``loss``); ``granularity``,
    ``check`` and ``compile`` too (``compile`` default: the Trainer's ``torch_compile`` settings)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handle = None
        self._entry: dict = {}
        self._steps_done = 0
        self._planning = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.first.applied is not None or model is None:
            return
        # transformers 5 names it activation_checkpointing (gradient_checkpointing is its deprecated alias)
        flag = next((name for name in ("activation_checkpointing", "gradient_checkpointing")
                     if getattr(args, name, False) is True), None)
        if flag is not None:
            logger.warning(f"remat: {flag}=True is taken over by remat's plan (the model's own checkpointing is "
                           f"turned off when the plan is applied); leave it False with RematCallback")
        accumulating = getattr(args, "gradient_accumulation_steps", 1) > 1

        # Note [Compiled Trainer]: with torch_compile=True accelerate wraps the model in torch.compile, so this
        # hook runs inside the compiled call: it must run eagerly (the planning step graph-breaks once, before
        # the first step's forward), and the plan is made for the step compiled with the Trainer's settings
        compile_settings = None
        if getattr(args, "torch_compile", False):
            compile_settings = {k: v for k, v in (("backend", getattr(args, "torch_compile_backend", None)),
                                                  ("mode", getattr(args, "torch_compile_mode", None))) if v}

        @torch.compiler.disable
        def training_forward(module, fwd_args, fwd_kwargs):
            if self._planning or not (module.training and torch.is_grad_enabled()):
                return None  # remat's own profiling steps, or an evaluation forward: wait for training
            # the Trainer calls model(**inputs): the same keyword arguments are the example batch
            inputs = dict(fwd_kwargs)
            if fwd_args:  # a subclass's compute_loss calling model(x, ...): name them as the forward does
                inputs = dict(inspect.signature(module.forward).bind(*fwd_args, **fwd_kwargs).arguments)
            if self.first.applied is None:  # the first step: plan, then let it run
                self._planning = True
                try:
                    self.first.run(module, inputs, optimizer=optimizer, output_alive=False,
                                   grad_accumulation=accumulating, ddp=trains_in_ddp(args),
                                   compile=compile_settings)  # None: blocks compiled in place are detected
                finally:
                    self._planning = False
                logger.warning(self.first.summary())
                self._entry = {**self.first.metrics(), "step": state.global_step}
                state.log_history.append(self._entry)
            elif self._steps_done >= 1:  # the second step's first forward (Note [The first step measured])
                self._remove_hook()
                self.first.start_measuring(module, optimizer, inputs)
            return None

        self._handle = model.register_forward_pre_hook(training_forward, with_kwargs=True)

    def on_step_end(self, args, state, control, **kwargs):
        self._steps_done += 1
        if self.first._meter is not None:  # Note [The first step measured] in remat.integrations.first_step
            self.first.stop_measuring()
            self._entry.update(self.first.metrics())
            logger.warning(self.first.summary())

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hook()
        self.first.stop_measuring()

    def _remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
