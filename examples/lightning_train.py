"""Train the built-in GPT with Lightning under a memory budget chosen by remat (CPU).

    python examples/lightning_train.py [--budget-gb G] [--steps 6] [--accumulate 1] [--bf16]

One line adds remat: ``lightning.Trainer(..., callbacks=[RematCallback(budget_gb=...)])``. The callback
plans in ``on_train_batch_start`` of the first batch: your ``training_step`` on that batch, under the
Trainer's precision context, with its optimizer and gradient accumulation and Lightning's zero_grad between
forward and backward; it applies the plan before the first step and measures the second. Without
--budget-gb the budget is set halfway between the least peak and the no-checkpointing peak of this loop
(found by profiling once). Prints budget, predicted, checked and measured peak.
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as L
import torch
from torch import nn

import remat
from remat.examples import GPT
from remat.integrations.lightning import RematCallback
from remat.solve.plan import fmt_bytes

SEQ, VOCAB = 128, 1024


class LitGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(vocab=VOCAB, seq_len=SEQ, d_model=128, n_layers=4, n_heads=4, dropout=0.1)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        loss = self.gpt(idx, targets)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def loader(batch_size: int, n: int = 96):
    ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]),
                                       batch_size=batch_size)


class _Step(nn.Module):
    """The training step as remat profiles it (for the default budget only)."""

    def __init__(self, module: LitGPT) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch):
        return self.module.training_step(batch, 0)


def default_budget(batch_size: int, accumulate: bool, bf16: bool) -> float:
    module = LitGPT()
    module.log = lambda *a, **k: None
    batch = next(iter(loader(batch_size)))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        profile = remat.make_profile(_Step(module), (batch,), optimizer=torch.optim.AdamW(module.parameters()),
                                     grad_accumulation=accumulate, zero_grad_after_forward=True)
    planner = remat.Planner(profile)
    return (planner.min_peak_bytes + planner.baseline_peak_bytes) / 2 / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gb", type=float, default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    budget_gb = args.budget_gb or default_budget(args.batch_size, args.accumulate > 1, args.bf16)
    callback = RematCallback(budget_gb=budget_gb)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, accumulate_grad_batches=args.accumulate,
                        precision="bf16-mixed" if args.bf16 else "32-true", callbacks=[callback], logger=False,
                        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(LitGPT(), loader(args.batch_size))
    plan = callback.plan
    print(f"\nLightning {L.__version__}, GPT 4 x 128, batch {args.batch_size} x {SEQ} tokens, AdamW, "
          f"accumulation {args.accumulate}, {'bf16-mixed' if args.bf16 else '32-true'}, torch {torch.__version__}")
    print(f"  checkpointed ({len(plan.checkpointed)}): {', '.join(plan.checkpointed)}")
    print(f"  budget            {fmt_bytes(budget_gb * 2**30)}" + (
        f" ({fmt_bytes(callback.reserved_bytes)} of it set aside for DDP's gradient buckets)"
        if callback.reserved_bytes else ""))
    print(f"  no checkpointing  {fmt_bytes(plan.baseline_peak_bytes)} (predicted)")
    print(f"  predicted peak    {fmt_bytes(plan.predicted_peak_bytes)}")
    print(f"  checked peak      {fmt_bytes(plan.checked_peak_bytes)} (one real step while planning)")
    print(f"  measured peak     {fmt_bytes(callback.measured_peak_bytes)} (Lightning's second step)")
    print(f"  wall time         {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
