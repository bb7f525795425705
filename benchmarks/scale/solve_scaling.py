"""Solve time of remat's ILP on synthetic chain models of growing size (run by hand).

    python benchmarks/scale/solve_scaling.py [--sizes 12,48,200,500] [--nested]

Each size is a number of candidate units: a random chain (remat.solve.synthetic) of blocks that
each hold a nested sub-unit (2 candidates per block, like a transformer block and its MLP),
or, with --flat, one candidate per block. Prints the time
to build the memory model, to find the least achievable peak, and to solve at a budget
halfway between that and the no-checkpointing peak. Targets (issue 2): <= 1 s at 48 units,
<= 10 s at 500.
"""

from __future__ import annotations

import argparse
import platform
import time

import pulp

from remat.costs.simulate import MemoryModel
from remat.solve import Planner
from remat.solve.synthetic import random_chain_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="12,48,200,500", help="numbers of candidate units, comma-separated")
    ap.add_argument("--flat", action="store_true", help="no nested sub-units (one candidate per block)")
    ap.add_argument("--gpt", type=int, default=0, metavar="LAYERS",
                    help="also profile the built-in GPT with this many blocks and time exact vs within-1%% solves")
    args = ap.parse_args()
    if args.gpt:
        gpt_solves(args.gpt)
    print(f"# ILP solve time (PuLP {pulp.__version__}, CBC; {platform.processor() or platform.machine()})")
    print("| units | rows | build memory model (s) | least peak (s) | solve at mid budget (s) | status |")
    print("|---:|---:|---:|---:|---:|---|")
    for n in (int(s) for s in args.sizes.split(",")):
        blocks = n if args.flat else max(1, n // 2)
        profile = random_chain_profile(blocks, seed=n, nested=not args.flat)
        t0 = time.perf_counter()
        model = MemoryModel(profile)
        t_build = time.perf_counter() - t0
        planner = Planner(profile)
        budget = (planner.min_peak_bytes + planner.baseline_peak_bytes) // 2
        plan = planner.plan_for_budget(budget)
        print(f"| {len(model.units)} | {len(model.rows)} | {t_build:.2f} | {planner.min_peak_solve_s:.2f} | "
              f"{plan.solve_time_s:.2f} | {plan.solver_status} |")


def gpt_solves(layers: int) -> None:
    """Solve times on a real profile (identical blocks: the symmetric case) with nesting (the default), block
    and op granularity: the least peak, then a plan per budget (Note [Warm start] in remat.solve.ilp)."""
    import torch

    import remat
    from remat import make_profile
    from remat.examples import make_gpt

    model, inputs, _ = make_gpt(layers=layers)
    profile = make_profile(model, inputs, loss_fn=remat.default_loss,
                           optimizer=torch.optim.AdamW(model.parameters()))
    fractions = (0.1, 0.3, 0.4, 0.5, 0.6, 0.9)
    print(f"# built-in GPT, {layers} blocks, nested and (op) selective options; seconds per plan_for_budget")
    print("| granularity | variables | rows | least peak (s) | " + " | ".join(f"budget {f}" for f in fractions)
          + " | nested units in plans | searches stopped (Note [Warm start]) |")
    print("|---|---:|---:|---:|" + "---:|" * len(fractions) + "---:|---:|")
    for granularity in ("block", "op"):
        planner = Planner(profile, granularity=granularity)
        lo, hi = planner.min_peak_bytes, planner.baseline_peak_bytes
        plans = [planner.plan_for_budget(int(lo + f * (hi - lo))) for f in fractions]
        print(f"| {granularity} | {len(planner.model.variables)} | {len(planner.model.rows)} | "
              f"{planner.min_peak_solve_s:.2f} | " + " | ".join(f"{p.solve_time_s:.2f}" for p in plans)
              + f" | {sum(len(p.nested_in) for p in plans)} | "
              f"{sum(p.solver_status.startswith('at least') for p in plans)} of {len(plans)} |")
    print()


if __name__ == "__main__":
    main()
