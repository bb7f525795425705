"""Solve time of remat's ILP on synthetic chain models of growing size (run by hand).

    python benchmarks/solve_scaling.py [--sizes 12,48,200,500] [--nested]

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

import remat.solve.ilp as ilp
from remat.simulate import MemoryModel
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
    """Solve time on a real profile (identical blocks: the symmetric case), exact and within 1%."""
    import torch

    import remat
    from remat import make_profile
    from remat.examples import make_gpt

    model, inputs, _ = make_gpt(layers=layers)
    profile = make_profile(model, inputs, loss_fn=remat.default_loss,
                           optimizer=torch.optim.AdamW(model.parameters()))
    planner = Planner(profile)
    lo, hi = planner.min_peak_bytes, planner.baseline_peak_bytes
    print(f"# built-in GPT, {layers} blocks: {len(planner.model.units)} units, {len(planner.model.rows)} rows")
    print("| budget (fraction of range) | exact (s) | exact recompute (ms) | within 1% (s) | its recompute (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for f in (0.25, 0.5):
        b = int(lo + f * (hi - lo))
        saved = ilp.EXACT_UNITS
        ilp.EXACT_UNITS = 1 << 30
        try:
            exact, _, t_exact = ilp.solve_ilp(planner.model, b)
        finally:
            ilp.EXACT_UNITS = saved
        gap, _, t_gap = ilp.solve_ilp(planner.model, b)
        print(f"| {f} | {t_exact:.2f} | {planner.model.recompute_s(exact) * 1e3:.2f} | {t_gap:.2f} | "
              f"{planner.model.recompute_s(gap) * 1e3:.2f} |")
    print()


if __name__ == "__main__":
    main()
