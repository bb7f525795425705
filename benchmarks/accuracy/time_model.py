"""The device time model held against real steps on this machine (issue #40).

remat plans a modelled target by the device model's times (remat.costs.device_time: a roofline per operator);
here the target is this machine's own CPU (``Target(device="cpu")``: its matmul FLOP/s, copy bandwidth and
per-operator dispatch measured by a few microbenchmarks, cached), so each plan can be run for real. For the
built-in GPT, a Hugging Face Llama and the built-in U-Net, at four budgets between the least peak and no
checkpointing's:

* the plan chosen by the modelled times and the plan chosen by measured times (remat's default) are both run,
  interleaved, and their measured step times compared (the issue asks the modelled choice within 5%);
* every distinct plan's modelled step time is compared with its measured one (within +-25% asked), and the rank
  correlation (Spearman) of modelled against measured step times over the plans is reported.

Timing is meaningful only on a quiet machine: run it alone. Each model takes about a minute on 2 cores.

    python benchmarks/accuracy/time_model.py
    python benchmarks/accuracy/time_model.py --models gpt --repeats 7
"""

from __future__ import annotations

import argparse
import statistics

import torch

import remat
from remat.check.steps import measure_plans
from remat.errors import InfeasibleBudgetError
from remat.examples import make_gpt, make_unet

MiB = 2**20


def hf_llama():
    """A small Hugging Face Llama from a config (4 layers, width 256, 4 x 128 tokens), its loss from labels."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 2048, (4, 128), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}, None


MODELS = {
    "gpt": lambda: make_gpt(layers=4, batch_size=8, seq_len=128, d_model=256),
    "hf-llama": hf_llama,
    "unet": lambda: make_unet(),
}


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    if n < 3:
        return float("nan")
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def compare(name: str, repeats: int) -> dict:
    model, inputs, loss_fn = MODELS[name]()
    opt = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    measured = remat.make_profile(model, inputs, loss_fn=loss_fn, optimizer=opt(model.parameters()))
    modelled = remat.make_profile(model, inputs, loss_fn=loss_fn, optimizer=opt(model.parameters()),
                                  target=remat.Target(device="cpu"))
    by_measured, by_model = remat.Planner(measured), remat.Planner(modelled)
    lo, hi = by_measured.min_peak_bytes, by_measured.baseline_peak_bytes
    budgets = [int(lo + (hi - lo) * f) for f in (0.1, 0.35, 0.6, 0.85)]
    chosen = []
    for b in budgets:
        try:
            chosen.append((b, by_measured.plan_for_budget(b), by_model.plan_for_budget(b)))
        except InfeasibleBudgetError:
            continue
    plans = {}
    for _, m, c in chosen:
        plans.setdefault(m.checkpointed, m)
        plans.setdefault(c.checkpointed, c)
    plans.setdefault((), by_measured.no_checkpointing())
    keys = list(plans)
    readings = measure_plans(model, inputs, [plans[k] for k in keys], loss_fn=loss_fn, optimizer_factory=opt,
                             warmup_s=2.0, repeats=repeats, output_alive=True)
    step = {k: r.step_time_s for k, r in zip(keys, readings)}
    predicted = {k: by_model.make_plan(k, "x").predicted_step_time_s for k in keys}
    rows = [(b, m.checkpointed, c.checkpointed, step[m.checkpointed], step[c.checkpointed]) for b, m, c in chosen]
    errors = {k: predicted[k] / step[k] - 1 for k in keys}
    return dict(name=name, rows=rows, errors=errors, predicted=predicted, step=step,
                spearman=spearman([predicted[k] for k in keys], [step[k] for k in keys]),
                rates=next((n for n in modelled.notes if "device model" in n), ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per plan (x2, interleaved; default 5)")
    a = p.parse_args()
    print("Plans chosen by the modelled CPU's times against plans chosen by measured times, measured here")
    print(f"{'model':<9} | {'budget MiB':>10} | {'measured choice':>15} | {'modelled choice':>15} | "
          f"{'measured ms (m / c)':>19} | {'c vs m':>7}")
    summary = []
    for name in a.models.split(","):
        r = compare(name, a.repeats)
        for b, m, c, sm, sc in r["rows"]:
            print(f"{name:<9} | {b / MiB:>10.1f} | {len(m):>9} units | {len(c):>9} units | "
                  f"{sm * 1e3:>8.2f} / {sc * 1e3:>8.2f} | {sc / sm - 1:>+7.1%}" + ("" if m != c else "  (same plan)"))
        summary.append(r)
    print()
    print("Modelled against measured step time, every distinct plan")
    print(f"{'model':<9} | {'plans':>5} | {'error: least':>12} | {'median':>7} | {'largest':>8} | {'Spearman':>8}")
    for r in summary:
        errs = sorted(r["errors"].values(), key=abs)
        print(f"{r['name']:<9} | {len(errs):>5} | {errs[0]:>+12.1%} | {statistics.median(errs):>+7.1%} | "
              f"{errs[-1]:>+8.1%} | {r['spearman']:>8.2f}")
    for r in summary:
        for k in r["step"]:
            print(f"  {r['name']}: {len(k):>2} units: modelled {r['predicted'][k] * 1e3:7.2f} ms, measured "
                  f"{r['step'][k] * 1e3:7.2f} ms ({r['errors'][k]:+.1%})")
    from remat.target.timing import measured_cpu_spec
    from remat.profile import cache

    spec = measured_cpu_spec()
    print(f"this CPU as a device: {spec.fp32_flops_per_s / 1e9:.0f} GFLOP/s float32, {spec.hbm_bytes_per_s / 1e9:.0f} "
          f"GB/s elementwise, " + ", ".join(f"{k} {v:.3g}" for k, v in cache.device_rates(dict)[0].items()
                                            if k in ("random_bytes_per_s", "dispatch_s", "bf16_flops_per_s")
                                            or k.endswith("_efficiency")))
    print(f"threads: {torch.get_num_threads()}; measured on this machine (CPU), the modelled figures predicted")


if __name__ == "__main__":
    main()
