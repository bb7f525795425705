"""How close remat's compiled-peak prediction comes to the measured compiled peak (Note [Compiled steps]).

    python benchmarks/accuracy/compile_prediction.py [--fractions 1.0 0.97 0.93 0.9 0.85 0.8 0.75] [--same-plans | --saved-set]

The models of tests/slow/test_inductor.py: the 2-block GPT with dropout (AdamW) and a conv net with BatchNorm
(two blocks of a class with a forward of its own, so that Module.compile() compiles them), each compiled whole
(``compile=True``) and per block (``Module.compile()`` on each block, detected), inductor, with
``fallback_random``. For each, ``optimize_checkpointing`` at budgets that are the given fractions of the compiled
plain step's measured peak (less a byte); prints per budget the plan, its compiled peak as predicted before it
ran and as measured, and the error, then the range of errors per model and compile. The CPU here; run it alone
(each call compiles 1-7 plans).

With ``--same-plans``, instead: remat's predictors on the same plans. The compiled step is measured for the
anchors (no checkpointing, every block, the least-memory plan) and for the ILP's plans at 8 eager targets across
the range (benchmarks/plans/compiled.py's 4-block GPT included), and each plan is predicted from the anchors alone:
interpolating in the eager peak (``PeakCalibration``; remat's only predictor until session 15, and for blocks
compiled one by one until session 16); by a candidate rejected in session 14, an offset (compiled - eager peak)
interpolated in the memory the plan holds at the end of the forward (12 of 20 plans within 5% by the eager
peak, 8 of 20 by it; it lives here, not in remat); and by what remat predicts a model compiled by inductor
from (a whole model since session 15, blocks compiled one by one since session 16), interpolating in what the
step's compiled programs allocate (Note [Compiled programs], Note [Blocks compiled one by one] in
remat.costs.compiled_memory).

With ``--saved-set``, instead: what the partitioner saves, against the measured compiled peak, on the same plans
of the conv net and the 4-block GPT compiled whole. Each plan is traced with inductor's decompositions and its
min-cut partitioner but no kernels (``aot_autograd`` with a forward compiler that reads the forward graph's
outputs: the user outputs and the saved tensors), and compiled with inductor and measured. Prints the saved
bytes and the measured peak less them: where the end of the forward holds the peak, that difference is the
no-checkpointing plan's (parameters, gradients, optimizer state, the batch) give or take the forward's last
temporaries, so the saved set predicts it; where the backward holds it (recomputations), it does not.
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


def forward_end_bytes(sim, units) -> int:
    """The eager prediction of the memory held at the end of the forward with ``units`` checkpointed (the
    simulator's rows at the last forward operator; private fields of remat.costs.simulate.MemoryModel)."""
    p = sim.profile
    i = max(p.backward_start - 1, 0)
    chosen = sim.assignment(units)
    return p.fixed_bytes + p.live_bytes[i] + sum(c for u, c in sim._coefs(i).items() if u in chosen)


def offset_in_held(anchors, eager: int, held: int) -> int:
    """The candidate: eager peak + (compiled - eager) of the anchors, interpolated in the memory held at the
    end of the forward (constant outside them)."""
    pts = sorted((h, c - e) for e, h, c in anchors)
    if held <= pts[0][0]:
        return eager + pts[0][1]
    if held >= pts[-1][0]:
        return eager + pts[-1][1]
    for (h0, o0), (h1, o1) in zip(pts, pts[1:]):
        if h0 <= held <= h1:
            return eager + round(o0 + (o1 - o0) * (held - h0) / max(h1 - h0, 1))
    raise AssertionError("unreachable")


def anchors_and_ilp_plans(planner, fractions) -> dict[str, tuple[str, ...]]:
    """The anchors of Note [Compiled steps] and the ILP's plans at the given fractions of the eager range, by label
    (a plan the ILP gives for two fractions under the first's label)."""
    lo, hi = planner.min_peak_bytes, planner.baseline_peak_bytes
    plans = {"none": (), "every block": planner.every_nth_block(1).checkpointed,
             "least memory": planner.least_memory().checkpointed}
    for f in fractions:
        plans.setdefault(f"ILP at {f:.2f} of the eager range", planner.plan_for_budget(int(lo + f * (hi - lo))).checkpointed)
    return plans


def same_plans(name: str, make, how: str) -> None:
    """remat's predictor and the candidate on the same measured plans (``--same-plans``)."""
    from remat.api import checked_reading
    from remat.runtime.compiled import compiled_loop
    from remat.runtime.measure import split_inputs
    from remat.solve.calibrated import PeakCalibration

    torch._dynamo.reset()
    model, batch, loss_fn, optim, blocks, granularity = make()
    opt = optim(model.parameters()) if optim is not None else None
    if how == "per block":
        for b in blocks:
            b.compile()
    loop = compiled_loop(model, model, True if how == "whole" else None)
    profile = remat.make_profile(model, batch, loss_fn=loss_fn, optimizer=opt)
    planner = remat.Planner(profile, granularity=granularity, regions=False)
    sim = planner.model
    args, kwargs = split_inputs(batch)
    plans = anchors_and_ilp_plans(planner, (0.05, 0.1, 0.2, 0.3, 0.4, 0.55, 0.7, 0.85))
    measured, programs = {}, {}
    for label, units in plans.items():
        if units not in measured:
            with torch.random.fork_rng():
                reading = checked_reading(model, planner.make_plan(units, label), args, kwargs, loss_fn,
                                          torch.device("cpu"), profile, loop)
            measured[units], programs[units] = reading.peak_bytes, reading.program_bytes
    named = (plans["none"], plans["every block"], plans["least memory"])
    anchors = [(sim.peak_bytes(u), forward_end_bytes(sim, u), measured[u]) for u in named]
    by_eager = PeakCalibration(tuple((e, c) for e, _, c in anchors))
    by_program = PeakCalibration(tuple((programs[u], measured[u]) for u in named)) \
        if all(programs[u] is not None for u in named) else None
    print(f"\n{name}, compiled {how}: the same plans, predicted from the three anchors")
    print("| plan | units | eager predicted | compiled measured | in the eager peak (until session 15) | "
          "candidate (offset in the forward's end) | remat (in the compiled program's allocations) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    seen = set()
    for label, units in plans.items():
        if label in ("none", "every block", "least memory") or units in seen:
            continue
        seen.add(units)
        e, c = sim.peak_bytes(units), measured[units]
        old, new = by_eager.predict(e), offset_in_held(anchors, e, forward_end_bytes(sim, units))
        program = "-" if by_program is None or programs[units] is None else \
            f"{(by_program.predict(programs[units]) - c) / c * 100:+.1f}%"
        print(f"| {label} | {len(units)} | {e:,} | {c:,} | {(old - c) / c * 100:+.1f}% | {(new - c) / c * 100:+.1f}% | "
              f"{program} |")


def saved_set(name: str, make) -> None:
    """The partitioner's saved bytes against the measured compiled peak, per plan (``--saved-set``)."""
    import functools

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    from remat.api import peak_with_plan
    from remat.runtime.compiled import compiled_loop
    from remat.runtime.measure import split_inputs
    from remat.rewrite import checkpoint_plan, remove_checkpointing

    model, batch, loss_fn, optim, _, granularity = make()
    opt = optim(model.parameters()) if optim is not None else None
    profile = remat.make_profile(model, batch, loss_fn=loss_fn, optimizer=opt)
    planner = remat.Planner(profile, granularity=granularity, regions=False)
    args, kwargs = split_inputs(batch)
    plans = anchors_and_ilp_plans(planner, (0.2, 0.3, 0.4, 0.55, 0.7, 0.85))

    def traced_saved_bytes(units) -> int:
        outputs: list = []

        def forward_graph(gm, example_inputs):
            out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            outputs.extend(v.meta["val"] for v in out if isinstance(v, torch.fx.Node) and torch.is_tensor(v.meta.get("val")))
            return gm

        backend = aot_autograd(fw_compiler=forward_graph, bw_compiler=lambda gm, example_inputs: gm,
                               decompositions=select_decomp_table(),
                               partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
        torch._dynamo.reset()
        checkpoint_plan(model, planner.make_plan(units, "traced"))
        try:
            with torch.random.fork_rng():
                loss_fn(torch.compile(model, backend=backend, dynamic=False)(*args, **kwargs)).backward()
        finally:
            remove_checkpointing(model)
            for p in model.parameters():
                p.grad = None
        from torch.fx.experimental.symbolic_shapes import optimization_hint

        # (a forward graph traced with a symbolic size, e.g. a batch dimension Dynamo made dynamic: its hint)
        return sum(optimization_hint(t.untyped_storage().nbytes()) for t in outputs)

    loop = compiled_loop(model, model, True)
    print(f"\n{name}, compiled whole: the partitioner's saved set (traced, no kernels) and the measured peak")
    print("| plan | units | saved (traced) | compiled measured | measured - saved |")
    print("|---|---:|---:|---:|---:|")
    seen = set()
    for label, units in plans.items():
        if units in seen:
            continue
        seen.add(units)
        saved = traced_saved_bytes(units)
        torch._dynamo.reset()
        with torch.random.fork_rng():
            peak = peak_with_plan(model, planner.make_plan(units, label), args, kwargs, loss_fn, torch.device("cpu"),
                                  profile, loop)
        print(f"| {label} | {len(units)} | {saved:,} | {peak:,} | {peak - saved:,} |", flush=True)


def gpt4():
    model, batch, loss_fn = make_gpt(layers=4, batch_size=8, seq_len=128, d_model=128, dropout=0.1)
    return model, batch, loss_fn or remat.default_loss, torch.optim.AdamW, list(model.h), "op"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.97, 0.93, 0.9, 0.85, 0.8, 0.75])
    ap.add_argument("--same-plans", action="store_true", help="both predictors on the same measured plans")
    ap.add_argument("--saved-set", action="store_true", help="the partitioner's saved bytes against the compiled peak")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, inductor, fallback_random; {torch.get_num_threads()} threads")
    if args.saved_set:
        with torch._inductor.config.patch(fallback_random=True):
            for name, make in (("conv net with BatchNorm", conv_net), ("4-block GPT (benchmarks/plans/compiled.py's)", gpt4)):
                saved_set(name, make)
        return
    if args.same_plans:
        with torch._inductor.config.patch(fallback_random=True):
            for name, make, how in (("2-block GPT", gpt, "whole"), ("conv net with BatchNorm", conv_net, "whole"),
                                    ("conv net with BatchNorm", conv_net, "per block"),
                                    ("4-block GPT (benchmarks/plans/compiled.py's)", gpt4, "whole")):
                same_plans(name, make, how)
        return
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
