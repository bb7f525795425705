"""The least compiled peak: remat's against the hand rule's and torch.compile's own (issue #36), measured in one run.

    python benchmarks/plans/compiled_least.py [--models gpt2,convnet,gpt,llama] [--random inductor|eager] [--out FILE]
                                                                     # ~15 min on 2 CPU cores

For each model, compiled whole with inductor, AdamW, every peak measured on compiled steps with the same meter
(the profiler's allocator-level events on CPU, benchmarks/plans/compiled.py's ``measure_compiled``):

  remat least       the least compiled peak ``optimize_checkpointing(..., compile=True)`` promises (the lower
                    of its "every block" and least-memory anchors, measured, each as the program proved and
                    lower: the figure a refusal reports), and its margin under the hand rule (MiB; negative: below)
  every block, by hand   each block's forward under ``torch.utils.checkpoint(..., use_reentrant=False)``, then
                    ``torch.compile`` (the hand rule; dropout recomputed as torch does it)
  every block, remat     the same blocks checkpointed by remat, each of its two programs (Note [Two programs per
                    plan] in remat.solve.calibrated): random operators' outputs kept (Note [Random operators
                    under compile] in remat.rewrite) and recomputed
  AMB's least       the plain model compiled with ``activation_memory_budget`` = 0, 0.25, 0.5, 0.75 (compile's
                    own min-cut/knapsack recomputation): the least of the four, and at which fraction

Models: the tests' 2-block GPT (tests/integration/test_compile.py) and conv net with BatchNorm, and
benchmarks/plans/compiled.py's GPT (4 x 128, dropout 0.1, 8 x 128 tokens) and Hugging Face Llama (4 x 128,
attention dropout 0.1). ``--random eager`` sets ``torch._inductor.config.fallback_random`` (as the tests do).
Writes benchmarks/results/compiled-least-<device>-<random>.md.
"""

from __future__ import annotations

import argparse
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "integration"))
import compiled as bench  # noqa: E402  (benchmarks/plans/compiled.py)

import remat  # noqa: E402
from remat.solve.plan import fmt_bytes  # noqa: E402
from remat.rewrite import checkpoint_modules  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
#: activation_memory_budget fractions tried (1.0 is compile's default partition: no checkpointing's column)
AMB = (0.0, 0.25, 0.5, 0.75)


def gpt2(device):
    from test_compile import two_block_gpt

    model, inputs, loss_fn = two_block_gpt()
    return model.to(device), inputs, loss_fn


def convnet(device):
    from test_compile import conv_net

    model, x, loss_fn = conv_net()
    return model.to(device), x.to(device), loss_fn


#: name -> (factory, the loop keeps the output, the blocks "every block" checkpoints); measure_compiled drops the
#: output after the loss, so the loops planned for keep it only where it is the loss itself (the GPTs)
MODELS = {
    "gpt2": (gpt2, True, lambda m: [f"h.{i}" for i in range(len(m.h))]),
    "convnet": (convnet, False, lambda m: ["0", "1"]),
    "gpt": (bench.gpt, True, lambda m: [f"h.{i}" for i in range(len(m.h))]),
    "llama": (bench.llama, False, lambda m: [f"model.layers.{i}" for i in range(len(m.model.layers))]),
}


by_hand = bench.by_hand


def run(name: str, device: torch.device) -> dict:
    factory, output_alive, blocks_of = MODELS[name]
    rc = bench.RematCompiled(factory, device, output_alive)
    try:
        rc.plan(0)
        least = None
    except remat.InfeasibleBudgetError as e:
        least = e.min_feasible_bytes
    row = dict(model=name, remat_least=least)
    m, inp, loss_fn = factory(device)
    row["hand"] = bench.measure_compiled(by_hand(m, blocks_of(m)), inp, loss_fn or remat.default_loss, device, 1)["peak"]
    for random in ("keep", "recompute"):
        m, inp, loss_fn = factory(device)
        checkpoint_modules(m, blocks_of(m), random=random)
        row[f"remat_every_{random}"] = bench.measure_compiled(m, inp, loss_fn or remat.default_loss, device, 1)["peak"]
    amb = {}
    for fraction in AMB:
        m, inp, loss_fn = factory(device)
        amb[fraction] = bench.measure_compiled(m, inp, loss_fn or remat.default_loss, device, 1,
                                               memory_budget=fraction)["peak"]
    row["amb_at"] = min(amb, key=amb.__getitem__)
    row["amb"] = amb[row["amb_at"]]
    m, inp, loss_fn = factory(device)
    row["plain"] = bench.measure_compiled(m, inp, loss_fn or remat.default_loss, device, 1)["peak"]
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,convnet,gpt,llama")
    ap.add_argument("--random", choices=("inductor", "eager"), default="inductor")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device(a.device)
    torch._inductor.config.fallback_random = a.random == "eager"
    rows = [run(n, device) for n in a.models.split(",")]
    mib = lambda b: "-" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    lines = [f"# The least compiled peak ({device.type}, {'eager' if a.random == 'eager' else 'inductor'}'s random numbers)", "",
             f"`python benchmarks/plans/compiled_least.py --random {a.random}`, {datetime.now(timezone.utc):%Y-%m-%d}, "
             f"torch {torch.__version__}, {platform.processor() or platform.machine()}; MiB, measured on compiled "
             "steps (allocator-level events), AdamW.", "",
             "| model | no checkpointing | every block, by hand | every block, remat (random ops kept / recomputed) | "
             "AMB's least (at) | remat's least | remat's least - by hand | remat's least / the lower of hand and AMB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        best = min(r["hand"], r["amb"])
        ratio = "-" if r["remat_least"] is None else f"{r['remat_least'] / best:.3f}"
        margin = "-" if r["remat_least"] is None else f"{(r['remat_least'] - r['hand']) / 2**20:+.2f}"
        lines.append(f"| {r['model']} | {mib(r['plain'])} | {mib(r['hand'])} | {mib(r['remat_every_keep'])} / "
                     f"{mib(r['remat_every_recompute'])} | {mib(r['amb'])} ({r['amb_at']}) | {mib(r['remat_least'])} | "
                     f"{margin} | {ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out) if a.out else RESULTS / f"compiled-least-{device.type}-{a.random}.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
