"""Predicted vs measured peak memory, and gradient differences, over the test zoo (run by hand).

    python benchmarks/accuracy/accuracy.py [--fractions 0,0.35,0.7] [--loops kept,dropped] [--out FILE]

For each model of tests/integration/zoo.py (and the reused-module models of
tests/integration/test_reused_modules.py) and each training-loop style (Note [Loop style]: the
output kept until the step ends, or dropped after the loss): profile once, plan at budgets spread
between the least achievable and the no-checkpointing peak, apply each plan to a fresh copy,
measure one real training step of that loop (CPU: live tensor storages; CUDA: allocator) and run
the equivalence check. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "integration"))

import remat  # noqa: E402
from remat import Planner, make_profile  # noqa: E402
from remat.solve.plan import MiB  # noqa: E402
from test_reused_modules import Albert, SharedMLP, make  # noqa: E402
from zoo import ZOO  # noqa: E402

MODELS = {**ZOO, "albert": lambda: make(Albert), "shared-mlp": lambda: make(SharedMLP)}
try:  # Hugging Face models from configs (tests/integration/real_models.py), when transformers is installed
    from real_models import REAL  # noqa: E402

    MODELS.update({f"hf-{k}": v for k, v in REAL.items()})
except ImportError:
    pass
DEFAULT_MODELS = [m for m in MODELS if not m.startswith("hf-")] + ["hf-gpt2", "hf-llama"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fractions", default="0,0.35,0.7,1.0",
                    help="budgets as fractions of the way from the least to the no-checkpointing peak")
    ap.add_argument("--models", default=",".join(m for m in DEFAULT_MODELS if m in MODELS),
                    help=f"comma-separated, from: {', '.join(MODELS)}")
    ap.add_argument("--loops", default="kept,dropped", help="training-loop styles: kept and/or dropped")
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    args = ap.parse_args()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    fractions = [float(f) for f in args.fractions.split(",")]
    opt = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    say(f"torch {torch.__version__}; memory measured as live tensor storages (CPU); optimizer Adam")
    say("")
    say("| model | loop (output) | capture | budget (MiB) | checkpointed | predicted peak (MiB) | "
        "measured peak (MiB) | error | budget met | max grad diff |")
    say("|---|---|---|---:|---:|---:|---:|---:|---|---:|")
    worst = 0.0
    for name in args.models.split(","):
        for loop in args.loops.split(","):
            alive = {"kept": True, "dropped": False}[loop]
            model, inputs, loss_fn = MODELS[name]()
            loss_fn = loss_fn or remat.default_loss
            profile = make_profile(model, inputs, loss_fn=loss_fn, optimizer=opt(model.parameters()), output_alive=alive)
            planner = Planner(profile)
            lo, hi = planner.min_peak_bytes, planner.baseline_peak_bytes
            for f in fractions:
                budget = int(lo + f * (hi - lo))
                plan = planner.plan_for_budget(budget)
                fresh, inputs, loss_fn2 = MODELS[name]()
                loss_fn2 = loss_fn2 or remat.default_loss
                remat.api.prepare_hf_for_training(fresh)  # no KV cache, as optimize_checkpointing runs it
                remat.apply_plan(fresh, plan)
                m = remat.measure_step(fresh, inputs, loss_fn=loss_fn2, optimizer_factory=opt, output_alive=alive)
                rep = remat.check_equivalence(fresh, inputs, loss_fn=loss_fn2)
                grad = max((d for n, d in rep.max_abs_diff.items() if n.startswith("grad:")), default=0.0)
                err = (plan.predicted_peak_bytes - m.peak_bytes) / m.peak_bytes
                worst = max(worst, abs(err))
                say(f"| {name} | {loop} | {profile.capture_path}/{profile.memory_recorded_with} | {budget / MiB:.3f} | "
                    f"{len(plan.checkpointed)} | {plan.predicted_peak_bytes / MiB:.3f} | {m.peak_bytes / MiB:.3f} | "
                    f"{err:+.2%} | {'yes' if m.peak_bytes <= budget else 'NO'} | {grad:.1e} |")
    say("")
    say(f"worst |predicted - measured| / measured: {worst:.2%}")
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
