"""Keep, recompute or offload (issue #50): remat's plans for torchtitan's Llama 3 8B on 8 H100s (96 GB), FSDP,
local batch 2 x 8192, AdamW, clipping at 1.0, with and without offloading offered; every figure predicted on
this CPU, not measured.

For budgets from the least peak to no checkpointing's (the planner's allocated peak, as the ILP sees it), the
fastest plan without offloading and the fastest with it: their predicted step time and tokens/s per GPU, the
bytes each keeps, recomputes and offloads, and the copies' predicted exposed time; the chosen plans' reserved
peaks replayed through the allocator. Then the same budgets with the host link made slow (1 GB/s each way):
offloading should not be chosen. Beside them full checkpointing, from the same recording, and torchtitan's op
policy (its own selective checkpointing, recorded by ``benchmarks/targets/published.py``).

    python benchmarks/targets/offload.py                # the table (about 5 minutes on 2 cores)
    python benchmarks/targets/offload.py --layers       # also keep / recompute / offload bytes per layer of each plan
    python benchmarks/targets/offload.py --planning-time [--budget 70]   # seconds `remat plan` takes, with and without
                                                                  # --offload (issue #60), each in a fresh process
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torchtitan_llama3 as tt  # noqa: E402

import remat  # noqa: E402
from remat.costs.offload import HostLink, link_from_spec  # noqa: E402
from remat.target.spec_file import device_spec  # noqa: E402
from remat.solve import Planner  # noqa: E402
from remat.target import Target  # noqa: E402
from remat.api.predict import predict_peaks  # noqa: E402

GiB = 2**30
FRACTIONS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


def _layer(unit: str) -> str:
    m = re.match(r"(?:offload:)?(model\.layers\.\d+)", unit)
    return m.group(1) if m else unit


def per_layer(planner: Planner, plan: remat.Plan) -> dict[str, tuple[int, int, int]]:
    """Per layer: bytes of saved activations kept, recomputed (dropped by checkpointing) and offloaded."""
    model = planner.model
    out: dict[str, list[int]] = {}
    for name, u in model.units.items():
        if re.fullmatch(r"model\.layers\.\d+", name):
            out[name] = [u.saved_bytes, 0, 0]
    for unit in plan.checkpointed:
        row = out.get(_layer(unit))
        if row is not None:
            freed = model.units[unit].droppable_bytes
            row[1] += freed
            row[0] -= freed
    for unit in plan.offloaded:
        row = out.get(_layer(unit))
        if row is not None:
            moved = model.offloads["offload:" + unit].nbytes
            row[2] += moved
            row[0] -= moved
    return {k: (max(v[0], 0), v[1], v[2]) for k, v in out.items()}


def planning_time(budgets: list[float]) -> None:
    """Issue #60: wall seconds of ``remat plan`` on the 8B for 8 H100s (96 GB), FSDP, at each budget, without and
    with ``--offload``, each run in a fresh process as a user runs it, and what it planned (predicted)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    print("remat plan benchmarks/targets/torchtitan_llama3.py:llama3_8b --device h100-96gb --world 8 --fsdp 8 (batch 2 x 8192, "
          "AdamW, output kept): wall seconds on this machine; figures of the plan predicted, not measured")
    print(f"{'budget GiB':>10} | {'offload':>7} | {'seconds':>7} | {'tokens/s per GPU':>16} | {'ckpt':>4} | "
          f"{'offl':>4} | solver")
    for budget in budgets:
        for offload in (False, True):
            cmd = [sys.executable, "-m", "remat", "plan", "benchmarks/targets/torchtitan_llama3.py:llama3_8b", "--device",
                   "h100-96gb", "--world", "8", "--fsdp", "8", "--budget", f"{budget:g}"] + (["--offload"] if offload
                                                                                           else [])
            t0 = time.perf_counter()
            out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"})
            wall = time.perf_counter() - t0
            text = out.stdout + out.stderr

            def find(pattern: str, default: str = "-") -> str:
                m = re.search(pattern, text)
                return m.group(1) if m else default
            tps, ckpt = find(r"predicted throughput:\s*([\d,]+) tokens/s"), find(r"checkpointed \((\d+)\)", "0")
            offl, solver = find(r"offloaded to host \((\d+)\)", "0"), find(r"solver (.*?), solved in")
            print(f"{budget:>10g} | {'yes' if offload else 'no':>7} | {wall:>7.1f} | {tps:>16} | {ckpt:>4} | "
                  f"{offl:>4} | {solver}", flush=True)
            if out.returncode:
                print(text[-2000:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", action="store_true", help="print keep / recompute / offload bytes per layer")
    p.add_argument("--planning-time", action="store_true",
                   help="only time `remat plan` with and without --offload (issue #60)")
    p.add_argument("--budget", type=float, action="append", help="GiB, with --planning-time (default 70)")
    a = p.parse_args()
    if a.planning_time:
        planning_time(a.budget or [70.0])
        return
    started = time.perf_counter()
    model, inputs, loss_fn, parallelize = tt.remat_target("8B", selective_ac=False)
    target = Target(device="h100-96gb", world=8, parallelize=parallelize, clip_grad_norm=1.0)
    opt = tt.build_optimizer(model.model)
    profile = remat.make_profile(model, inputs, loss_fn=loss_fn, optimizer=opt, output_alive=False, target=target)
    spec = target.spec
    # the H100's nominal PCIe Gen5 rate at the share the H200's measured copies reached (carried, not measured)
    fast = link_from_spec(spec, carried_from=device_spec("h200"))
    slow = HostLink(1e9, 1e9, source="1 GB/s")
    planners = {"none": Planner(profile, granularity="op"), "offload": Planner(profile, granularity="op", offload=fast),
                "slow": Planner(profile, granularity="op", offload=slow)}
    recorded = time.perf_counter() - started
    base = planners["none"]
    lo, hi = min(pl.min_peak_bytes for pl in planners.values()), base.baseline_peak_bytes
    layers = tuple(u for u in base.model.units if re.fullmatch(r"model\.layers\.\d+", u))
    full = base.make_plan(layers, "every layer")
    tps = profile.tokens_per_step
    print("Llama 3 8B (torchtitan's model), 8 H100 96 GB, FSDP, batch 2 x 8192, AdamW, clip 1.0; predicted, not "
          "measured")
    print(f"host link: {fast.source}; plain step "
          f"{profile.step_time_s:.3f} s (forward {profile.forward_s:.3f}, backward {profile.backward_s:.3f}); "
          f"least peak without offloading {base.min_peak_bytes / GiB:.2f} GiB, with {planners['offload'].min_peak_bytes / GiB:.2f}")
    print(f"full checkpointing: {full.predicted_step_time_s:.3f} s, {tps / full.predicted_step_time_s:,.0f} tokens/s "
          f"per GPU, allocated peak {full.predicted_peak_bytes / GiB:.2f} GiB")
    print()
    print(f"{'budget GiB':>10} | {'no offload: step s':>18} | {'tok/s':>6} | {'offload: step s':>15} | {'tok/s':>6} | "
          f"{'gain':>6} | {'ckpt':>4} | {'offl':>4} | {'offloaded GiB':>13} | {'exposed ms':>10} | "
          f"{'slow link: offl':>15} | {'reserved GiB (none/offload)':>27}")
    rows = []
    for f in FRACTIONS:
        budget = int(lo + f * (hi - lo))
        plans = {}
        for key, pl in planners.items():
            try:
                plans[key] = pl.plan_for_budget(budget)
            except remat.InfeasibleBudgetError:
                plans[key] = None
        n, o, s = plans["none"], plans["offload"], plans["slow"]
        reserved = [predict_peaks(model, inputs, target, loss_fn=loss_fn, optimizer=opt, output_alive=False,
                                  plan=q if q.choices else None).reserved_peak_bytes / GiB if q is not None else None
                    for q in (n, o)]
        rows.append((budget, n, o))

        def t(q):
            return (f"{q.predicted_step_time_s:.3f}", f"{tps / q.predicted_step_time_s:,.0f}") if q else ("refused", "-")
        gain = f"{n.predicted_step_time_s / o.predicted_step_time_s - 1:+.1%}" if n and o else "-"
        res = "/".join("-" if r is None else f"{r:.1f}" for r in reserved)
        print(f"{budget / GiB:>10.2f} | {t(n)[0]:>18} | {t(n)[1]:>6} | {t(o)[0]:>15} | {t(o)[1]:>6} | {gain:>6} | "
              f"{len(o.checkpointed) if o else '-':>4} | {len(o.offloaded) if o else '-':>4} | "
              f"{(o.predicted_offload_bytes / GiB if o else 0):>13.2f} | {(o.predicted_exposed_copy_s * 1e3 if o else 0):>10.1f} | "
              f"{len(s.offloaded) if s else '-':>15} | {res:>27}")
    import published

    sac, sac_time = published.predict(8), published.predict_time(8)
    print(f"torchtitan's op policy (its selective checkpointing, every layer; benchmarks/targets/published.py): "
          f"{sac_time['step']:.3f} s, {sac_time['tps']:,.0f} tokens/s per GPU, allocated peak {sac['allocated']:.2f} "
          f"GiB, reserved {sac['native']:.1f} GiB (native allocator), predicted")
    print(f"recording {recorded:.0f} s; whole run {time.perf_counter() - started:.0f} s")
    if a.layers:
        for budget, n, o in rows:
            for name, q in (("no offload", n), ("offload", o)):
                if q is None:
                    continue
                print(f"\n{budget / GiB:.2f} GiB, {name}: layer: kept / recomputed / offloaded GiB")
                for layer, (k, r, off) in per_layer(planners["offload"], q).items():
                    print(f"  {layer}: {k / GiB:.2f} / {r / GiB:.2f} / {off / GiB:.2f}")


if __name__ == "__main__":
    main()
