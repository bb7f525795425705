"""What a third hooked step would change in a long step's profile (Note [Long steps are timed twice]).

    python benchmarks/accuracy/hooked_steps.py [--models gpt2,vit,mlp16] [--processes 4] [--calls 2] [--out FILE]

For a step of a second or more, ``remat.make_profile`` times two hooked steps (forward and backward, hooked, the
top-level units checkpointed; the first also logs the operators) and keeps each time the lesser of the two. Here each
profile runs one hooked step more, recorded and not used, and the table says what it would have changed: per call,
the logging step's backward against the next one's (above 1: the first step was slower, a cold heap or noise),
and the sums over the units of each kind of time, the lesser of the first two (what the profile keeps) against the
lesser of the last two (a third step's). Every call runs in a process of its own or after others in one (``--calls``
per process: the first of each is a process's first profile, as a user's first call is), with remat's timing cache
off. Models: benchmarks/scale/gpt2_small.py's GPT (124M, 4 x 256, AdamW), and benchmarks/plans/ranking.py's "vit"
and "mlp16". About 30 s a GPT-2 call, 12 s a ViT's, 20 s an MLP's on the 2-core CPU; run it alone. Writes
benchmarks/results/hooked-steps-cpu.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("forward", "recompute", "backward")


def worker(model_name: str, calls: int) -> None:
    os.environ["REMAT_CACHE"] = "0"
    import torch

    sys.path[:0] = [str(ROOT / "benchmarks" / "scale"), str(ROOT / "benchmarks" / "plans")]
    import remat
    from remat.profile import timing

    steps: list[dict] = []
    hooked = timing._Timer.hooked_step

    def recorded(self, log_ops):
        timed, ops = hooked(self, log_ops)
        steps.append(copy.deepcopy({k: timed[k] for k in (*KINDS, "step_forward", "step_backward")}))
        if len(steps) == 2:  # one step more, recorded only: what a third would have read
            third, _ = hooked(self, False)
            steps.append(copy.deepcopy({k: third[k] for k in (*KINDS, "step_forward", "step_backward")}))
        return timed, ops

    timing._Timer.hooked_step = recorded
    if model_name == "gpt2":
        from gpt2_small import build

        model, inputs, _ = build()
        loss = None
    else:
        import ranking

        model, inputs, loss = ranking.MODELS[model_name]("cpu")
    for _ in range(calls):
        steps.clear()
        m = copy.deepcopy(model)
        remat.make_profile(m, inputs, loss_fn=loss, optimizer=torch.optim.AdamW(m.parameters()))
        print(json.dumps(steps), flush=True)


def lesser_sums(a: dict, b: dict) -> dict[str, float]:
    """Per kind, the sum over the units of each unit's lesser time of two steps."""
    return {k: sum(min(a[k][u], b[k].get(u, a[k][u])) for u in a[k]) for k in KINDS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,vit,mlp16")
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "CALLS"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hooked-steps-cpu.md"))
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]))
    import torch

    lines = [f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {platform.machine()}, "
             f"{torch.get_num_threads()} threads; `python benchmarks/accuracy/hooked_steps.py --models {args.models} "
             f"--processes {args.processes} --calls {args.calls}`; every figure measured", "",
             "| model | process, call | logging step's backward / the next one's | third's / the second's | "
             "sums of the lesser of two, the last two against the first two: forward, recompute, backward |",
             "|---|---|---:|---:|---|"]
    print("\n".join(lines), flush=True)
    summary = []
    for name in args.models.split(","):
        ratios, changes = [], []
        for p in range(args.processes):
            out = subprocess.run([sys.executable, __file__, "--worker", name, str(args.calls)], check=True,
                                 capture_output=True, text=True, cwd=ROOT).stdout
            for c, line in enumerate(x for x in out.splitlines() if x.startswith("[")):
                s = json.loads(line)
                if len(s) < 3:
                    continue  # a short step: not a long step's profile
                r12 = s[0]["step_backward"] / s[1]["step_backward"]
                r32 = s[2]["step_backward"] / s[1]["step_backward"]
                first, last = lesser_sums(s[0], s[1]), lesser_sums(s[1], s[2])
                change = {k: last[k] / first[k] - 1 if first[k] else 0.0 for k in KINDS}
                ratios.append(r12)
                changes.append(change)
                row = (f"| {name} | {p + 1}, {c + 1}{' (first in its process)' if c == 0 else ''} | {r12:.3f} | "
                       f"{r32:.3f} | " + ", ".join(f"{change[k]:+.1%}" for k in KINDS) + " |")
                lines.append(row)
                print(row, flush=True)
        if ratios:
            summary.append(
                f"- {name}: {len(ratios)} calls; the logging step's backward read {min(ratios):.3f}-{max(ratios):.3f} "
                f"of the next one's ({sum(r > 1.05 for r in ratios)} above 1.05); a third step would have moved the "
                "sums " + ", ".join(f"{k} {min(c[k] for c in changes):+.1%} to {max(c[k] for c in changes):+.1%}"
                                    for k in KINDS) +
                f" (median recompute {statistics.median(c['recompute'] for c in changes):+.1%})")
    lines += ["", *summary]
    print("\n".join(["", *summary]))
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
