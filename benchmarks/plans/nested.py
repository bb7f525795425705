"""Nested plans and max batch, measured side by side in one run (run by hand; issue 15).

    python benchmarks/plans/nested.py [--out-dir benchmarks/results] [--budget-mib 40]

1. Least achievable peak: on the built-in GPT decoder (4 and 6 blocks, tied head) and U-Net and on Hugging Face GPT-2 and Llama
   (tests/integration/real_models.py configs), profile once (AdamW, output kept until the step ends), then
   measure real training steps (AdamW step included; live tensor storages) of "checkpoint every block",
   remat's least-memory plan of module units alone (no regions of a module's forward), without nesting, and
   with nesting (the default), each checked exact against the
   plain model (gradients, loss, buffers; dropout on).
2. Max batch: on the built-in GPT at a fixed budget, ``remat.max_batch`` with remat's plans, with "every
   block" and with no checkpointing; every answer confirmed by a measured step, the next size refused, and
   the fastest batch by measured samples per second.

Writes least-peak-cpu.md and max-batch-cpu.md (the tables printed) to --out-dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "integration"))

import remat  # noqa: E402
from remat import Planner, make_profile  # noqa: E402
from remat.api import prepare_hf_for_training  # noqa: E402
from remat.examples import make_gpt, make_unet  # noqa: E402

MiB = 2**20


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def models():
    import real_models

    return {"GPT decoder (built-in, 4 blocks)": make_gpt, "GPT decoder (built-in, 6 blocks)": lambda: make_gpt(layers=6),
            "U-Net (built-in)": make_unet,
            "HF GPT-2 (2 blocks)": real_models.gpt2, "HF Llama (2 blocks, GQA)": real_models.llama}


def measured(factory, plan) -> tuple[int, bool]:
    """Peak of one real step (AdamW included) with ``plan``, and whether it is exact against the plain model."""
    model, inputs, loss_fn = factory()
    loss_fn = loss_fn or remat.default_loss
    prepare_hf_for_training(model)
    remat.apply_plan(model, plan)
    peak = remat.measure_step(model, inputs, loss_fn=loss_fn, optimizer_factory=adamw, repeats=0).peak_bytes
    return peak, remat.check_equivalence(model, inputs, loss_fn=loss_fn).equal


def least_peaks(say) -> None:
    say("| model | every block | remat least, modules only (no regions) | remat least, flat | remat least, nested "
        "| nested / every block | regions in the plan | nested units | predicted vs measured | exact |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, factory in models().items():
        model, inputs, loss_fn = factory()
        profile = make_profile(model, inputs, loss_fn=loss_fn or remat.default_loss,
                               optimizer=adamw(model.parameters()))
        nested, flat = Planner(profile, granularity="op"), Planner(profile, granularity="op", nesting=False)
        # Note [Regions] in remat.capture: what regions add (a transformer block's attention and MLP halves)
        modules = Planner(dataclasses.replace(profile, units=tuple(u for u in profile.units if not u.is_region)),
                          granularity="op")
        plans = {"every": nested.every_nth_block(1), "modules": modules.least_memory(), "flat": flat.least_memory(),
                 "nested": nested.least_memory()}
        peaks = {k: measured(factory, p) for k, p in plans.items()}
        n = plans["nested"]
        err = n.predicted_peak_bytes / peaks["nested"][0] - 1
        say(f"| {name} | {peaks['every'][0] / MiB:.2f} MiB | {peaks['modules'][0] / MiB:.2f} MiB | "
            f"{peaks['flat'][0] / MiB:.2f} MiB | {peaks['nested'][0] / MiB:.2f} MiB | "
            f"{peaks['nested'][0] / peaks['every'][0]:.3f} | {sum('[' in u for u in n.checkpointed)} | "
            f"{len(n.nested_in)} of {len(n.checkpointed)} | {err:+.2%} | "
            f"{'yes' if all(ok for _, ok in peaks.values()) else 'NO'} |")


def max_batches(say, budget_mib: float) -> None:
    model, _, _ = make_gpt()
    reports = [remat.max_batch(model, budget_mib / 1024, lambda n: make_gpt(batch_size=n)[1],
                               optimizer=adamw(model.parameters()), strategy=s, repeats=5)
               for s in ("ilp", "every_block", "none")]
    say(f"Budget {budget_mib:g} MiB, built-in GPT (4 blocks, seq 64, d 128), AdamW; samples/s: median of 5 real "
        "steps (forward and backward; the optimizer step as profiled).")
    say()
    say("| plans | largest batch | its measured peak | next batch: least peak (measured) | samples/s at the largest "
        "| fastest batch | its samples/s | largest vs every block | largest vs none |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    every, none = reports[1].max_size, reports[2].max_size
    for rep in reports:
        top, refused, best = rep.row(rep.max_size), rep.rows[-1], rep.row(rep.best_size)
        label = {"ilp": "remat (nested ILP)", "every_block": "every block", "none": "no checkpointing"}[rep.strategy]
        say(f"| {label} | {rep.max_size} | {top.measured_peak_bytes / MiB:.2f} MiB | {refused.size}: "
            f"{refused.least_peak_bytes / MiB:.2f} MiB | {top.measured_samples_per_s:.1f} | {rep.best_size} | "
            f"{best.measured_samples_per_s:.1f} | {rep.max_size / every:.2f}x | {rep.max_size / none:.2f}x |")
    say()
    say("remat's rows, every size tried:")
    say()
    say("```")
    say(str(reports[0]))
    say("```")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path)
    ap.add_argument("--budget-mib", type=float, default=40.0)
    ap.add_argument("--skip", choices=["least", "batch"], help="leave one part out")
    args = ap.parse_args()
    header = (f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
              f"{torch.get_num_threads()} threads; torch {torch.__version__}, remat {remat.__version__}; peaks are "
              "live tensor storages of one real training step (CPU).")
    for part, fn, fname in (("least", least_peaks, "least-peak-cpu.md"),
                            ("batch", lambda say: max_batches(say, args.budget_mib), "max-batch-cpu.md")):
        if args.skip == part:
            continue
        lines: list[str] = []

        def say(line: str = "") -> None:
            print(line, flush=True)
            lines.append(line)

        say(header)
        say()
        fn(say)
        if args.out_dir:
            (args.out_dir / fname).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
