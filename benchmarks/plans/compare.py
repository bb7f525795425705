"""remat against its peers, side by side, measured in one process on the same batch (run by hand).

    python benchmarks/plans/compare.py [--models gpt12,gpt24,unet,resnet,llama] [--device cuda] [--points 5]
                                 [--compile] [--repeats 5]

For every model: profile once, then at --points budgets from the least achievable peak to the
no-checkpointing peak measure (peak memory of a whole training step with AdamW, median step time
after a warm-up):

  remat            the checked ILP plan for the budget
  none             no checkpointing (the memory ceiling and the speed floor)
  every_block      Hugging Face's gradient_checkpointing_enable / torchtitan's "full" AC
  every_2nd/3rd    torchtitan's selective-by-layer AC
  chen_sqrt        checkpoint_sequential's sqrt(n) segments, where the blocks sit in an nn.Sequential
  greedy           most freed bytes per second of recompute first, until the budget is met
  torch.compile    with torch._functorch.config.activation_memory_budget at the same fraction of the
                   way from the least to the full activation memory (--compile; slow on CPU), its peak
                   by the profiler's allocator-level memory events on CPU (benchmarks/plans/compiled.py).
  sac_milp         PyTorch's own module-level ILP (torch.distributed._tools.sac_ilp), where it runs.

Writes benchmarks/results/<model>-<device>.md and .png and SUMMARY-<device>.md, and prints the summary.
Ratios: remat's measured step time over the fastest peer that met the same budget (<= 1.00 is a win;
timings on a shared CPU drift by several percent).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks" / "plans"))

import remat  # noqa: E402
from remat import Planner, make_profile  # noqa: E402
from remat.costs.unit_costs import is_selective  # noqa: E402
from remat.examples import make_gpt, make_unet  # noqa: E402
from compiled import measure_compiled  # noqa: E402
from remat.solve.plan import fmt_bytes  # noqa: E402
from remat.sweeps.report import TradeoffRow, budget_sweep, plot_rows, tradeoff  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def models(device: str, large: bool):
    """name -> factory returning (model, inputs, loss_fn). --device cuda uses larger sizes."""
    s = 4 if large else 1
    out = {
        "gpt4": lambda: make_gpt(layers=4, batch_size=8 * s, seq_len=64 * s, d_model=128 * s, device=device),
        "gpt12": lambda: make_gpt(layers=12, batch_size=8 * s, seq_len=64 * s, d_model=128 * s, device=device),
        "gpt24": lambda: make_gpt(layers=24, batch_size=8 * s, seq_len=64 * s, d_model=128 * s, device=device),
        "unet": lambda: make_unet(batch_size=4 * s, image_size=64 * s, device=device),
    }

    def resnet():
        from real_models import ResNet
        import torch.nn.functional as F

        torch.manual_seed(0)
        x = torch.randn(8 * s, 3, 64 * s, 64 * s, device=device)
        y = torch.randint(0, 10, (8 * s,), device=device)
        return ResNet().to(device).train(), (x,), lambda o: F.cross_entropy(o, y)

    out["resnet"] = resnet

    def llama():
        try:
            from hf_finetune import build
        except ImportError as e:  # transformers missing
            raise RuntimeError(f"skipped: {e}") from e
        model, batch = build(seq_len=128 * s, batch_size=8 * s)
        return model.to(device), {k: v.to(device) for k, v in batch.items()}, None

    out["llama"] = llama
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def compile_rows(factory, planner: Planner, budgets: list[int], device: torch.device, repeats: int) -> list[dict]:
    """torch.compile with activation_memory_budget at the budget's fraction of the activation range."""
    rows = []
    lo, hi = planner.min_peak_bytes, planner.baseline_peak_bytes
    for b in budgets:
        frac = min(max((b - lo) / (hi - lo), 0.0), 1.0) if hi > lo else 1.0
        model, inputs, loss_fn = factory()
        r = measure_compiled(model, inputs, loss_fn or remat.default_loss, device, repeats, memory_budget=frac)
        rows.append(dict(budget=b, fraction=frac, step_s=r["step_s"], peak=r["peak"], saved_bytes=r["saved"],
                         compile_s=r["compile_s"]))
    return rows


SAC_PROBE = r"""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.runtime_estimator import RuntimeEstimator
from torch.distributed._tools.sac_estimator import SACEstimator
from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
from torch.distributed._tools.sac_ilp import sac_milp
from remat.examples import GPT
dev = torch.device("{device}")
with FakeTensorMode(allow_non_fake_inputs=True), torch.device(dev):
    model = GPT(512, 64, 128, 4, 4, 0.1).train()
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.randint(0, 512, (8, 64), device=dev)
    mem, rt, sac = MemTracker(), RuntimeEstimator(), SACEstimator()
    mem.track_external(model, opt)
    with mem, rt("operator-level-cost-model"), sac("operator-level-cost-model"):
        model(idx, idx).backward(); opt.step(); opt.zero_grad()
graph = parse_module_info(aggregate_stats(model, mem, rt, sac, dev))
print(sac_milp(graph, 0.05))
"""


