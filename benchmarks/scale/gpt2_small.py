"""remat at real size: a GPT-2-small-shaped decoder (124M parameters), as a nanoGPT user trains it (run by hand).

    python benchmarks/scale/gpt2_small.py [--layers 12] [--d-model 768] [--heads 12] [--vocab 50304]
                                    [--batch-size 4] [--seq-len 256] [--skip-tradeoff] [--out FILE]

The model is remat's built-in GPT (``remat.examples.GPT``: nanoGPT's shape, dropout 0.1, tied head, the loss
computed inside its forward from ``targets``), trained with AdamW. Every measurement runs in a process of its
own, so that each one's memory (its peak RSS, ``ru_maxrss``) is its own, and with an empty timing cache of its
own (a first call's cost; Note [Timing cache]) unless said:

  plain      a plain training loop (no remat): 1 + 3 AdamW steps; the step time (median of the 3) and its RSS
  peaks      measured peaks of one step without checkpointing and with every block checkpointed
  plan       ``optimize_checkpointing`` at three budgets: every block's measured peak, halfway between it and
             no checkpointing, and 0.9 x every block (below the least peak: refused): wall time in plain
             steps, the stage times from the plan's notes, the model forwards it ran (counted on the class),
             and the plan's "what holds the predicted peak" (or the refusal's message); then the halfway
             budget again in a new process reading the first halfway call's cached times (a second call)
  tradeoff   ``remat tradeoff`` on this model (``benchmarks/scale/gpt2_small.py:build``, the hand rules and two
             budgets, one timed round per plan): its peak RSS against the plain loop's

Writes benchmarks/results/gpt2-small-<device>.md and prints it. Run it alone: timings on a busy machine are
meaningless (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
SIZE = dict(layers=12, d_model=768, heads=12, vocab=50304, batch_size=4, seq_len=256)


def build(device: str | torch.device = "cpu", **size):
    """The model and batch (``remat tradeoff benchmarks/scale/gpt2_small.py:build`` uses it as its target)."""
    from remat.examples import make_gpt

    size = {**SIZE, **{k: v for k, v in size.items() if v is not None}}
    if os.environ.get("GPT2_SMALL_SIZE"):
        size.update(json.loads(os.environ["GPT2_SMALL_SIZE"]))
    return make_gpt(dropout=0.1, device=device, **size)


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # (kilobytes on Linux)


def _count_forwards():
    from remat.examples import GPT

    calls = [0]
    forward = GPT.forward

    def counted(self, *a, **k):
        calls[0] += 1
        return forward(self, *a, **k)

    GPT.forward = counted
    return calls


def stage_plain(args) -> dict:
    model, (idx, targets), _ = build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return dict(step_s=statistics.median(times[1:]), first_step_s=times[0], rss_gib=_rss_gib(),
                params=sum(p.numel() for p in model.parameters()))


def stage_peaks(args) -> dict:
    import remat
    from remat.rewrite import checkpoint_modules

    model, inputs, _ = build()
    adamw = lambda ps: torch.optim.AdamW(ps, lr=3e-4)  # noqa: E731
    plain = remat.measure_step(model, inputs, optimizer_factory=adamw, repeats=0).peak_bytes
    checkpoint_modules(model, [f"h.{i}" for i in range(len(model.h))])
    every = remat.measure_step(model, inputs, optimizer_factory=adamw, repeats=0).peak_bytes
    return dict(plain_peak=plain, every_block_peak=every)


def stage_plan(args) -> dict:
    import remat

    model, inputs, _ = build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    calls = _count_forwards()
    t0 = time.perf_counter()
    try:
        plan = remat.optimize_checkpointing(model, args.budget / GiB, inputs, optimizer=opt)
    except remat.InfeasibleBudgetError as e:
        return dict(wall_s=time.perf_counter() - t0, forwards=calls[0], refused=True, message=str(e),
                    least=e.min_feasible_bytes)
    wall = time.perf_counter() - t0
    return dict(wall_s=wall, forwards=calls[0], refused=False, text=str(plan), units=len(plan.checkpointed),
                checked=plan.checked_peak_bytes, predicted=plan.predicted_peak_bytes, least=plan.min_peak_bytes,
                notes=list(plan.notes))


def stage_tradeoff(args) -> dict:
    from remat.cli import main

    t0 = time.perf_counter()
    code = main(["tradeoff", f"{Path(__file__).resolve()}:build", "--device", "cpu", "--optimizer", "adamw",
                 "--budgets", ",".join(f"{b / GiB:.4f}" for b in args.budgets), "--repeats", "1", "--warmup", "0",
                 "--granularity", "block"])
    return dict(code=code, wall_s=time.perf_counter() - t0, rss_gib=_rss_gib())


#: the timing caches of this run's processes (Note [Timing cache]), removed when it ends
_CACHES = tempfile.TemporaryDirectory(prefix="remat-gpt2-small-")


def _fresh_cache() -> str:
    return tempfile.mkdtemp(dir=_CACHES.name)


def _child(stage: str, env_size: dict, cache: str | None = None, **extra) -> dict:
    """Runs ``stage`` in a process of its own, with remat's timing cache in ``cache`` (default: a new empty
    directory, so that each call measures its times as a first call does)."""
    cmd = [sys.executable, __file__, "--stage", stage]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    env = {**os.environ, "GPT2_SMALL_SIZE": json.dumps(env_size), "REMAT_CACHE": "1",
           "REMAT_CACHE_DIR": cache or _fresh_cache(),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"stage {stage} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    sys.stderr.write(out.stdout[:-1].rsplit("\n", 1)[0] + "\n" if "\n" in out.stdout.strip() else "")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _stage_seconds(notes: list[str]) -> str:
    return next((n.removeprefix("planning took ") for n in notes if n.startswith("planning took")), "-")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in SIZE.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--skip-tradeoff", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    p.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stage:
        result = {"plain": stage_plain, "peaks": stage_peaks, "plan": stage_plan, "tradeoff": stage_tradeoff}[
            args.stage](args)
        print(json.dumps(result))
        return
    size = {k: getattr(args, k) for k in SIZE}
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    say("plain training process"); plain = _child("plain", size)
    say("peaks of no checkpointing and every block"); peaks = _child("peaks", size)
    every, none = peaks["every_block_peak"], peaks["plain_peak"]
    budgets = {"every block's measured peak": every, "halfway to no checkpointing": (every + none) // 2,
               "0.9 x every block (below the least peak)": int(0.9 * every)}
    plans, caches = {}, {label: _fresh_cache() for label in budgets}
    for label, b in budgets.items():
        say(f"optimize_checkpointing at {label}"); plans[label] = _child("plan", size, caches[label], budget=b)
    # a second call at the same budget (another process, a new model object): its times come from the cache
    again = "halfway again (a second call: times from the timing cache)"
    say(f"optimize_checkpointing {again}")
    plans[again] = _child("plan", size, caches["halfway to no checkpointing"], budget=budgets["halfway to no checkpointing"])
    budgets[again] = budgets["halfway to no checkpointing"]
    tr = None if args.skip_tradeoff else (say("remat tradeoff"), _child("tradeoff", size, budgets=[every, (every + none) // 2]))[1]
    step = plain["step_s"]
    lines = [f"# remat at GPT-2-small size ({'cpu'})", "",
             f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
             f"{torch.get_num_threads()} threads; torch {torch.__version__}; `python benchmarks/scale/gpt2_small.py`.", "",
             f"Model: remat.examples.GPT, {size['layers']} x {size['d_model']}, {size['heads']} heads, vocab "
             f"{size['vocab']}, batch {size['batch_size']} x {size['seq_len']}, dropout 0.1, loss inside the forward; "
             f"{plain['params'] / 1e6:.1f}M parameters; AdamW.", "",
             f"One plain training step: {step:.2f} s (median of 3 after a first of {plain['first_step_s']:.2f} s). "
             f"Measured peak: no checkpointing {none / GiB:.3f} GiB, every block {every / GiB:.3f} GiB.", "",
             "## optimize_checkpointing: planning cost", "",
             "| budget | GiB | result | wall | in plain steps | model forwards | stages (from the plan's notes) |",
             "|---|---:|---|---:|---:|---:|---|"]
    for label, r in plans.items():
        result = (f"refused: least {r['least'] / GiB:.3f} GiB" if r["refused"] else
                  f"{r['units']} units, checked {r['checked'] / GiB:.3f} GiB (predicted {r['predicted'] / GiB:.3f})")
        lines.append(f"| {label} | {budgets[label] / GiB:.3f} | {result} | {r['wall_s']:.1f} s | "
                     f"{r['wall_s'] / step:.1f} | {r['forwards']} | {_stage_seconds(r.get('notes', []))} |")
    first = plans["every block's measured peak"]
    lines += ["", "## What holds the predicted peak (the plan at every block's peak)", "", "```",
              *[ln for ln in first.get("text", "").splitlines() if ln.strip()][:40], "```"]
    refused = plans["0.9 x every block (below the least peak)"]
    if refused["refused"]:
        lines += ["", "The refusal at 0.9 x every block:", "", "> " + refused["message"]]
    if tr is not None:
        lines += ["", "## remat tradeoff: memory of the process", "",
                  "| process | peak RSS | vs plain |", "|---|---:|---:|",
                  f"| plain training loop (AdamW, 4 steps) | {plain['rss_gib']:.2f} GiB | 1.00 |",
                  f"| `remat tradeoff` (hand rules + 2 budgets, {tr['wall_s']:.0f} s) | {tr['rss_gib']:.2f} GiB | "
                  f"{tr['rss_gib'] / plain['rss_gib']:.2f} |"]
    text = "\n".join(lines) + "\n"
    out = args.out or ROOT / "benchmarks" / "results" / "gpt2-small-cpu.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
