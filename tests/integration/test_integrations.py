"""remat inside the Hugging Face Trainer and Lightning (remat.integrations): real ``train()`` runs of a few
steps, with and without remat, on CPU. Each plans on the first real batch, trains exactly as the run
without remat (same losses, learning rates and final parameters: planning touched neither the optimizer
nor the scheduler nor the RNG), and a measured step of the loop fits the budget; with gradient
accumulation 2 and with bf16 autocast too."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from torch import nn

import remat
from remat._compat import profiler_memory_peak
from remat.runtime.measure import tensor_bytes

CPU = torch.device("cpu")
VOCAB = 256
LOOPS = [(1, False), (2, False), (1, True)]
LOOP_IDS = ["plain", "accumulate-2", "bf16"]


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> int:
    """What is alive before a step: parameters, buffers, gradients, optimizer state and the batch."""
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)),
               *(t for t in (batch.values() if isinstance(batch, dict) else batch) if torch.is_tensor(t))]
    return tensor_bytes(tensors, CPU)


def mid_budget(model, batch, *, accumulate: bool, bf16: bool, output_alive: bool, loss_fn=None,
               zero_grad_after_forward: bool = False) -> int:
    """A budget halfway between the least peak and the no-checkpointing peak of this loop."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with autocast:
        profile = remat.make_profile(model, batch, loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters()),
                                     output_alive=output_alive, grad_accumulation=accumulate,
                                     zero_grad_after_forward=zero_grad_after_forward)
    planner = remat.Planner(profile)
    assert planner.min_peak_bytes < planner.baseline_peak_bytes
    return (planner.min_peak_bytes + planner.baseline_peak_bytes) // 2


# -- Hugging Face Trainer ------------------------------------------------------------------------------

def tiny_llama(layers: int = 2):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1,
                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return T.LlamaForCausalLM(cfg)


def token_rows(n: int = 24, seq: int = 32):
    ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": r, "labels": r} for r in ids]


def hf_train(tmp_path, callbacks, accumulate: int, bf16: bool, layers: int = 2, **args):
    T = pytest.importorskip("transformers")
    targs = T.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=3, per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulate, bf16=bf16, logging_steps=1, report_to=[], save_strategy="no",
        seed=0, disable_tqdm=True, **args)
    trainer = T.Trainer(model=tiny_llama(layers), args=targs, train_dataset=token_rows(), callbacks=callbacks)
    trainer.train()
    return trainer


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def trainer_step_peak(trainer, accumulate: int) -> int:
    """The peak of one more optimizer step of the Trainer's own loop (``training_step`` per micro-batch,
    then the optimizer), by the profiler's allocator-level memory events, plus what was alive before."""
    model, optimizer = trainer.model_wrapped, trainer.optimizer.optimizer
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    model.zero_grad(set_to_none=True)
    for _ in range(accumulate - 1):
        trainer.training_step(model, batch)
    before = state_bytes(model, optimizer, batch)
    return before + profiler_memory_peak(lambda: (trainer.training_step(model, batch), optimizer.step()), CPU)


@pytest.mark.parametrize("accumulate,bf16", LOOPS, ids=LOOP_IDS)
def test_hf_trainer_callback(tmp_path, accumulate, bf16):
    from remat.integrations.transformers import RematCallback

    batch = token_rows(4)
    batch = {k: torch.stack([r[k] for r in batch]) for k in batch[0]}
    budget = mid_budget(tiny_llama().train(), batch, accumulate=accumulate > 1, bf16=bf16, output_alive=False)
    reference = hf_train(tmp_path / "ref", [], accumulate, bf16)
    callback = RematCallback(budget_gb=budget / 2**30)
    trainer = hf_train(tmp_path / "remat", [callback], accumulate, bf16)

    plan = callback.plan
    assert plan.checkpointed and remat.checkpointed_modules(trainer.model) == list(plan.checkpointed)
    assert plan.grads_held is (accumulate > 1) and plan.output_alive is False
    assert plan.checked_peak_bytes <= budget
    # trained exactly as without remat: planning stepped neither the optimizer nor the scheduler
    assert logged(trainer, "loss") == logged(reference, "loss") and len(logged(trainer, "loss")) == 3
    assert logged(trainer, "learning_rate") == logged(reference, "learning_rate")
    for (name, p), q in zip(trainer.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(p, q), name
    entry = [h for h in trainer.state.log_history if "remat/units" in h]
    assert entry and entry[0]["remat/predicted_peak_gb"] == plan.predicted_peak_bytes / 2**30
    assert trainer_step_peak(trainer, accumulate) <= budget
    # the callback's own measurement of the second step (Note [The first step measured])
    assert callback.measured_peak_bytes <= budget
    assert entry[0]["remat/measured_peak_gb"] == callback.measured_peak_bytes / 2**30


def test_hf_trainer_callback_takes_over_gradient_checkpointing_and_applies_a_saved_plan(tmp_path):
    from remat.integrations.transformers import RematCallback

    first = RematCallback(budget_gb=1.0)  # fits: an empty plan
    hf_train(tmp_path / "a", [first], 1, False)
    path = tmp_path / "plan.json"
    plan = first.plan
    saved = type(plan)(**{**plan.__dict__, "checkpointed": ("model.layers.0",), "saved_ops": {}})
    saved.save(path)
    second = RematCallback(plan=str(path))
    trainer = hf_train(tmp_path / "b", [second], 1, False, gradient_checkpointing=True)
    assert remat.checkpointed_modules(trainer.model) == ["model.layers.0"]
    # the model's own checkpointing is off: layers are not checkpointed twice
    assert not any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())


