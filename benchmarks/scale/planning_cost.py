"""What planning costs at real size, in plain training steps (issue #60), and what it returns (run by hand, alone).

    python benchmarks/scale/planning_cost.py [--repeats 3] [--layers 12] [--out benchmarks/results/planning-cost-cpu.md]

The model is benchmarks/scale/gpt2_small.py's (remat's built-in GPT at GPT-2-small size: 12 x 768, 12 heads, vocab 50304,
batch 4 x 256, dropout 0.1, AdamW), trained as a nanoGPT user trains it. In one process, with remat's timing cache
off (``REMAT_CACHE=0``: every call is a first call):

1. the plain step: 1 + 3 AdamW steps without remat, the median of the last 3 (the unit of the planning cost);
2. one profile (``remat.make_profile``) for the budgets: 85% of the plain step's predicted peak, and every block's
   predicted peak x 1.01 and x 1.05 (just above it, where the ILP's plan and every block are near: Note [Plans timed
   beside the hand rules] in remat.api.hand_rules);
3. at each budget ``remat.optimize_checkpointing`` on a fresh copy of the model, as a user calls it: its wall time,
   in plain steps, and what it returned, with the passes and seconds it spent timing beside the hand rules
   (``Plan.rules_timing_passes``, ``Plan.rules_timing_s``) and whether it compared, confirmed or raced;
4. every plan returned and every block measured side by side (remat.check.steps.measure_plans: whole AdamW steps,
   2 x --repeats rounds in a shuffled order after a warm-up, one copy of the model): the paired difference, plan
   returned less every block, median and quartiles ("slower" only where even the lower quartile is above 0).

Prints the tables and writes them to --out.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("REMAT_CACHE", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import remat  # noqa: E402
from gpt2_small import build  # noqa: E402
from remat.check.steps import measure_plans  # noqa: E402

GiB = 2**30


def plain_step_s(model, inputs) -> float:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        loss = remat.default_loss(model(*inputs) if isinstance(inputs, tuple) else model(inputs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def how_compared(plan) -> str:
    if any("not timed beside the hand rules" in n for n in plan.notes):
        return "every rule beyond the model's measured error: not timed"
    note = next((n for n in plan.notes if "compared with the hand rules" in n or "checked for a comparison" in n), "")
    if not note:
        return "nothing compared (no rule meets the budget)"
    if "so it is the plan returned" in note:
        return "raced: a rule measured faster, returned"
    if "paired steps" in note:
        return "raced: this plan kept"
    if "which confirmed the model" in note:
        return "the first timed pair confirmed the model: this plan kept"
    if "confirmed, not timed" in note:
        return "the checked steps confirmed the model: not timed"
    return "a rule checked over the budget: not compared"


def confirmation(plan) -> str:
    """What the plan's note says of the rules compared (their figures, measured and predicted) and the outcome."""
    end = "Note [The model's measured error])"
    trusted = next((n for n in plan.notes if "not timed beside the hand rules" in n), "")
    if trusted:
        said = trusted[trusted.index("not timed beside the hand rules"):].split("): ", 1)[1]
        return said[:said.index(end) + len(end)] if end in said else said
    note = next((n for n in plan.notes if "compared with the hand rules" in n), "")
    if not note:
        return "-"
    note = note[note.index("compared with the hand rules"):]
    margin = note.split("predicts within ", 1)[1].split(" of this plan and within the budget")[0]
    return (f"margin {margin}: " +
            note.split("measured now): ", 1)[-1].split("): ", 1)[-1].split("; timing beside the hand")[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", default=f"benchmarks/results/planning-cost-{'cpu'}.md")
    args = ap.parse_args()
    size = {} if args.layers is None else {"layers": args.layers}
    model, inputs, _ = build(**size)
    inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else inputs
    lines = [f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {platform.machine()}, "
             f"{torch.get_num_threads()} threads; `python benchmarks/scale/planning_cost.py"
             f"{'' if args.layers is None else f' --layers {args.layers}'}`; remat's timing cache off (first calls); "
             "every figure measured here but those marked predicted", ""]
    say = print
    say("timing the plain step")
    plain_s = plain_step_s(model, inputs)
    t0 = time.perf_counter()
    profile = remat.make_profile(copy.deepcopy(model), inputs, optimizer=torch.optim.AdamW(model.parameters()))
    profile_s = time.perf_counter() - t0
    planner = remat.Planner(profile)
    every = planner.every_nth_block(1)
    budgets = [("85% of the plain peak (predicted)", int(0.85 * planner.baseline_peak_bytes)),
               ("every block's predicted peak x 1.01", int(every.predicted_peak_bytes * 1.01)),
               ("every block's predicted peak x 1.05", int(every.predicted_peak_bytes * 1.05))]
    lines += [f"Model: benchmarks/scale/gpt2_small.py's GPT ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
              f"parameters), AdamW. One plain step: {plain_s:.2f} s measured (median of 3 after a first). Predicted "
              f"peaks: no checkpointing {planner.baseline_peak_bytes / GiB:.3f} GiB, every block "
              f"{every.predicted_peak_bytes / GiB:.3f} GiB (the profile for them: {profile_s:.1f} s, not counted "
              "below).", "",
              "## optimize_checkpointing: planning cost", "",
              "| budget | GiB | returned | wall s | plain steps | in its own plain steps | timing beside hand rules: "
              "passes, s | compared | the rules compared (from the plan's note) |",
              "|---|---:|---|---:|---:|---:|---:|---|---|"]
    stages = []
    returned = []
    for label, budget in budgets:
        say(f"planning at {label}")
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        plan = remat.optimize_checkpointing(m, budget / GiB, inputs, optimizer=torch.optim.AdamW(m.parameters()))
        wall = time.perf_counter() - t0
        remat.remove_checkpointing(m)
        returned.append((label, budget, plan))
        took = next((n for n in plan.notes if n.startswith("planning took")), "")
        own = re.search(r"one plain step measured ([\d.]+) s", took)
        hooked = next((n for n in plan.notes if "hooked steps of" in n),
                      "no note on its hooked steps (a step under a second, or its times read from the timing cache)")
        stages.append(f"- {label}: {took}; the profile: {hooked}")
        lines.append(f"| {label} | {budget / GiB:.3f} | {plan.strategy}, {len(plan.checkpointed)} units | {wall:.1f} | "
                     f"{wall / plain_s:.1f} | {wall / float(own.group(1)) if own else float('nan'):.1f} | "
                     f"{plan.rules_timing_passes}, {plan.rules_timing_s:.1f} | "
                     f"{how_compared(plan)} | {confirmation(plan)} |")
        print(lines[-1], flush=True)
    lines += ["", "in plain steps: of the plain step measured first; in its own: of the one its profile measured (a "
              "busy machine moves both). The calls' own notes:", "", *stages]
    say("measuring the plans returned beside every block")
    plans, seen = [], set()
    for p in [every] + [p for _, _, p in returned]:
        if p.choices not in seen:
            seen.add(p.choices)
            plans.append(p)
    least = min(plans, key=lambda p: p.predicted_peak_bytes)
    ms = measure_plans(model, inputs, plans, optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=3e-4),
                       warm_with=least, warmup=1, repeats=args.repeats, output_alive=profile.output_alive)
    by = {p.choices: m for p, m in zip(plans, ms)}
    e = by[every.choices]
    lines += ["", f"## The plan returned beside every block (whole AdamW steps, {2 * args.repeats} interleaved rounds)",
              "", "| budget | returned | peak GiB (measured) | step s: predicted / measured | plan less every block, "
              "paired ms: median [quartiles] | |", "|---|---|---:|---:|---:|---|"]
    for label, budget, plan in returned:
        m = by[plan.choices]
        pairs = [a - b for a, b in zip(m.step_times_s, e.step_times_s)]
        q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
        verdict = "same plan" if plan.choices == every.choices else "slower" if q[0] > 0 else ""
        lines.append(f"| {label} | {plan.strategy}, {len(plan.checkpointed)} units | {m.peak_bytes / GiB:.3f} | "
                     f"{plan.predicted_step_time_s:.2f} / {m.step_time_s:.2f} | {statistics.median(pairs) * 1e3:+,.0f} "
                     f"[{q[0] * 1e3:+,.0f}, {q[2] * 1e3:+,.0f}] | {verdict} |")
    lines.append(f"\nevery block: peak {e.peak_bytes / GiB:.3f} GiB, step {every.predicted_step_time_s:.2f} s predicted"
                 f" / {e.step_time_s:.2f} s measured")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
