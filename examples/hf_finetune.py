"""Fine-tune a small Hugging Face Llama under a memory budget chosen by remat (offline, random weights).

    python examples/hf_finetune.py [--budget-gb G] [--steps 5]

Builds LlamaForCausalLM from a config (grouped-query attention, attention dropout), lets remat
checkpoint it in place for the budget, trains a few steps with the same optimizer, and prints the
plan, the measured peak of a step and the equivalence check. Without --budget-gb the budget is
set a third of the way from the least achievable peak to the no-checkpointing peak.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import remat
from remat.solve.plan import fmt_bytes


def build(seq_len: int = 128, batch_size: int = 8):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attention_dropout=0.1, max_position_embeddings=seq_len, bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gb", type=float, default=None)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    model, batch = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    budget_gb = args.budget_gb
    if budget_gb is None:
        plain = remat.measure_step(model, batch, optimizer_factory=torch.optim.AdamW, repeats=1).peak_bytes
        try:
            remat.optimize_checkpointing(model, 1e-9, batch, optimizer=optimizer)
        except remat.InfeasibleBudgetError as e:
            budget_gb = (e.min_feasible_bytes + (plain - e.min_feasible_bytes) / 3) / 2**30
    plan = remat.optimize_checkpointing(model, budget_gb, batch, optimizer=optimizer)
    print(plan)

    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}  {1e3 * (time.perf_counter() - t0):.0f} ms")

    measured = remat.measure_step(model, batch, optimizer_factory=lambda p: torch.optim.AdamW(p, lr=1e-4))
    print(f"measured peak {fmt_bytes(measured.peak_bytes)} ({measured.method}); predicted "
          f"{fmt_bytes(plan.predicted_peak_bytes)}; budget {fmt_bytes(plan.budget_bytes)}")
    print(remat.check_equivalence(model, batch))


if __name__ == "__main__":
    main()