def test_integrations_say_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "remat.integrations.transformers", raising=False)
    with pytest.raises(remat.MissingDependencyError, match=r"pip install 'remat\[hf\]'"):
        importlib.import_module("remat.integrations.transformers")
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    monkeypatch.delitem(sys.modules, "remat.integrations.lightning", raising=False)
    with pytest.raises(remat.MissingDependencyError, match=r"pip install 'remat\[lightning\]'"):
        importlib.import_module("remat.integrations.lightning")


def test_the_callback_line_says_nesting_selective_units_and_the_peaks():
    """Issue (callback's words): "checkpointing 2 units (model, model.layers.6)" read as the whole model plus a
    layer where layers.6 was nested inside model; the line says nesting and selective policies, and the
    predicted and checked peaks."""
    import dataclasses

    from remat.integrations.first_step import FirstStep
    from remat.solve import Planner
    from remat.solve.synthetic import chain_profile

    planner = Planner(chain_profile([30 * 2**20] * 3, [2**20] * 3, [1e-3] * 3, nested_fraction=0.5))
    plan = dataclasses.replace(planner.make_plan(["u0", "u0.sub", "u2"], "ilp"), checked_peak_bytes=40 * 2**20,
                               budget_bytes=50 * 2**20,
                               saved_ops={"u2": ("aten.addmm.default#0", "aten.addmm.default#1")})
    first = FirstStep(budget_gb=0.05)
    first.applied = plan
    line = first.summary()
    assert "u0.sub inside u0" in line and "u2 (selective: keeps addmm x2)" in line, line
    assert "budget 50.0 MiB" in line and "predicted peak" in line and "checked 40.0 MiB" in line


def test_callback_needs_a_budget_or_a_plan():
    from remat.integrations.first_step import FirstStep

    with pytest.raises(remat.InvalidInputError, match="exactly one of budget_gb"):
        FirstStep()
    with pytest.raises(remat.InvalidInputError, match="exactly one of budget_gb"):
        FirstStep(budget_gb=1.0, plan="plan.json")


# -- Lightning ------------------------------------------------------------------------------------------

def lightning_module(L, layers: int = 2):
    from remat.examples import GPT

    class LitGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.gpt = GPT(vocab=VOCAB, seq_len=32, d_model=64, n_layers=layers, n_heads=4, dropout=0.1)

        def training_step(self, batch, batch_idx):
            idx, targets = batch
            loss = self.gpt(idx, targets)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    return LitGPT()


def lightning_batches(n: int = 24, seq: int = 32):
    ids = torch.randint(0, VOCAB, (n, seq + 1), generator=torch.Generator().manual_seed(1))
    return torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])


def lightning_train(L, callbacks, accumulate: int, bf16: bool, logger=False):
    losses, rates = [], []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())
            rates.append(trainer.optimizers[0].param_groups[0]["lr"])

    torch.manual_seed(0)
    module = lightning_module(L)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=accumulate,
                        precision="bf16-mixed" if bf16 else "32-true", callbacks=[*callbacks, Record()],
                        logger=logger, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(lightning_batches(), batch_size=4, shuffle=False))
    return trainer, module, losses, rates


def lightning_step_peak(trainer, module, accumulate: int, bf16: bool) -> int:
    """The peak of one more optimizer step of Lightning's loop by the profiler's allocator-level memory events:
    its closure per micro-batch (``training_step`` under the precision context, then ``zero_grad`` on the
    first micro-batch of the step, then backward outside the context), then the optimizer. The previous
    step's gradients are alive through the first forward: they are made inside the measured window (the
    profiler does not report frees of memory allocated before it started)."""
    optimizer = trainer.optimizers[0]
    batch = next(iter(torch.utils.data.DataLoader(lightning_batches(), batch_size=4)))
    module.log = lambda *a, **k: None
    trainable = [p for p in module.parameters() if p.requires_grad]

    def step():
        for p in trainable:
            p.grad = torch.zeros_like(p)
        for k in range(accumulate):
            with trainer.precision_plugin.forward_context():
                loss = module.training_step(batch, 0)
            if k == 0:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            del loss
        optimizer.step()

    module.zero_grad(set_to_none=True)
    before = state_bytes(module, optimizer, batch)
    return before + profiler_memory_peak(step, CPU)


