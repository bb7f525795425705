"""remat's predicted allocated and reserved peaks for an H200, on this CPU, against the peaks measured on the H200
(issue #55): every row of ``data/oracle.json`` whose saved plan is in ``data/plans/`` (``llama1b`` and ``titan4``:
the steps of ``gpu_models.py``; the data set's loader is ``h200_data.py``), predicted as
``gpu_oracle_predict.py`` predicted them (``predict_peaks`` for ``Target(device="h200")``: the step recorded on
fake tensors, the CUDA caching allocator replayed over two steps). Measured: torch's own allocator statistics on
the H200 on 2026-12-04 (torch 2.11.0+cu130). Predicted: here, with the torch and transformers of this process.

    python benchmarks/h200/gpu_oracle_replay.py [CONFIG or PLAN ...]   # default: llama1b titan4
    python benchmarks/h200/gpu_oracle_replay.py titan4__0.plan.json titan4__1.plan.json   # those rows only

llama1b's six rows take about a minute on 2 cores; titan4's five about three (run under the heavy-work lock).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200_data import oracle_rows, plan as saved_plan, shared_models  # noqa: E402

GiB = 2**30


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", default=["llama1b", "titan4"], help="a config or a plan's file name")
    rows = parser.parse_args(argv).rows
    gm = shared_models()

    import remat
    from remat.api.predict import predict_peaks

    measured = [r for r in oracle_rows()
                if (r["config"] in rows or r.get("plan") in rows) and r.get("plan") and "error" not in r]
    print(f"{'config':8} {'row':22} {'allocated GiB: measured predicted':>36} {'reserved GiB: measured predicted':>36}"
          f"  {'s':>5}  (predicted / measured bytes)")
    for r in measured:
        c = gm.build(r["config"], "meta")
        opt = c["opt"](c["model"].parameters())
        target = remat.Target(device="h200", parallelize=c["parallelize"], clip_grad_norm=c["clip"], **c["target"])
        plan = saved_plan(r["plan"])
        t0 = time.perf_counter()
        peaks = predict_peaks(c["model"], c["inputs"], target, plan=plan if plan.choices else None,
                              loss_fn=c["loss_fn"], optimizer=opt, output_alive=c["output_alive"])
        a, s = peaks.allocated_peak_bytes, peaks.reserved_peak_bytes
        print(f"{r['config']:8} {r['row'][:22]:22} {r['alloc'] / GiB:17.2f} {a / GiB:9.2f} ({a / r['alloc'] - 1:+6.1%})"
              f" {r['reserved'] / GiB:17.2f} {s / GiB:9.2f} ({s / r['reserved'] - 1:+6.1%})"
              f"  {time.perf_counter() - t0:5.1f}  bytes: {a:,} / {r['alloc']:,}, {s:,} / {r['reserved']:,}",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
