"""remat's plans under torch.compile, against torch.compile's own activation_memory_budget (run by hand).

    python benchmarks/compiled.py [--layers 4] [--d-model 128] [--batch 8] [--seq 128] [--repeats 5]
                                 [--device cuda] [--out FILE]           # ~10 min on 2 CPU cores

The built-in GPT decoder (dropout 0.1), AdamW. Rows:

  eager plans     remat's checked plans at budgets from its least peak to no checkpointing, plus "every
                  block", each run eagerly (remat's prediction, the checked peak) and compiled
                  (``torch.compile(model)`` after checkpointing, as remat's README says)
  compile budget  the plain model compiled with ``torch._functorch.config.activation_memory_budget`` at
                  0, 0.25, 0.5, 0.75 and 1 (compile's own min-cut/knapsack recomputation)

Every compiled row's peak is measured by the profiler's allocator-level memory events on CPU (what compiled
kernels allocate is invisible to remat's dispatch-level tracker), by the allocator on CUDA: parameters,
gradients, optimizer state and the batch alive before the step plus the step's own allocations (forward,
backward, optimizer step; gradients start as None). Step times: median of --repeats steps after two
warm-up steps. Inductor's own random numbers are used (the default; with ``fallback_random`` compile saves
dropout outputs instead of replaying them). Note: with activation_memory_budget < 1, PyTorch issue
#190758 reports that compile's partitioner may recompute dropout with fresh random numbers (wrong
gradients); remat's checkpoints replay the RNG (tests/integration/test_compile.py).

Writes benchmarks/results/compile-<device>.md and prints it.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import remat
from remat._compat import profiler_memory_peak
from remat.examples import make_gpt
from remat.measure import outside_autocast, split_inputs, tensor_bytes
from remat.plan import fmt_bytes

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def measure_compiled(model, inputs, loss_fn, device: torch.device, repeats: int = 5, *,
                     memory_budget: float | None = None) -> dict:
    """Compile ``model`` (with compile's ``activation_memory_budget`` when given) and measure whole training
    steps (AdamW): compile time, the allocator-level peak, the bytes saved for backward, median step time."""
    import torch._functorch.config as fconfig

    args, kwargs = split_inputs(inputs)
    torch._dynamo.reset()
    patch = fconfig.patch(activation_memory_budget=memory_budget) if memory_budget is not None else _Null()
    with patch:
        compiled = torch.compile(model)
        opt = adamw(model.parameters())
        saved: dict[int, int] = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        def step(record: bool = False):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if record else _Null():
                loss = loss_fn(compiled(*args, **kwargs))
            with outside_autocast():
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        t0 = time.perf_counter()
        step()  # compiles (and creates the optimizer state)
        compile_s = time.perf_counter() - t0
        step(record=True)
        step()
        state = [*model.parameters(), *model.buffers(), *(t for t in args if torch.is_tensor(t)),
                 *(t for t in kwargs.values() if torch.is_tensor(t)),
                 *(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))]
        if device.type == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats(device)
            step()
            sync()
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = tensor_bytes(state, device) + profiler_memory_peak(step, device)
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
    return dict(peak=peak, saved=sum(saved.values()), step_s=statistics.median(times), compile_s=compile_s)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)

    def factory():
        return make_gpt(layers=args.layers, batch_size=args.batch, seq_len=args.seq, d_model=args.d_model,
                        dropout=0.1, device=str(device))

    model, inputs, loss_fn = factory()
    loss_fn = loss_fn or remat.default_loss
    planner = remat.Planner(remat.make_profile(model, inputs, loss_fn=loss_fn, optimizer=adamw(model.parameters())),
                            granularity="op")
    lo, hi = planner.min_peak_bytes, planner.baseline_peak_bytes
    plans = [("none", planner.no_checkpointing()), ("every block", planner.every_nth_block(1))]
    for f in (0.0, 0.33, 0.67):
        budget = int(lo + f * (hi - lo))
        plans.append((f"remat @ {fmt_bytes(budget)}", remat.checked_plan(model, inputs, planner, budget, loss_fn=loss_fn)))

    rows = []
    for name, plan in plans:
        m, inp, _ = factory()
        remat.apply_plan(m, plan)
        eager = remat.measure_step(m, inp, loss_fn=loss_fn, optimizer_factory=adamw, repeats=args.repeats)
        comp = measure_compiled(m, inp, loss_fn, device, args.repeats)
        rows.append(dict(name=name, units=len(plan.checkpointed), selective=sum("@ops" in u for u in plan.checkpointed),
                         predicted=plan.predicted_peak_bytes, eager_peak=eager.peak_bytes, eager_s=eager.step_time_s,
                         **comp))
        print(rows[-1], flush=True)
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        m, inp, _ = factory()
        comp = measure_compiled(m, inp, loss_fn, device, args.repeats, memory_budget=frac)
        rows.append(dict(name=f"compile, activation_memory_budget={frac}", units=None, selective=None, predicted=None,
                         eager_peak=None, eager_s=None, **comp))
        print(rows[-1], flush=True)

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# remat under torch.compile on {device.type}", "",
             f"Measured {when} on {platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}, "
             f"remat {remat.__version__}. GPT {args.layers} x {args.d_model}, batch {args.batch} x {args.seq}, "
             "dropout 0.1, AdamW. Peaks of a whole step; compiled peaks by the profiler's allocator-level memory "
             "events (CPU) or the allocator (CUDA); eager peaks by remat's meter.", "",
             "| plan | units (@ops) | predicted (eager) | eager peak | compiled peak | compiled saved for backward "
             "| eager step | compiled step | compile time |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        def mb(x):
            return "-" if x is None else fmt_bytes(x)

        def ms(x):
            return "-" if x is None else f"{x * 1e3:.1f} ms"

        units = "-" if r["units"] is None else f"{r['units']} ({r['selective']})"
        lines.append(f"| {r['name']} | {units} | {mb(r['predicted'])} | {mb(r['eager_peak'])} | {mb(r['peak'])} | "
                     f"{mb(r['saved'])} | {ms(r['eager_s'])} | {ms(r['step_s'])} | {r['compile_s']:.0f} s |")
    text = "\n".join(lines) + "\n"
    out = Path(args.out) if args.out else RESULTS / f"compile-{device.type}.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
