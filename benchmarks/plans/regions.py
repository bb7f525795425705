"""What a transformer block's regions buy (issue #24.3; Note [Regions] in remat.capture), run by hand.

    python benchmarks/plans/regions.py [--layers 4,12] [--out benchmarks/results/regions-cpu.md]

Profiles the built-in GPT (AdamW) once per size, then plans at budgets between the least peak without the
blocks' regions and no checkpointing, with the regions (``h.3[ln_1:ln_2]``: layer norm, attention and the
residual add; ``h.3[ln_2:]``: the MLP half) among the candidates and without them, from the same profile.
Prints the predicted recompute per step (the ILP's objective, measured operator times) and the solve time of
each; the least peaks with and without. Recompute is predicted, not measured: the step-time differences are
a few percent of a step on CPU, within its noise here; see benchmarks/plans/nested.py for measured peaks.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch

import remat
from remat import Planner, make_profile
from remat.examples import make_gpt

FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7)


def table(layer_counts: list[int]):
    """The lines of the table, one by one (each size profiled as it comes)."""
    yield (f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
           f"{torch.get_num_threads()} threads; torch {torch.__version__}, remat {remat.__version__}; "
           "`python benchmarks/plans/regions.py`")
    yield ""
    yield ("Predicted recompute per step (ms), with the blocks' regions / without, at budgets a fraction of the way "
           "from the least peak without regions to no checkpointing; solve seconds in brackets.")
    yield ""
    yield "| model | granularity | least peak with / without (bytes) | " + " | ".join(f"budget {f}" for f in FRACTIONS) + " |"
    yield "|---|---|---:|" + "---:|" * len(FRACTIONS)
    for layers in layer_counts:
        model, inputs, _ = make_gpt(layers=layers)
        profile = make_profile(model, inputs, optimizer=torch.optim.AdamW(model.parameters()))
        without = dataclasses.replace(profile, units=tuple(
            u for u in profile.units if not (u.is_region and u.parent is not None and u.parent.startswith("h."))))
        for granularity in ("block", "op"):
            a, b = Planner(profile, granularity=granularity), Planner(without, granularity=granularity)
            lo, hi = b.min_peak_bytes, b.baseline_peak_bytes
            cells = []
            for f in FRACTIONS:
                budget = int(lo + f * (hi - lo))
                pa, pb = a.plan_for_budget(budget), b.plan_for_budget(budget)
                cells.append(f"{pa.predicted_recompute_s * 1e3:.2f} / {pb.predicted_recompute_s * 1e3:.2f} "
                             f"({pa.solve_time_s:.2f} / {pb.solve_time_s:.2f} s)")
            yield (f"| built-in GPT, {layers} blocks | {granularity} | {a.min_peak_bytes:,} / {b.min_peak_bytes:,} | "
                   + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="4,12")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lines = []
    for line in table([int(x) for x in args.layers.split(",")]):
        print(line, flush=True)
        lines.append(line)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
