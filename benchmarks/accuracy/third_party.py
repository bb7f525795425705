"""remat on models it did not grow up with (run by hand).

    python benchmarks/accuracy/third_party.py [--models qwen3,swin,...] [--out benchmarks/results/third-party-cpu.md]

For each model of tests/integration/third_party.py (Hugging Face Qwen3, Gemma2, Phi-3, GPT-NeoX,
DistilBERT from tiny configs; ConvNeXt channels-last, MobileNetV3-style squeeze-excitation, Swin
window attention): profile once (granularity "op"), measure the hand rule "checkpoint every block",
then ask remat for checked plans at that peak, halfway to no checkpointing, and at no checkpointing;
measure each on a real step (output kept until the step ends, Adam), run the exact equivalence check
and print a Markdown table: capture path, selective options offered and chosen, predicted / checked /
measured peak, and remat's least peak (checked) next to the hand rule's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "integration"))

import remat  # noqa: E402
from remat import InfeasibleBudgetError, Planner, checked_plan, make_profile  # noqa: E402
from remat.api import prepare_hf_for_training  # noqa: E402
from remat.costs.unit_costs import is_selective  # noqa: E402
from remat.solve.plan import MiB  # noqa: E402
from third_party import THIRD_PARTY  # noqa: E402


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def measured_peak(name: str, plan) -> tuple[int, bool]:
    model, inputs, loss_fn = THIRD_PARTY[name]()
    loss_fn = loss_fn or remat.default_loss
    prepare_hf_for_training(model)
    remat.apply_plan(model, plan)
    peak = remat.measure_step(model, inputs, loss_fn=loss_fn, optimizer_factory=adam, repeats=0).peak_bytes
    return peak, remat.check_equivalence(model, inputs, loss_fn=loss_fn).equal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(THIRD_PARTY))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"torch {torch.__version__}, CPU; Adam; output kept until the step ends; peaks in MiB (live tensor storages)")
    say()
    say("| model | capture | selective options | budget | units (@ops) | predicted | checked | measured | error "
        "| met | exact | least peak (checked) / every block (measured) |")
    say("|---|---|---:|---|---:|---:|---:|---:|---:|---|---|---:|")
    for name in args.models.split(","):
        model, inputs, loss_fn = THIRD_PARTY[name]()
        loss_fn = loss_fn or remat.default_loss
        profile = make_profile(model, inputs, loss_fn=loss_fn, optimizer=adam(model.parameters()))
        planner = Planner(profile, granularity="op")
        offered = sum(is_selective(u) for u in planner.model.units)
        every, _ = measured_peak(name, planner.every_nth_block(1))
        none, _ = measured_peak(name, planner.no_checkpointing())
        for label, budget in (("every block", every), ("halfway", (every + none) // 2), ("none", none)):
            try:
                plan = checked_plan(model, inputs, planner, budget, loss_fn=loss_fn)
            except InfeasibleBudgetError as e:
                say(f"| {name} | {profile.capture_path} | {offered} | {label} {budget / MiB:.2f} | refused | | | | | | "
                    f"| {e.min_feasible_bytes / MiB:.2f} / {every / MiB:.2f} |")
                continue
            peak, exact = measured_peak(name, plan)
            sel = sum(is_selective(u) for u in plan.checkpointed)
            err = (plan.predicted_peak_bytes - peak) / peak
            say(f"| {name} | {profile.capture_path} | {offered} | {label} {budget / MiB:.2f} | "
                f"{len(plan.checkpointed)} ({sel}) | {plan.predicted_peak_bytes / MiB:.2f} | "
                f"{plan.checked_peak_bytes / MiB:.2f} | {peak / MiB:.2f} | {err:+.1%} | "
                f"{'yes' if peak <= budget else 'NO'} | {'yes' if exact else 'NO'} | "
                f"{plan.min_peak_bytes / MiB:.2f} / {every / MiB:.2f} |")
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
