"""Same model, batch and budget: the same plan? Profiles of the built-in GPT, without and with the timing cache.

    python benchmarks/accuracy/reproducible.py [--runs 3] [--budgets 10]

Profiles the built-in GPT (examples.make_gpt: 4 blocks, dropout, AdamW) --runs times in this process with
remat's timing cache off, then --runs times with it on (a fresh temporary directory: the first profile
measures, the others read it; Note [Timing cache] in remat/profile/cache.py), and plans each profile
(granularity "op", regions and nesting: optimize_checkpointing's defaults) at --budgets budgets evenly
from the least peak to the plain step's. Prints, per setting, at how many budgets every run got the same
plan, the spread of the predicted recompute among the plans one budget got, and the time of each profile.
Run it alone: other work on the machine widens the timing noise this is about.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

import remat
from remat.examples import make_gpt
from remat.solve import Planner


def profiles(runs: int) -> tuple[list, list[float]]:
    out, seconds = [], []
    for _ in range(runs):
        model, batch, _ = make_gpt()
        opt = torch.optim.AdamW(model.parameters())
        t0 = time.perf_counter()
        out.append(remat.make_profile(model, batch, optimizer=opt))
        seconds.append(time.perf_counter() - t0)
    return out, seconds


def agreement(profs: list, n_budgets: int) -> tuple[int, float, list[str]]:
    planners = [Planner(p, granularity="op") for p in profs]
    lo, hi = planners[0].min_peak_bytes, planners[0].baseline_peak_bytes
    same, spread, rows = 0, 0.0, []
    for k in range(n_budgets):
        budget = lo + (hi - lo) * k // (n_budgets - 1)
        plans = [pl.plan_for_budget(budget) for pl in planners]
        ok = len({p.checkpointed for p in plans}) == 1
        same += ok
        # the plans this budget got, each costed in the first profile: how far apart they are
        costs = [planners[0].model.recompute_s(p.checkpointed) for p in plans]
        if not ok:
            spread = max(spread, (max(costs) - min(costs)) / max(min(costs), 1e-12))
            rows.append(f"  {budget / 2**20:.2f} MiB: " + " | ".join(", ".join(p.checkpointed) for p in plans))
    return same, spread, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budgets", type=int, default=10)
    args = ap.parse_args()
    print(f"built-in GPT, {args.runs} profiles per setting, {args.budgets} budgets from the least peak to the plain "
          f"step's; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print()
    print("| timing cache | budgets with one plan in every run | widest recompute gap between plans of one budget "
          "| profile times (s) |")
    print("|---|---:|---:|---|")
    details = []
    for setting in ("off", "on"):
        with tempfile.TemporaryDirectory() as d:
            os.environ["REMAT_CACHE"] = "1" if setting == "on" else "0"
            os.environ["REMAT_CACHE_DIR"] = d
            profs, seconds = profiles(args.runs)
        same, spread, rows = agreement(profs, args.budgets)
        details += [f"cache {setting}, plans that differed:", *rows] if rows else []
        print(f"| {setting} | {same} of {args.budgets} | {spread:.1%} | {', '.join(f'{s:.1f}' for s in seconds)} |")
    if details:
        print()
        print("\n".join(details))


if __name__ == "__main__":
    main()