@pytest.mark.parametrize("accumulate,bf16", LOOPS, ids=LOOP_IDS)
def test_lightning_callback(tmp_path, accumulate, bf16):
    L = pytest.importorskip("lightning.pytorch")
    from remat.integrations.lightning import RematCallback

    module = lightning_module(L)
    batch = next(iter(torch.utils.data.DataLoader(lightning_batches(), batch_size=4)))
    step = lambda b: module.training_step(b, 0)  # noqa: E731
    module.log = lambda *a, **k: None
    probe = type("Step", (nn.Module,), {"forward": lambda self, b: step(b)})()
    probe.m = module
    budget = mid_budget(probe, (batch,), accumulate=accumulate > 1, bf16=bf16, output_alive=True,
                        zero_grad_after_forward=True)

    _, _, ref_losses, ref_rates = lightning_train(L, [], accumulate, bf16)
    callback = RematCallback(budget_gb=budget / 2**30)
    from lightning.pytorch.loggers import CSVLogger

    trainer, trained, losses, rates = lightning_train(L, [callback], accumulate, bf16, logger=CSVLogger(tmp_path))
    plan = callback.plan
    assert plan.checkpointed and remat.checkpointed_modules(trained) == list(plan.checkpointed)
    assert all(n.startswith("gpt.") for n in plan.checkpointed)  # the module's own names
    assert plan.grads_held is (accumulate > 1) and plan.checked_peak_bytes <= budget
    assert losses == ref_losses and len(losses) == 3 * accumulate
    assert rates == ref_rates  # the scheduler stepped as often as without remat
    assert lightning_step_peak(trainer, trained, accumulate, bf16) <= budget
    assert callback.measured_peak_bytes <= budget
    logged_gb = trainer.logged_metrics  # the plan and the measured step through Lightning's logging
    assert logged_gb["remat/predicted_peak_gb"].item() == pytest.approx(plan.predicted_peak_bytes / 2**30)
    assert logged_gb["remat/measured_peak_gb"].item() == pytest.approx(callback.measured_peak_bytes / 2**30)


def test_pytorch_lightning_package_callback():
    """``pytorch_lightning.Trainer`` takes ``PLRematCallback`` (its own Callback class) the same way."""
    PL = pytest.importorskip("pytorch_lightning")
    from remat.integrations.lightning import PLRematCallback

    _, _, ref_losses, _ = lightning_train(PL, [], 1, False)
    callback = PLRematCallback(budget_gb=0.0028)
    trainer, trained, losses, _ = lightning_train(PL, [callback], 1, False)
    assert isinstance(callback, PL.Callback) and callback.plan.checkpointed
    assert remat.checkpointed_modules(trained) == list(callback.plan.checkpointed)
    assert losses == ref_losses and callback.measured_peak_bytes <= callback.plan.budget_bytes


def test_lightning_planning_leaves_no_trace_of_its_training_step_calls():
    """Issue #24.1: remat runs ``training_step`` while it plans; what those calls did to the module (a
    torchmetrics metric updated, a counter, a list of losses, a tensor attribute) is undone, so after ``fit``
    each equals the run without remat."""
    L = pytest.importorskip("lightning.pytorch")
    torchmetrics = pytest.importorskip("torchmetrics")
    from remat.integrations.lightning import RematCallback

    calls = []

    def train(callbacks):
        base = lightning_module(L)

        class Counting(type(base)):
            def __init__(self):
                super().__init__()
                self.mean_loss = torchmetrics.MeanMetric()
                self.steps, self.losses = 0, []
                self.seen = torch.zeros(())

            def training_step(self, batch, batch_idx):
                calls.append(batch_idx)
                loss = super().training_step(batch, batch_idx)
                self.mean_loss.update(loss.detach())
                self.steps += 1
                self.losses.append(round(loss.item(), 6))
                self.seen += batch[0].shape[0]
                return loss

        torch.manual_seed(0)
        module = Counting()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=callbacks, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, torch.utils.data.DataLoader(lightning_batches(), batch_size=4, shuffle=False))
        return module

    plain = train([])
    calls.clear()
    callback = RematCallback(budget_gb=1.0)
    planned = train([callback])
    assert callback.plan is not None and len(calls) > 3  # remat did call training_step while planning
    assert planned.steps == plain.steps == 3
    assert planned.losses == plain.losses
    assert planned.seen.item() == plain.seen.item() == 12
    assert planned.mean_loss.update_count == plain.mean_loss.update_count == 3
    assert planned.mean_loss.compute().item() == plain.mean_loss.compute().item()
    assert f"ran {len(calls) - 3} times" in callback.plan.notes[-1], len(calls)  # how often it ran, said in the plan
    # the same step again on this machine: its times come from the timing cache, the five timed steps do not run
    first = len(calls) - 3
    calls.clear()
    again = RematCallback(budget_gb=1.0)
    train([again])
    assert len(calls) - 3 == first - 5 and f"ran {first - 5} times" in again.plan.notes[-1]
    assert any("timing cache" in n for n in again.plan.notes)
