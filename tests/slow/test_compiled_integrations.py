"""The integrations' callbacks under torch.compile (moved from tests/integration/test_integrations.py: their
compiles took 30 s of the suite's 5 minutes): the HF Trainer with ``torch_compile=True`` and Lightning fitting a
compiled module, each planned for the compiled step and measured within its budget, training as the compiled run
without remat."""

from __future__ import annotations

import pytest
import torch

import remat
from helpers import needs_compiled_floor
from test_integrations import (hf_train, lightning_batches, lightning_module, lightning_step_peak, logged,
                               tiny_llama, token_rows, trainer_step_peak)


@needs_compiled_floor
def test_hf_trainer_callback_with_torch_compile(tmp_path):
    """``TrainingArguments(torch_compile=True)``: the callback plans (eagerly, inside the compiled call's hook)
    for the step compiled with the Trainer's backend; the Trainer's own compiled step measures within the
    budget, and training equals the compiled run without remat."""
    from remat.integrations.transformers import RematCallback

    batch = token_rows(4)
    batch = {k: torch.stack([r[k] for r in batch]) for k in batch[0]}
    # one layer: the compiled planning's compiles (one per measured plan) are most of this test's time
    compiled = dict(torch_compile=True, torch_compile_backend="aot_eager", layers=1)
    probe = tiny_llama(1).train()
    roomy = remat.optimize_checkpointing(probe, 1.0, batch, output_alive=False,
                                         optimizer=torch.optim.AdamW(probe.parameters()), compile={"backend": "aot_eager"})
    budget = roomy.checked_peak_bytes - 1  # the compiled step without checkpointing, less a byte
    reference = hf_train(tmp_path / "ref", [], 1, False, **compiled)
    callback = RematCallback(budget_gb=budget / 2**30)
    trainer = hf_train(tmp_path / "remat", [callback], 1, False, **compiled)
    plan = callback.plan
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert "backend='aot_eager'" in plan.compiled and plan.checkpointed
    assert plan.checked_peak_bytes <= budget
    assert logged(trainer, "loss") == logged(reference, "loss") and len(logged(trainer, "loss")) == 3
    assert trainer_step_peak(trainer, 1) <= budget
    assert callback.measured_peak_bytes <= budget


@needs_compiled_floor
def test_lightning_callback_with_a_compiled_module():
    """``trainer.fit(torch.compile(module))``: Lightning compiles the module's training_step in place; the
    callback plans for that compiled step (its backend read from Dynamo's context, which Lightning keeps), the Trainer's own step measures
    within the budget, and training equals the compiled run without remat."""
    L = pytest.importorskip("lightning.pytorch")
    from remat.integrations.lightning import RematCallback

    def train(callbacks):
        losses = []

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(outputs["loss"].item())

        torch.manual_seed(0)
        module = lightning_module(L, layers=1)  # one block: the compiles are most of this test's time
        # Dynamo (torch 2.13) fails tracing Lightning's self.log (inspect.getfullargspec of a bound method):
        # a compiled training_step that logs does not run with or without remat
        module.log = lambda *a, **k: None
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[*callbacks, Record()], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(torch.compile(module, backend="aot_eager"),
                    torch.utils.data.DataLoader(lightning_batches(), batch_size=4, shuffle=False))
        return trainer, module, losses

    _, _, ref_losses = train([])
    roomy = RematCallback(budget_gb=1.0)  # the backend is read from the compiled module (aot_eager)
    train([roomy])
    assert roomy.plan.compiled and roomy.plan.checkpointed == ()
    # the compiled step without checkpointing, less a byte (a budget from the reference run's own step by the
    # allocator's events, less 1%, was once 2,164,250 bytes against remat's least compiled peak of 2,644,104 in
    # a fresh-clone CI run: the two meters of one compiled step do not always agree; not understood yet)
    budget = roomy.plan.checked_peak_bytes - 1
    callback = RematCallback(budget_gb=budget / 2**30)
    trainer, trained, losses = train([callback])
    plan = callback.plan
    assert "backend='aot_eager'" in plan.compiled and plan.checkpointed and plan.checked_peak_bytes <= budget
    # where the loop's compile was found (it said "compile={...}", an argument nobody passed, until session 16)
    assert "Lightning compiled the module" in plan.compiled and "its settings read from it" in plan.compiled, \
        plan.compiled
    assert hasattr(trained.__dict__["training_step"], "_torchdynamo_orig_callable")  # still compiled by Lightning
    assert losses == pytest.approx(ref_losses, abs=1e-6) and len(losses) == 3
    assert lightning_step_peak(trainer, trained, 1, False) <= budget
    assert callback.measured_peak_bytes <= budget
