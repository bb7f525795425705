"""remat never touches training state: the optimizer x scheduler matrix (run by hand).

    python benchmarks/accuracy/training_state.py [--out benchmarks/results/training-state-cpu.md]

For every torch.optim optimizer that works on dense parameters (tests/integration/optimizers.py) x
the common LR schedulers x a fresh or a resumed run (one real step taken, the next step's gradients
in place): profile a 4-block MLP with remat (``make_profile``, the stage that accounts for the
optimizer), then compare the predicted optimizer-state bytes with the state two real steps of the
same optimizer and scheduler create, and check that parameters, gradients, optimizer and scheduler
state_dicts, learning rates and the RNG state are exactly as before. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "integration"))

import remat  # noqa: E402
from optimizers import OPTIMIZERS, SCHEDULERS  # noqa: E402
from test_training_state import (assert_same_state, batch, loss, mlp, real_state_bytes, start_run,  # noqa: E402
                                 training_state)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="also write the table to this file")
    args = ap.parse_args()
    x = batch()
    lines = [f"torch {torch.__version__}, CPU; 4-block MLP (32-128-32), batch 512. Cell: predicted / measured "
             "optimizer-state bytes (fresh run; resumed run), and whether everything was left as it was.", "",
             "| optimizer | " + " | ".join(SCHEDULERS) + " |", "|---|" + "---|" * len(SCHEDULERS)]
    bad = 0
    for opt_name, make_opt in OPTIMIZERS.items():
        cells = []
        for sched_name, make_sched in SCHEDULERS.items():
            parts, ok = [], True
            for start in ("fresh", "resumed"):
                model = mlp()
                opt, sched = start_run(model, make_opt, make_sched, x, start)
                before = training_state(model, opt, sched)
                profile = remat.make_profile(model, x, loss_fn=loss, optimizer=opt)
                try:
                    assert_same_state(before, training_state(model, opt, sched))
                except AssertionError:
                    ok = False
                real = real_state_bytes(make_opt, mlp(), x, make_sched)
                ok = ok and profile.optimizer_state_bytes == real
                parts.append(f"{profile.optimizer_state_bytes}/{real}")
            bad += not ok
            cells.append(f"{'; '.join(parts)} {'untouched' if ok else '**DIFFERS**'}")
        lines.append(f"| {opt_name} | " + " | ".join(cells) + " |")
    lines += ["", f"{len(OPTIMIZERS) * len(SCHEDULERS)} combinations x 2 starts: "
              f"{'all exact and untouched' if not bad else f'{bad} with a difference'}."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
