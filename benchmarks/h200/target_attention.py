"""The attention kernel a target's step assumes, against the H200 measurement (issue #55): rows of
``data/oracle.json`` (loaded by ``h200_data.py``) predicted for ``Target(device="h200")`` with each
``scaled_dot_product_attention`` call run as CUDA would pick it (Note [Attention on the target] in
remat.target.attention) and, for comparison, as the CPU picks it (what remat did before), beside the peaks measured
on the H200 (torch 2.11.0+cu130, which ran cuDNN attention). Predicted here, with this process's torch and
transformers; ``titan4_own_sac`` is torchtitan's op-level selective checkpointing as shipped, whose list names
flash and memory-efficient attention but not cuDNN.

    python benchmarks/h200/target_attention.py [ROW ...]   # rows: titan4_own_sac titan4:0 llama1b:0

About 10 s a row on 2 cores, twice (run under the heavy-work lock).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200_data import oracle_rows, plan as saved_plan, shared_models  # noqa: E402

GiB = 2**30


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", default=["titan4_own_sac", "titan4:0", "llama1b:0"])
    rows = parser.parse_args(argv).rows
    gm = shared_models()

    import remat
    import remat.target.attention as ta
    from remat.api.predict import predict_peaks

    measured = {(r["config"], r["plan"]): r for r in oracle_rows()}
    as_gpu = ta.attention_as_on

    @contextlib.contextmanager
    def as_cpu(target, calls=None):  # the CPU's kernel, as before
        yield

    print("| row | measured allocated / reserved (GiB) | predicted, attention as the GPU runs it | "
          "predicted, as the CPU runs it (before) |")
    print("|---|---|---|---|")
    for row in rows:
        name, _, idx = row.partition(":")
        plan_file = f"{name}__{idx}.plan.json" if idx else None
        got = {}
        for how, fn in (("gpu", as_gpu), ("cpu", as_cpu)):
            ta.attention_as_on = fn
            c = gm.build(name, "meta")
            target = remat.Target(device="h200", parallelize=c["parallelize"], clip_grad_norm=c["clip"], **c["target"])
            plan = saved_plan(plan_file) if plan_file else None
            started = time.perf_counter()
            peaks = predict_peaks(c["model"], c["inputs"], target, loss_fn=c["loss_fn"],
                                  optimizer=c["opt"](c["model"].parameters()), output_alive=c["output_alive"],
                                  plan=plan)
            got[how] = (peaks.allocated_peak_bytes / GiB, peaks.reserved_peak_bytes / GiB,
                        time.perf_counter() - started)
        ta.attention_as_on = as_gpu
        m = measured.get((name, plan_file))
        ma, mr = (m["alloc"] / GiB, m["reserved"] / GiB) if m else (float("nan"), float("nan"))

        def cell(a: float, r: float) -> str:
            return f"{a:.2f} ({(a - ma) / ma:+.1%}) / {r:.2f} ({(r - mr) / mr:+.1%})"

        print(f"| {row} | {ma:.2f} / {mr:.2f} | {cell(*got['gpu'][:2])} | {cell(*got['cpu'][:2])} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
