"""Offloaded plans against what the H200 measured (issue #56; Note [Exposed copies] in remat.costs.offload):
torchtitan's Llama (titan4: 8B widths, 4 layers, FSDP2 over one rank, 2 x 8192) with offloading offered, as
the shared oracle's ``gpu_oracle_predict.py`` planned it; each offload row of
``data/oracle_offload_applied_on_gpu.json`` (pinned, side stream; loaded by ``h200_data.py``) predicted again here on
the CPU with today's host link (the H200's measured rates) and exposed-copy model, beside every block's plan;
and the plan the planner chooses now at each row's budget.

    flock /tmp/remat-heavy.lock python benchmarks/h200/offload_h200.py     # ~1-2 min

Every "predicted" figure is predicted for the H200 on this CPU; "measured" is the H200's (median of steps 2-4).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200_data import DATA, oracle_rows, profiled_for_h200  # noqa: E402
GiB = 2**30


def main() -> None:
    import torch

    from remat.api.offloading import host_link
    from remat.solve import Planner
    from remat.solve.plan import Plan

    _, target, p, seconds = profiled_for_h200("titan4")
    link, _ = host_link(True, device=torch.device("cpu"), target=target)
    print(f"titan4 profiled for the H200 in {seconds:.0f} s; host link: {link.source}\n")
    planner = Planner(p, granularity="op", offload=link)
    every = next(r for r in oracle_rows() if r["config"] == "titan4" and r["row"] == "every block")
    rows = [("every block (hand rule)", planner.every_nth_block(1), every["step_s"])]
    with open(os.path.join(DATA, "oracle_offload_applied_on_gpu.json")) as f:
        measured = json.load(f)
    for r in measured:
        with open(os.path.join(DATA, "plans", r["plan"])) as f:
            saved = Plan.from_dict(json.load(f))
        rows.append((f"{r['plan']} (as run)", planner.make_plan(saved.choices, "as run"), r["step_s"]))
        rows.append((f"  chosen now at {saved.budget_bytes / GiB:.2f} GiB", planner.plan_for_budget(saved.budget_bytes),
                     None))
    print("| plan | checkpointed | offloaded | exposed copies, ms (predicted) | step, ms: predicted | measured |")
    print("|---|---|---|---|---|---|")
    for name, plan, step_s in rows:
        print(f"| {name} | {len(plan.checkpointed)} | {', '.join(plan.offloaded) or '-'} | "
              f"{plan.predicted_exposed_copy_s * 1e3:.1f} | {plan.predicted_step_time_s * 1e3:.1f} | "
              f"{'-' if step_s is None else f'{step_s * 1e3:.1f}'} |")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    main()
