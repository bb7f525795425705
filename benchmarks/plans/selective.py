"""Op-level (selective) plans against block-level plans at the same budgets, measured (run by hand).

    python benchmarks/plans/selective.py [--models gpt-d512,gpt-d512-nodrop,llama-d512,gpt-d128] [--points 4]
                                   [--repeats 10] [--device cuda] [--tag NAME]   # ~20 min on 2 CPU cores

For every model: profile once; budgets at --points evenly from the least achievable peak to the
no-checkpointing peak, plus the *halfway* budget between the predicted peaks of "checkpoint every
block" and "no checkpointing". At each budget remat's checked plan with granularity="block" and
with granularity="op" are measured side by side (peak of a whole training step with AdamW; median
step time, plans timed round-robin each on its own copy after a warm-up), and every op-level plan
is run through the gradient/buffer equivalence check.

Columns: overhead = median step time less the no-checkpointing plan's (measured), or the predicted
recompute time (pred.). "op/block" is the op-level plan's overhead over the block-level plan's;
below 1 the op-level plan bought the same budget for less recompute. "op - block per round": the
plans are timed round-robin, so each round gives one paired difference of step times; its median and
quartiles say whether a difference stands out of this machine's noise ("slower" only when even the
lower quartile is above 0).

Writes benchmarks/results/selective-<device>[-tag].md and .json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

import remat  # noqa: E402
from remat import Planner, make_profile  # noqa: E402
from remat.costs.unit_costs import is_selective  # noqa: E402
from remat.examples import make_gpt  # noqa: E402
from remat.solve.plan import fmt_bytes  # noqa: E402
from remat import TradeoffRow, tradeoff  # noqa: E402
from remat.sweeps.report import budget_sweep  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def models(device: str) -> dict:
    """name -> (description, factory returning (model, inputs, loss_fn))."""
    def gpt(d, t, heads, drop, layers=4, batch=8):
        desc = f"GPT decoder, {layers} layers, d_model={d}, seq_len={t}, {heads} heads, batch {batch}, dropout {drop}"
        return desc, lambda: make_gpt(layers=layers, batch_size=batch, seq_len=t, d_model=d, heads=heads,
                                      vocab=512, dropout=drop, device=device)

    out = {
        "gpt-d512": gpt(512, 256, 8, 0.1),
        "gpt-d512-nodrop": gpt(512, 256, 8, 0.0),
        "gpt-d128": gpt(128, 64, 4, 0.1),
        "gpt-d1024": gpt(1024, 512, 16, 0.0, layers=8, batch=8),  # for a GPU
    }

    def llama():
        import transformers as T

        torch.manual_seed(0)
        cfg = T.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                            bos_token_id=0, eos_token_id=0)
        ids = torch.randint(0, 512, (8, 256), generator=torch.Generator().manual_seed(1)).to(device)
        return T.LlamaForCausalLM(cfg).to(device).train(), {"input_ids": ids, "labels": ids}, None

    out["llama-d512"] = ("HF Llama (transformers), 4 layers, hidden 512, 8 heads / 4 KV heads, SwiGLU 1408, "
                         "seq_len 256, batch 8, SDPA attention", llama)
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def run(name: str, desc: str, factory, device: torch.device, points: int, repeats: int) -> dict:
    model, inputs, loss_fn = factory()
    loss_fn = loss_fn or remat.default_loss
    t0 = time.perf_counter()
    profile = make_profile(model, inputs, loss_fn=loss_fn, optimizer=adamw(model.parameters()))
    profile_s = time.perf_counter() - t0
    block, op = Planner(profile), Planner(profile, granularity="op")
    every, none = block.every_nth_block(1), block.no_checkpointing()
    halfway = (every.predicted_peak_bytes + none.predicted_peak_bytes) // 2
    budgets = sorted({*budget_sweep(block, points)[:-1], halfway})
    rows = tradeoff(model, inputs, profile, loss_fn=loss_fn, optimizer_factory=adamw, budgets=budgets,
                    planner=block, hand_rules=[none, every], granularities=("block", "op"), repeats=repeats,
                    progress=lambda m: print(f"  [{name}] {m}", flush=True))
    plain = next(r for r in rows if r.strategy == "none")
    base_pred = plain.predicted_step_time_s

    def pick(strategy: str, budget: int) -> TradeoffRow | None:
        return next((r for r in rows if r.strategy == strategy and r.budget_bytes == budget), None)

    table = []
    for b in budgets:
        rb, ro = pick("remat", b), pick("remat-op", b)
        if rb is None or ro is None or rb.measured_step_time_s is None or ro.measured_step_time_s is None:
            continue
        equal = None
        if any(is_selective(u) for u in ro.checkpointed):
            m, inp, lf = factory()
            remat.apply_plan(m, op.make_plan(ro.checkpointed, "check"))
            equal = remat.check_equivalence(m, inp, loss_fn=lf or remat.default_loss).equal
        paired = sorted(o - b for o, b in zip(ro.measured_step_times_s, rb.measured_step_times_s))
        q = (lambda f: paired[min(int(f * len(paired)), len(paired) - 1)] if paired else None)  # noqa: E731
        over_b = rb.measured_step_time_s - plain.measured_step_time_s
        over_o = ro.measured_step_time_s - plain.measured_step_time_s
        pred_b = rb.predicted_step_time_s - base_pred
        pred_o = ro.predicted_step_time_s - base_pred
        table.append(dict(
            budget_bytes=b, halfway=b == halfway,
            block_units=list(rb.checkpointed), op_units=list(ro.checkpointed),
            selective_units=sum(is_selective(u) for u in ro.checkpointed),
            block_peak_bytes=rb.measured_peak_bytes, op_peak_bytes=ro.measured_peak_bytes,
            block_step_s=rb.measured_step_time_s, op_step_s=ro.measured_step_time_s,
            block_overhead_s=over_b, op_overhead_s=over_o,
            predicted_block_overhead_s=pred_b, predicted_op_overhead_s=pred_o,
            measured_ratio=over_o / over_b if over_b > 0 else None,
            predicted_ratio=pred_o / pred_b if pred_b > 0 else None,
            budget_met=bool(rb.budget_met and ro.budget_met), equivalent=equal,
            paired_diff_s=dict(q25=q(0.25), median=q(0.5), q75=q(0.75), rounds=len(paired)),
        ))
    return dict(name=name, description=desc, profile_s=profile_s, plain_step_s=plain.measured_step_time_s,
                plain_peak_bytes=plain.measured_peak_bytes, every_block_peak_bytes=every.predicted_peak_bytes,
                halfway_bytes=halfway, least_block_bytes=block.min_peak_bytes, least_op_bytes=op.min_peak_bytes,
                rows=table)


def markdown(results: list[dict], meta: dict) -> str:
    out = [f"# Op-level vs block-level plans ({meta['device']})", "",
           f"`python benchmarks/plans/selective.py` on {meta['machine']}, torch {meta['torch']}, {meta['date'][:10]}. "
           "Peaks and step times measured (AdamW step included; plans timed round-robin on their own copies); "
           "'pred.' columns are the profile's predictions. overhead = step time - no-checkpointing step time.", ""]
    for r in results:
        out += [f"## {r['name']}: {r['description']}", "",
                f"No checkpointing: {r['plain_step_s'] * 1e3:.1f} ms, {fmt_bytes(r['plain_peak_bytes'])} (measured). "
                f"Halfway budget {fmt_bytes(r['halfway_bytes'])} (between every block, "
                f"{fmt_bytes(r['every_block_peak_bytes'])} predicted, and none). Least achievable peak, predicted: "
                f"block {fmt_bytes(r['least_block_bytes'])}, op {fmt_bytes(r['least_op_bytes'])}.", "",
                "| budget | block: overhead (pred.) | op: overhead (pred.) | op/block measured | op/block pred. "
                "| op - block per round: median [q25, q75] | selective units | peaks block / op | budget met "
                "| gradients equal |",
                "|---|---:|---:|---:|---:|---|---:|---|---|---|"]
        for x in r["rows"]:
            ratio = "-" if x["measured_ratio"] is None else f"{x['measured_ratio']:.2f}"
            pratio = "-" if x["predicted_ratio"] is None else f"{x['predicted_ratio']:.2f}"
            eq = "-" if x["equivalent"] is None else ("yes" if x["equivalent"] else "NO")
            d = x["paired_diff_s"]
            if x["op_units"] == x["block_units"]:
                paired = "same plan"
            else:
                verdict = "slower" if d["q25"] > 0 else ("faster" if d["q75"] < 0 else "within noise")
                paired = (f"{d['median'] * 1e3:+.1f} ms [{d['q25'] * 1e3:+.1f}, {d['q75'] * 1e3:+.1f}] "
                          f"{verdict}")
            out.append(
                f"| {fmt_bytes(x['budget_bytes'])}{' (halfway)' if x['halfway'] else ''} "
                f"| {x['block_overhead_s'] * 1e3:.1f} ms ({x['predicted_block_overhead_s'] * 1e3:.1f}) "
                f"| {x['op_overhead_s'] * 1e3:.1f} ms ({x['predicted_op_overhead_s'] * 1e3:.1f}) "
                f"| {ratio} | {pratio} | {paired} | {x['selective_units']}/{len(x['op_units'])} "
                f"| {fmt_bytes(x['block_peak_bytes'])} / {fmt_bytes(x['op_peak_bytes'])} "
                f"| {'yes' if x['budget_met'] else 'NO'} | {eq} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt-d512,gpt-d512-nodrop,llama-d512,gpt-d128")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--points", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10, help="rounds of interleaved timing, halved")
    ap.add_argument("--tag", default="", help="suffix for the result files")
    a = ap.parse_args()
    device = torch.device(a.device)
    table = models(a.device)
    results = []
    for name in a.models.split(","):
        desc, factory = table[name]
        print(f"{name}: {desc}", flush=True)
        results.append(run(name, desc, factory, device, a.points, a.repeats))
    meta = dict(device=a.device, torch=torch.__version__, remat=remat.__version__, machine=platform.platform(),
                date=datetime.now(timezone.utc).isoformat(),
                gpu=torch.cuda.get_device_name() if a.device == "cuda" else None)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"selective-{a.device}{'-' + a.tag if a.tag else ''}"
    md = markdown(results, meta)
    (RESULTS / f"{stem}.md").write_text(md)
    (RESULTS / f"{stem}.json").write_text(json.dumps(dict(meta=meta, results=results), indent=2))
    print(md)


if __name__ == "__main__":
    main()
