"""remat's predicted step time for the H200 against the step times measured there (issue #56): every llama1b and
titan4 row of ``data/oracle.json`` (loaded by ``h200_data.py``), each plan as saved in ``data/plans/`` (the plan the GPU
ran), predicted here on the CPU with today's time model (Note [Device time model], Note [Host time model] in
remat.costs.device_time; Note [Host time in the plan] in remat.costs.step_time).

    flock /tmp/remat-heavy.lock python benchmarks/h200/gpu_step_times.py [llama1b] [titan4]   # ~1-2 min a config

Prints, per row: measured (the median of steps 2-4 on the H200), predicted when the GPU was measured (the
oracle's, remat at 1067e0c), predicted now, and the error; per config the plain step's phases (GPU and host).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200_data import oracle_rows, plan as saved_plan, profiled_for_h200  # noqa: E402


def predict(name: str, rows: list[dict]) -> None:
    from remat.costs.step_time import plan_step_time_s

    _, _, p, seconds = profiled_for_h200(name)
    print(f"\n## {name} (profiled for the H200 in {seconds:.0f} s)\n")
    print(f"plain step, predicted: forward GPU {p.forward_s * 1e3:.1f} ms, host {p.forward_host_s * 1e3:.1f}; backward "
          f"GPU {p.backward_s * 1e3:.1f}, host {p.backward_host_s * 1e3:.1f}; optimizer {p.optimizer_s * 1e3:.1f}\n")
    print("| row | measured ms | predicted then ms (error) | predicted now ms (error) | forward GPU / host ms "
          "| backward GPU / host ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        plan = saved_plan(r["plan"])
        units = [p.unit(u) for u in plan.checkpointed]
        now = plan_step_time_s(p, units)
        fwd_host = p.forward_host_s + sum(u.forward_host_s for u in units)
        bwd_gpu = p.backward_s + sum(u.recompute_s + u.overhead_s for u in units)
        bwd_host = p.backward_host_s + sum(u.recompute_host_s for u in units)
        m, then = r["step_s"], r["pred_step_s"]
        print(f"| {r['row']} | {m * 1e3:.1f} | {then * 1e3:.1f} ({then / m - 1:+.1%}) | {now * 1e3:.1f} "
              f"({now / m - 1:+.1%}) | {p.forward_s * 1e3:.1f} / {fwd_host * 1e3:.1f} | {bwd_gpu * 1e3:.1f} / "
              f"{bwd_host * 1e3:.1f} |", flush=True)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", default=["llama1b", "titan4"], choices=["llama1b", "titan4"])
    oracle = oracle_rows()
    for name in parser.parse_args().configs:
        predict(name, [r for r in oracle if r["config"] == name and r.get("plan") and r.get("pred_step_s")])


if __name__ == "__main__":
    main()
