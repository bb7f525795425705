"""Does the CPU's memory meter slow the step it checks? A checked step's forward and backward seconds beside the
same plan's step run unmetered, in paired rounds (Note [Plans timed beside the hand rules] in remat.api.hand_rules).

    python benchmarks/accuracy/checked_step_time.py [--layers 12] [--rounds 3] [--out FILE]

On a CPU remat checks a plan's peak with a dispatch-level meter (remat.runtime.tracker); where that step's time is
the step's own, the checked steps of the plan and of a hand rule are a first timed pair for nothing. The plans:
none, every block, every 2nd block, and the ILP's op-level plans at 85% of the plain peak and at every block's
peak x 1.01 (selective units and regions under the meter's dispatch mode). Each round runs every plan twice, metered
(``measure_checked_peak``, its ``step_s``) and not (``run_step`` timed), in a shuffled order; a second table puts
the gap of each pair planning compares (a hand rule less the ILP's plan at that budget) metered beside unmetered, the
same round's; each metered step's meter bookkeeping is timed (its dispatch mode's handler less the operators it
runs). Model: benchmarks/scale/gpt2_small.py's GPT (124M) by default; about 2 x rounds x 5 steps of 6-7 s on
the 2-core CPU, plus a profile (30 s). Run it alone. Writes benchmarks/results/checked-step-time-cpu.md.
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
from remat.runtime import tracker  # noqa: E402
from remat.runtime.measure import Clock, default_loss, run_step  # noqa: E402

from gpt2_small import build  # noqa: E402


class MeterBookkeeping:
    """While entered, the seconds the CPU meter's dispatch mode (remat.runtime.tracker.StorageTracker) spends on each
    operator beyond running it (its bookkeeping: the storages it follows, the peak): the mode's handler timed, less
    the operator it runs (``settled_collective``, through which an unclocked tracker runs every operator)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> "MeterBookkeeping":
        self._handler, self._run = tracker.StorageTracker.__torch_dispatch__, tracker.settled_collective
        handler, run = self._handler, self._run

        def timed_handler(mode, func, types, args=(), kwargs=None):
            t0 = time.perf_counter()
            try:
                return handler(mode, func, types, args, kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        def timed_run(func, args, kwargs):
            t0 = time.perf_counter()
            try:
                return run(func, args, kwargs)
            finally:
                self.seconds -= time.perf_counter() - t0

        tracker.StorageTracker.__torch_dispatch__, tracker.settled_collective = timed_handler, timed_run
        return self

    def __exit__(self, *exc) -> None:
        tracker.StorageTracker.__torch_dispatch__, tracker.settled_collective = self._handler, self._run


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
             "ILP at 85% of the plain peak": planner.plan_for_budget(int(0.85 * planner.baseline_peak_bytes)),
             "ILP at every block x 1.01": planner.plan_for_budget(int(1.01 * planner.every_nth_block(1)
                                                                      .predicted_peak_bytes))}
    clock = Clock(device)
    params = list(model.parameters())

    def unmetered() -> float:
        for p in params:
            p.grad = None
        marks = {"start": clock.mark()}
        run_step(model, inputs, {}, default_loss, output_alive=profile.output_alive,
                 on=lambda event: marks.__setitem__(event, clock.mark()))
        return clock.seconds(marks["start"], marks["backward"])

    bookkeeping: dict[str, list[float]] = {n: [] for n in plans}

    def metered(name: str) -> float:
        step_s: list[float] = []
        with MeterBookkeeping() as book:
            measure_checked_peak(model, inputs, {}, default_loss, device, output_alive=profile.output_alive,
                                 step_s=step_s)
        bookkeeping[name].append(book.seconds)
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
            s = metered(name) if kind == "metered" else unmetered()
            if r:
                times[(name, kind)].append(s)
            elif kind == "metered":
                bookkeeping[name].clear()
            print(f"round {r} {name} {kind}: {s:.3f} s", flush=True)
    remove_checkpointing(model)
    lines = [f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {platform.machine()}, "
             f"{torch.get_num_threads()} threads; `python benchmarks/accuracy/checked_step_time.py"
             f"{'' if args.layers is None else f' --layers {args.layers}'}`; measured (forward and backward of one "
             f"step, {args.rounds} shuffled rounds after a warm-up round)", "",
             "| plan | units | metered s (median) | unmetered s (median) | metered / unmetered, paired: median "
             "[min, max] | the meter's bookkeeping s: median [min, max] |", "|---|---:|---:|---:|---:|---:|"]
    for name, plan in plans.items():
        m, u = times[(name, "metered")], times[(name, "unmetered")]
        ratios = [a / b for a, b in zip(m, u)]
        lines.append(f"| {name} | {0 if plan is None else len(plan.checkpointed)} | {statistics.median(m):.3f} | "
                     f"{statistics.median(u):.3f} | {statistics.median(ratios):.3f} [{min(ratios):.3f}, "
                     f"{max(ratios):.3f}] | {statistics.median(bookkeeping[name]):.3f} [{min(bookkeeping[name]):.3f}, "
                     f"{max(bookkeeping[name]):.3f}] |")
    lines += ["", "The pairs planning compares (a hand rule less an ILP plan, forward and backward, in the same round): "
              "the metered pair (both checked steps) beside the unmetered one, ms", "",
              "| pair | predicted | metered: median [min, max] | unmetered: median [min, max] | metered less unmetered, "
              "per round: median [min, max] |", "|---|---:|---:|---:|---:|"]
    for rule, ours in (("every 2nd block", "ILP at 85% of the plain peak"), ("every block", "ILP at every block x 1.01")):
        gaps = {k: [1e3 * (a - b) for a, b in zip(times[(rule, k)], times[(ours, k)])] for k in ("metered", "unmetered")}
        skew = [m - u for m, u in zip(gaps["metered"], gaps["unmetered"])]
        predicted = 1e3 * (plans[rule].predicted_step_time_s - plans[ours].predicted_step_time_s)
        lines.append(f"| {rule} less {ours} | {predicted:,.0f} | " + " | ".join(
            f"{statistics.median(g):+,.0f} [{min(g):+,.0f}, {max(g):+,.0f}]" for g in (*gaps.values(), skew)) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"{time.perf_counter() - t0:.0f} s")
