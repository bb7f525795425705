"""Does the CPU's memory meter slow the step it checks? A checked step's forward and backward seconds beside the
same plan's step run unmetered, in paired rounds (Note [Plans timed beside the hand rules] in remat.api.hand_rules).

    python benchmarks/accuracy/checked_step_time.py [--layers 12] [--rounds 3] [--out FILE]

On a CPU remat checks a plan's peak with a dispatch-level meter (remat.runtime.tracker); where that step's time is
the step's own, the checked steps of the plan and of a hand rule are a first timed pair for nothing. The plans:
none, every block, every 2nd block, and the ILP's op-level plan at 85% of the plain peak (selective units and
regions under the meter's dispatch mode). Each round runs every plan twice, metered (``measure_checked_peak``,
its ``step_s``) and not (``run_step`` timed), in a shuffled order. Model: benchmarks/scale/gpt2_small.py's GPT
(124M) by default; about 2 x rounds x 4 steps of 6-7 s on the 2-core CPU, plus a profile (30 s). Run it alone.
Writes benchmarks/results/checked-step-time-cpu.md.
"""

from __future__ import annotations

import argparse
import copy
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "scale"))

import remat  # noqa: E402
from remat.api.checking import measure_checked_peak  # noqa: E402
from remat.rewrite import checkpoint_plan, remove_checkpointing  # noqa: E402
from remat.runtime.measure import Clock, default_loss, run_step  # noqa: E402

from gpt2_small import build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/checked-step-time-cpu.md"))
    args = ap.parse_args()
    model, inputs, _ = build(**({} if args.layers is None else {"layers": args.layers}))
    device = torch.device("cpu")
    profile = remat.make_profile(copy.deepcopy(model), inputs, optimizer=torch.optim.AdamW(model.parameters()))
    planner = remat.Planner(profile)
    plans = {"none": None,
             "every block": planner.every_nth_block(1), "every 2nd block": planner.every_nth_block(2),
             "ILP at 85% of the plain peak": planner.plan_for_budget(int(0.85 * planner.baseline_peak_bytes))}
    clock = Clock(device)
    params = list(model.parameters())

    def unmetered() -> float:
        for p in params:
            p.grad = None
        marks = {"start": clock.mark()}
        run_step(model, inputs, {}, default_loss, output_alive=profile.output_alive,
                 on=lambda event: marks.__setitem__(event, clock.mark()))
        return clock.seconds(marks["start"], marks["backward"])

    def metered() -> float:
        step_s: list[float] = []
        measure_checked_peak(model, inputs, {}, default_loss, device, output_alive=profile.output_alive,
                             step_s=step_s)
        return step_s[0]

    times: dict[tuple[str, str], list[float]] = {(n, k): [] for n in plans for k in ("metered", "unmetered")}
    rng = random.Random(0)
    runs = [(n, k) for n in plans for k in ("metered", "unmetered")]
    for r in range(args.rounds + 1):  # the first round warms every configuration up: not kept
        rng.shuffle(runs)
        for name, kind in runs:
            remove_checkpointing(model)
            if plans[name] is not None:
                checkpoint_plan(model, plans[name])
            s = metered() if kind == "metered" else unmetered()
            if r:
                times[(name, kind)].append(s)
            print(f"round {r} {name} {kind}: {s:.3f} s", flush=True)
    remove_checkpointing(model)
    lines = [f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {platform.machine()}, "
             f"{torch.get_num_threads()} threads; `python benchmarks/accuracy/checked_step_time.py"
             f"{'' if args.layers is None else f' --layers {args.layers}'}`; measured (forward and backward of one "
             f"step, {args.rounds} shuffled rounds after a warm-up round)", "",
             "| plan | units | metered s (median) | unmetered s (median) | metered / unmetered, paired: median "
             "[min, max] |", "|---|---:|---:|---:|---:|"]
    for name, plan in plans.items():
        m, u = times[(name, "metered")], times[(name, "unmetered")]
        ratios = [a / b for a, b in zip(m, u)]
        lines.append(f"| {name} | {0 if plan is None else len(plan.checkpointed)} | {statistics.median(m):.3f} | "
                     f"{statistics.median(u):.3f} | {statistics.median(ratios):.3f} [{min(ratios):.3f}, "
                     f"{max(ratios):.3f}] |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t0:.0f} s")
