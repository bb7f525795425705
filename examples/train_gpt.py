"""Train a small GPT-style decoder under a memory budget chosen by remat.

    python examples/train_gpt.py [--budget-gb 0.02] [--steps 5] [--layers 6]

Without --budget-gb the budget is set halfway between the least achievable peak and the
no-checkpointing peak, so the example always has something to decide.
"""

from __future__ import annotations

import argparse
import time

import torch

import remat
from remat.examples import make_gpt
from remat.solve.plan import fmt_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gb", type=float, default=None, help="GiB of peak memory for one training step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    model, (idx, targets), _ = make_gpt(layers=args.layers, batch_size=args.batch_size, seq_len=args.seq_len,
                                        device=args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    budget_gb = args.budget_gb
    if budget_gb is None:
        # Ask for the impossible once to learn the least achievable peak, then aim halfway up.
        try:
            remat.optimize_checkpointing(model, 1e-9, (idx, targets), optimizer=optimizer)
        except remat.InfeasibleBudgetError as e:
            plain = remat.measure_step(model, (idx, targets), optimizer_factory=torch.optim.AdamW).peak_bytes
            budget_gb = (e.min_feasible_bytes + plain) / 2 / 2**30
    plan = remat.optimize_checkpointing(model, budget_gb, (idx, targets), optimizer=optimizer)
    print(plan)

    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}  {1e3 * (time.perf_counter() - t0):.1f} ms")

    measured = remat.measure_step(model, (idx, targets), optimizer_factory=lambda p: torch.optim.AdamW(p, lr=3e-4))
    print(f"measured peak {fmt_bytes(measured.peak_bytes)} ({measured.method}); "
          f"predicted {fmt_bytes(plan.predicted_peak_bytes)}; budget {fmt_bytes(plan.budget_bytes)}")
    print(remat.check_equivalence(model, (idx, targets)))


if __name__ == "__main__":
    main()
