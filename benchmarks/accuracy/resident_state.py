"""Does memory the step does not touch slow it on a CPU? A plain training loop's forward and backward with and without
AdamW's state resident, with a zero-filled stand-in of the same bytes (no optimizer), with AdamW at lr=0 (its state
and its step's temporaries, the weights unchanged) and with plain SGD (the weights change, no state).

    python benchmarks/accuracy/resident_state.py [--rounds 2] [--out FILE]

remat never steps the user's optimizer (Note [Never call the user's optimizer] in remat.profile.optimizer): its
profile times the model's steps without the optimizer's state in memory, and adds the optimizer's step as predicted
on shadows. On a GPU the state lies in the device's memory, apart from the host's work; on a CPU it is the same RAM.
Each round runs, on a fresh copy of benchmarks/scale/gpt2_small.py's GPT (124M, 4 x 256): 1 + 4 steps without an
optimizer; the same with two zero-filled tensors per parameter held (AdamW's exp_avg and exp_avg_sq, in bytes);
with AdamW stepped (``zero_grad(set_to_none=True)`` each step, as torch's default); with AdamW at lr=0; with SGD.
Odd rounds run the loops in that order, even rounds in the reverse one (the machine drifts within a round). Each
figure is the median of the last 4 steps' forward, backward and optimizer seconds; the page faults (minor, the
process's) are those of the last 4 steps' forward and backward. About 4 minutes a round on the 2-core CPU; run it
alone.
Writes benchmarks/results/resident-state-cpu.md.
"""

from __future__ import annotations

import argparse
import copy
import platform
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
from gpt2_small import build  # noqa: E402

VARIANTS = (("no optimizer", False, None), ("no optimizer, AdamW's state bytes held (zeros)", True, None),
            ("AdamW", False, "adamw"), ("AdamW, lr=0", False, "adamw0"), ("SGD", False, "sgd"))


def _optimizer(m, step: str | None) -> torch.optim.Optimizer:
    if step == "sgd":
        return torch.optim.SGD(m.parameters(), lr=3e-4)
    return torch.optim.AdamW(m.parameters(), lr=0.0 if step == "adamw0" else 3e-4)


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def loop(model, inputs, hold: bool, step: str | None, steps: int = 5) -> tuple[float, float, float, list[int]]:
    m = copy.deepcopy(model)
    opt = _optimizer(m, step)
    held = [torch.zeros_like(p) for p in m.parameters() for _ in range(2)] if hold else []
    rows, faults = [], []
    for _ in range(steps):
        f0 = _faults()
        t0 = time.perf_counter()
        loss = remat.default_loss(m(*inputs))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        faults.append(_faults() - f0)
        if step:
            opt.step()
        t3 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        rows.append((t1 - t0, t2 - t1, t3 - t2))
    del held
    f, b, o = (statistics.median(r[k] for r in rows[1:]) for k in range(3))
    return f, b, o, faults[1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "resident-state-cpu.md"))
    args = ap.parse_args()
    model, inputs, _ = build()
    inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else inputs
    state_gib = 2 * sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    lines = [f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, {platform.machine()}, "
             f"{torch.get_num_threads()} threads; `python benchmarks/accuracy/resident_state.py --rounds "
             f"{args.rounds}`; every figure measured", "",
             f"GPT-2 small (benchmarks/scale/gpt2_small.py), AdamW's state {state_gib:.2f} GiB.", "",
             "| round | loop | forward s | backward s | optimizer step s | forward, backward against no optimizer | "
             "page faults, forward and backward, per step |",
             "|---:|---|---:|---:|---:|---|---|"]
    print("\n".join(lines), flush=True)
    for r in range(args.rounds):
        measured = {}
        for name, hold, step in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            measured[name] = loop(model, inputs, hold, step)
        base = measured[VARIANTS[0][0]]
        for name, _, _ in VARIANTS:
            f, b, o, faults = measured[name]
            row = (f"| {r + 1} | {name} | {f:.3f} | {b:.3f} | {o:.3f} | {f / base[0]:.2f}x, {b / base[1]:.2f}x | "
                   f"{', '.join(f'{n:,}' for n in faults)} |")
            lines.append(row)
            print(row, flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