def sac_milp_status(device: str) -> str:
    """Whether PyTorch's sac_milp pipeline runs here (in a subprocess: it can abort the process)."""
    try:
        out = subprocess.run([sys.executable, "-c", SAC_PROBE.format(device=device)], capture_output=True,
                             text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "did not finish in 300 s"
    if out.returncode == 0:
        return "runs (translation of its discard ratios into plans is not implemented yet)"
    tail = (out.stderr.strip().splitlines() or ["?"])[-1][:160]
    return f"does not run on {device} with torch {torch.__version__}: exit {out.returncode}, {tail!r}"


def _solve(r: TradeoffRow) -> str:
    return "-" if r.solve_time_s is None else f"{r.solve_time_s:.2f} s"


def _op(r: TradeoffRow | None) -> str:
    if r is None or r.measured_step_time_s is None:
        return "-"
    n_sel = sum(is_selective(u) for u in r.checkpointed)
    return f"{r.measured_step_time_s * 1e3:.1f} ms ({fmt_bytes(r.measured_peak_bytes)}; {n_sel} selective)"


def summarize(name: str, rows: list[TradeoffRow], comp: list[dict]) -> tuple[str, dict]:
    """Markdown table and headline numbers of one model."""
    peers = [r for r in rows if not r.strategy.startswith("remat") and r.measured_peak_bytes is not None]
    mine = [r for r in rows if r.strategy == "remat"]
    ops = {r.budget_bytes: r for r in rows if r.strategy == "remat-op"}
    none = next(r for r in rows if r.strategy == "none")
    lines = [
        "| budget | remat peak (pred / meas) | remat step | best peer within budget | its peak | its step | "
        "time ratio | overhead remat / peer | remat solve | remat-op step (peak) |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    ratios, errs, lost = [], [], []
    for r in mine:
        fits = [p for p in peers if p.measured_peak_bytes <= r.budget_bytes and
                (p.budget_bytes is None or p.budget_bytes == r.budget_bytes)]
        best = min(fits, key=lambda p: p.measured_step_time_s, default=None)
        if r.measured_peak_bytes is None:
            lines.append(f"| {fmt_bytes(r.budget_bytes)} | infeasible ({r.note}) | - | "
                         f"{best.strategy if best else '-'} | - | - | - | - | - | - |")
            if best is not None:
                lost.append((fmt_bytes(r.budget_bytes), best.strategy))
            continue
        errs.append((r.predicted_peak_bytes - r.measured_peak_bytes) / r.measured_peak_bytes)
        if best is None:
            lines.append(f"| {fmt_bytes(r.budget_bytes)} | {fmt_bytes(r.predicted_peak_bytes)} / "
                         f"{fmt_bytes(r.measured_peak_bytes)} | {r.measured_step_time_s * 1e3:.1f} ms | none meets it | "
                         f"- | - | - | - | {_solve(r)} | {_op(ops.get(r.budget_bytes))} |")
            continue
        ratio = r.measured_step_time_s / best.measured_step_time_s
        ratios.append(ratio)
        o_me = r.measured_step_time_s / none.measured_step_time_s - 1
        o_peer = best.measured_step_time_s / none.measured_step_time_s - 1
        o_ratio = f"{o_me / o_peer:.2f}" if o_peer > 0.005 else "-"
        lines.append(
            f"| {fmt_bytes(r.budget_bytes)} | {fmt_bytes(r.predicted_peak_bytes)} / {fmt_bytes(r.measured_peak_bytes)}"
            f" | {r.measured_step_time_s * 1e3:.1f} ms | {best.strategy} | {fmt_bytes(best.measured_peak_bytes)} | "
            f"{best.measured_step_time_s * 1e3:.1f} ms | {ratio:.2f} | {o_ratio} | {_solve(r)} | "
            f"{_op(ops.get(r.budget_bytes))} |")
    least = {}
    for r in rows:
        if r.measured_peak_bytes is not None:
            least[r.strategy] = min(least.get(r.strategy, 1 << 62), r.measured_peak_bytes)
    lines += ["", "Least measured peak each strategy reached:", "",
              "| strategy | least peak |", "|---|---:|"]
    lines += [f"| {k} | {fmt_bytes(v)} |" for k, v in sorted(least.items(), key=lambda kv: kv[1])]
    if comp:
        lines += ["", "torch.compile with activation_memory_budget (same fraction of the range):", "",
                  "| budget | activation_memory_budget | saved for backward | peak | step | compile |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for c in comp:
            lines.append(f"| {fmt_bytes(c['budget'])} | {c['fraction']:.2f} | {fmt_bytes(c['saved_bytes'])} | "
                         f"{fmt_bytes(c['peak']) if c['peak'] is not None else 'not measurable on CPU'} | "
                         f"{c['step_s'] * 1e3:.1f} ms | {c['compile_s']:.0f} s |")
    head = dict(
        model=name,
        worst_ratio=max(ratios, default=None),
        median_ratio=statistics.median(ratios) if ratios else None,
        worst_pred_err=max(errs, key=abs, default=None),
        remat_least=least.get("remat"),
        every_block_least=least.get("every_block"),
        lost=lost,
    )
    return "\n".join(lines), head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt12,gpt24,unet,resnet,llama")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--large", action="store_true", help="4x sizes (for a GPU)")
    ap.add_argument("--points", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also torch.compile with activation_memory_budget")
    ap.add_argument("--no-sac", action="store_true", help="skip the sac_milp probe")
    ap.add_argument("--tag", default="", help="suffix for the result files (keeps other runs' files)")
    args = ap.parse_args()
    device = torch.device(args.device)
    RESULTS.mkdir(parents=True, exist_ok=True)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads" + (
        f", {torch.cuda.get_device_name()}" if device.type == "cuda" else "")
    header = f"Measured {when} on {machine}; torch {torch.__version__}, remat {remat.__version__}, AdamW."
    sac = "not probed" if args.no_sac else sac_milp_status(args.device)
    print(f"sac_milp: {sac}", flush=True)
    factories = models(args.device, args.large)
    heads = []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        try:
            model, inputs, loss_fn = factories[name]()
        except RuntimeError as e:
            print(f"{name}: {e}", flush=True)
            continue
        loss_fn = loss_fn or remat.default_loss
        remat.measure_step(model, inputs, loss_fn=loss_fn, optimizer_factory=adamw, warmup=5, repeats=0,
                           measure_memory=False)  # warm the process up before profiling
        profile = make_profile(model, inputs, loss_fn=loss_fn, optimizer=adamw(model.parameters()))
        planner = Planner(profile)
        rules = [planner.no_checkpointing(), planner.every_nth_block(1), planner.every_nth_block(2),
                 planner.every_nth_block(3)]
        chen = planner.chen_sqrt()
        rules += [chen] if chen is not None else []
        budgets = budget_sweep(planner, args.points)
        rows = tradeoff(model, inputs, profile, loss_fn=loss_fn, optimizer_factory=adamw, budgets=budgets,
                        planner=planner, hand_rules=rules, greedy=True, repeats=args.repeats,
                        granularities=("block", "op"))
        comp = compile_rows(factories[name], planner, budgets, device, args.repeats) if args.compile else []
        table, head = summarize(name, rows, comp)
        md = RESULTS / f"{name}-{args.device}{args.tag}.md"
        md.write_text(f"# {name} on {args.device}\n\n{header}\n\nsac_milp: {sac}\n\n{table}\n\n"
                      f"![{name}]({name}-{args.device}{args.tag}.png)\n")
        plot_rows(rows, RESULTS / f"{name}-{args.device}{args.tag}.png", f"{name} on {args.device}")
        heads.append(head)
        print(f"{name}: {time.perf_counter() - t0:.0f} s; worst time ratio "
              f"{head['worst_ratio'] if head['worst_ratio'] is None else round(head['worst_ratio'], 2)}, "
              f"worst prediction error {head['worst_pred_err']:+.1%}; least peak remat "
              f"{fmt_bytes(head['remat_least'])} vs every_block {fmt_bytes(head['every_block_least'])}", flush=True)
    lines = [f"# remat vs peers on {args.device}", "", header, "", f"sac_milp: {sac}", "",
             "| model | worst time ratio | median time ratio | worst predicted-vs-measured | least peak remat | "
             "least peak every_block | budgets a peer met and remat did not |", "|---|---:|---:|---:|---:|---:|---|"]
    for h in heads:
        lines.append(
            f"| {h['model']} | {h['worst_ratio']:.2f} | {h['median_ratio']:.2f} | {h['worst_pred_err']:+.1%} | "
            f"{fmt_bytes(h['remat_least'])} | {fmt_bytes(h['every_block_least'])} | "
            f"{', '.join(f'{b} ({s})' for b, s in h['lost']) or 'none'} |" if h["worst_ratio"] is not None else
            f"| {h['model']} | - | - | {h['worst_pred_err']:+.1%} | {fmt_bytes(h['remat_least'])} | "
            f"{fmt_bytes(h['every_block_least'])} | {', '.join(f'{b} ({s})' for b, s in h['lost']) or 'none'} |")
    (RESULTS / f"SUMMARY-{args.device}{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
