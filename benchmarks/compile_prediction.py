"""How close remat's compiled-peak prediction comes to the measured compiled peak (Note [The compiled offset]).

    python benchmarks/compile_prediction.py [--fractions 1.0 0.97 0.93 0.9 0.85 0.8 0.75]

The models of tests/slow/test_inductor.py: the 2-block GPT with dropout (AdamW) and a conv net with BatchNorm
(two blocks of a class with a forward of its own, so that Module.compile() compiles them), each compiled whole
(``compile=True``) and per block (``Module.compile()`` on each block, detected), inductor, with
``fallback_random``. For each, ``optimize_checkpointing`` at budgets that are the given fractions of the compiled
plain step's measured peak (less a byte); prints per budget the plan, its compiled peak as predicted before it
ran and as measured, and the error, then the range of errors per model and compile. The CPU here; run it alone
(each call compiles 1-7 plans).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import remat
from remat.examples import make_gpt


class Layers(nn.Sequential):
    """An nn.Sequential with a forward of its own: Module.compile() compiles it (on torch.nn's own
    nn.Sequential it compiles nothing in torch 2.13, docs/compile.md)."""

    def forward(self, x):
        for layer in self:
            x = layer(x)
        return x


def conv_net():
    torch.manual_seed(0)

    def block(cin, cout):
        return Layers(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                      nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

    model = nn.Sequential(block(3, 16), block(16, 16), nn.Flatten(), nn.Linear(16 * 16 * 16, 10))
    return model, torch.randn(8, 3, 16, 16), (lambda out: out.square().mean()), None, list(model[:2]), "block"


def gpt():
    model, batch, loss_fn = make_gpt(layers=2, batch_size=4, seq_len=16, d_model=32, heads=2, vocab=64, dropout=0.1)
    return model, batch, loss_fn or remat.default_loss, torch.optim.AdamW, list(model.h), "op"


def run(name: str, make, how: str, fractions: list[float]) -> list[float]:
    torch._dynamo.reset()
    model, batch, loss_fn, optim, blocks, granularity = make()
    opt = optim(model.parameters()) if optim is not None else None
    kw: dict = {"compile": True}
    if how == "per block":
        for b in blocks:
            b.compile()
        kw = {}
    roomy = remat.optimize_checkpointing(model, 1.0, batch, loss_fn=loss_fn, optimizer=opt, granularity=granularity, **kw)
    plain = roomy.checked_peak_bytes
    print(f"\n{name}, compiled {how}: compiled plain step {plain:,} bytes")
    print("| budget | fraction | plan | predicted | measured | error | wall |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    errors = []
    for f in fractions:
        budget = int(plain * f) - 1
        t0 = time.perf_counter()
        try:
            plan = remat.optimize_checkpointing(model, budget / 2**30, batch, loss_fn=loss_fn, optimizer=opt,
                                                granularity=granularity, **kw)
        except remat.InfeasibleBudgetError as e:
            print(f"| {budget:,} | {f:.2f} | refused: least {e.min_feasible_bytes:,} | | | | {time.perf_counter() - t0:.1f} s |")
            continue
        err = (plan.predicted_peak_bytes - plan.checked_peak_bytes) / plan.checked_peak_bytes
        errors.append(err)
        print(f"| {budget:,} | {f:.2f} | {', '.join(plan.checkpointed)} | {plan.predicted_peak_bytes:,} | "
              f"{plan.checked_peak_bytes:,} | {err * 100:+.1f}% | {time.perf_counter() - t0:.1f} s |", flush=True)
    remat.remove_checkpointing(model)
    return errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.97, 0.93, 0.9, 0.85, 0.8, 0.75])
    args = ap.parse_args()
    print(f"torch {torch.__version__}, inductor, fallback_random; {torch.get_num_threads()} threads")
    summary = []
    with torch._inductor.config.patch(fallback_random=True):
        for name, make in (("2-block GPT", gpt), ("conv net with BatchNorm", conv_net)):
            for how in ("whole", "per block"):
                errors = run(name, make, how, args.fractions)
                summary.append((name, how, errors))
    print("\n| model | compiled | plans | predicted vs measured |")
    print("|---|---|---:|---|")
    for name, how, errors in summary:
        span = f"{min(errors) * 100:+.1f}% to {max(errors) * 100:+.1f}%" if errors else "-"
        print(f"| {name} | {how} | {len(errors)} | {span} |")


if __name__ == "__main__":
    main()
