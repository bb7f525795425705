"""Does a forward that keeps its activations run slower than one that checkpoints them, on a CPU? Each plan's forward
and backward measured beside what remat predicts for it, in shuffled rounds.

    python benchmarks/accuracy/kept_forward.py [--rounds 3] [--out FILE]

remat times the model's steps with every top-level unit checkpointed (so profiling's peak stays near the
least-memory plan's: Note [Long steps are timed twice] in remat.profile.timing), and on a CPU predicts every plan's
forward as that step's forward. A checkpointed unit's forward frees each activation as soon as the next operator has
read it, so the allocator hands the same warm memory back; a unit that is not checkpointed keeps them, and each new
one is memory the step has not touched yet (page faults, cache misses). The plans: none, every 2nd block, the ILP's at
85% of the plain peak, every block. Each round runs every plan once (not metered, ``run_step`` timed), the order
shuffled with a fixed seed; a warm-up round first is not kept. The page faults are the process's minor faults in the
forward. Model: benchmarks/scale/gpt2_small.py's GPT (124M, 4 x 256); about 30 s of profile (or remat's timing cache)
and 4 x (rounds + 1) steps of 5-7 s on the 2-core CPU. A second table asks whether the cost is a figure per byte kept
that a device could be calibrated for: a chain of matmul and GELU at two widths, every output kept or each freed, in
alternating order. Run it alone. Writes benchmarks/results/kept-forward-cpu.md.
"""

from __future__ import annotations

import argparse
import copy
import platform
import random
import resource
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "scale"))

import remat  # noqa: E402
from remat.rewrite import checkpoint_plan, remove_checkpointing  # noqa: E402
from remat.runtime.measure import Clock, default_loss, run_step  # noqa: E402

from gpt2_small import build  # noqa: E402


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def chain_rows(reps: int = 6) -> list[str]:
    """The toy chain's table: kept against freed, per MiB kept."""
    rows = ["", "A toy chain, n times ``x = gelu(x @ w)`` on 1024 rows, every output kept or each freed (medians of "
            f"{reps}, alternating order):", "", "| width | n | MiB kept | kept ms | freed ms | kept / freed | "
            "ms per MiB kept |", "|---:|---:|---:|---:|---:|---:|---:|"]
    gen = torch.Generator().manual_seed(0)
    for width, n in ((768, 48), (3072, 24)):
        x, w = torch.randn(1024, width, generator=gen), torch.randn(width, width, generator=gen) / width ** 0.5
        seconds: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(reps):
            for keep in (True, False) if rep % 2 == 0 else (False, True):
                t0 = time.perf_counter()
                y, kept = x, []
                for _ in range(n):
                    y = torch.nn.functional.gelu(y @ w)
                    if keep:
                        kept.append(y)
                seconds[keep].append(time.perf_counter() - t0)
                del kept, y
        mib = n * 1024 * width * 4 / 2**20  # each GELU output (the matmul's is freed either way)
        k, f = statistics.median(seconds[True]), statistics.median(seconds[False])
        rows.append(f"| {width} | {n} | {mib:.0f} | {1e3 * k:.1f} | {1e3 * f:.1f} | {k / f:.3f} | "
                    f"{1e3 * (k - f) / mib:.3f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/kept-forward-cpu.md"))
    args = ap.parse_args()
    model, inputs, _ = build()
    device = torch.device("cpu")
    profile = remat.make_profile(copy.deepcopy(model), inputs, optimizer=torch.optim.AdamW(model.parameters()))
    planner = remat.Planner(profile)
    plans = {"none": None, "every 2nd block": planner.every_nth_block(2),
             "ILP at 85% of the plain peak": planner.plan_for_budget(int(0.85 * planner.baseline_peak_bytes)),
             "every block": planner.every_nth_block(1)}
    clock = Clock(device)
    params = list(model.parameters())
    measured: dict[str, list[tuple[float, float, int]]] = {n: [] for n in plans}
    rng = random.Random(0)
    order = list(plans)
    for r in range(args.rounds + 1):  # the first round warms every plan up: not kept
        rng.shuffle(order)
        for name in order:
            remove_checkpointing(model)
            if plans[name] is not None:
                checkpoint_plan(model, plans[name])
            for p in params:
                p.grad = None
            marks = {"start": clock.mark()}
            faults = [_faults()]
            run_step(model, inputs, {}, default_loss, output_alive=profile.output_alive,
                     on=lambda event: (marks.__setitem__(event, clock.mark()),
                                       faults.append(_faults()) if event == "loss" else None))
            row = (clock.seconds(marks["start"], marks["loss"]), clock.seconds(marks["loss"], marks["backward"]),
                   faults[1] - faults[0])
            if r:
                measured[name].append(row)
            print(f"round {r} {name}: forward {row[0]:.3f} s, backward {row[1]:.3f} s, {row[2]:,} faults", flush=True)
    remove_checkpointing(model)
    lines = [f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {platform.machine()}, "
             f"{torch.get_num_threads()} threads; `python benchmarks/accuracy/kept_forward.py --rounds {args.rounds}`; "
             f"measured, but the columns marked predicted ({args.rounds} shuffled rounds after a warm-up round)", "",
             "GPT-2 small (benchmarks/scale/gpt2_small.py). Predicted forward, every plan: "
             f"{profile.forward_s:.3f} s (the profile's, timed with every top-level unit checkpointed).", "",
             "| plan | units checkpointed | predicted activations kept GiB | forward s (median) | measured / predicted "
             "forward: median [min, max] | forward page faults (median) | backward s predicted | backward s "
             "(median) | measured / predicted backward | forward and backward: measured / predicted (median) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, plan in plans.items():
        f, b, faults = zip(*measured[name])
        ratios = [x / profile.forward_s for x in f]
        if plan is None:
            backward_p = profile.backward_s
            peak = planner.baseline_peak_bytes
        else:
            backward_p = plan.predicted_step_time_s - profile.forward_s - profile.optimizer_s
            peak = plan.predicted_peak_bytes
        kept = (peak - planner.every_nth_block(1).predicted_peak_bytes) / 2**30
        lines.append(f"| {name} | {0 if plan is None else len(plan.checkpointed)} | {kept:+.3f} (peak less every "
                     f"block's) | {statistics.median(f):.3f} | {statistics.median(ratios):.3f} [{min(ratios):.3f}, "
                     f"{max(ratios):.3f}] | {statistics.median(faults):,.0f} | {backward_p:.3f} | "
                     f"{statistics.median(b):.3f} | {statistics.median(b) / backward_p:.3f} | "
                     f"{statistics.median(x + y for x, y in zip(f, b)) / (profile.forward_s + backward_p):.3f} |")
    lines += chain_rows()
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
