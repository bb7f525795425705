"""Train a small Llama with the Hugging Face Trainer under a memory budget chosen by remat (CPU, offline).

    python examples/hf_trainer.py [--budget-gb G] [--steps 6] [--accumulate 1] [--bf16]

One line adds remat: ``Trainer(..., callbacks=[RematCallback(budget_gb=...)])``. The callback plans on the
Trainer's first training batch (its optimizer, its loss, bf16 autocast and gradient accumulation as the
Trainer runs them), applies the plan before the first step and measures the second step. Without
--budget-gb the budget is set halfway between the least peak remat reaches and the no-checkpointing peak
of this loop (found by profiling once). Prints budget, predicted, checked and measured peak.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import transformers

import remat
from remat.integrations.transformers import RematCallback
from remat.solve.plan import fmt_bytes


def build_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=0.1, max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


def dataset(n: int = 96, seq_len: int = 128):
    ids = torch.randint(0, 1024, (n, seq_len), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def default_budget(batch_size: int, accumulate: bool, bf16: bool) -> float:
    model = build_model().train()
    rows = dataset()[:batch_size]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        profile = remat.make_profile(model, batch, optimizer=torch.optim.AdamW(model.parameters()),
                                     output_alive=False, grad_accumulation=accumulate)
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
    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(
            output_dir=out, use_cpu=True, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.accumulate, bf16=args.bf16, logging_steps=1, report_to=[],
            save_strategy="no", seed=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=build_model(), args=targs, train_dataset=dataset(),
                                       callbacks=[callback])
        trainer.train()
    plan = callback.plan
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    print(f"\nHugging Face Trainer, Llama 4 x 128, batch {args.batch_size} x 128 tokens, AdamW, "
          f"accumulation {args.accumulate}, {'bf16' if args.bf16 else 'fp32'}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"  checkpointed ({len(plan.checkpointed)}): {', '.join(plan.checkpointed)}")
    print(f"  budget            {fmt_bytes(budget_gb * 2**30)}" + (
        f" ({fmt_bytes(callback.reserved_bytes)} of it set aside for DDP's gradient buckets)"
        if callback.reserved_bytes else ""))
    print(f"  no checkpointing  {fmt_bytes(plan.baseline_peak_bytes)} (predicted)")
    print(f"  predicted peak    {fmt_bytes(plan.predicted_peak_bytes)}")
    print(f"  checked peak      {fmt_bytes(plan.checked_peak_bytes)} (one real step while planning)")
    print(f"  measured peak     {fmt_bytes(callback.measured_peak_bytes)} (the Trainer's second step)")
    print(f"  losses            {losses}")
    print(f"  wall time         {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
