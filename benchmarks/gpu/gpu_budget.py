"""Does the budget hold on the GPU? (issue #55) ``remat.optimize_checkpointing`` on a command-line target built on
the device, as a user's training script calls it, then ``--steps`` real training steps of the planned model with
its own optimizer, read by torch's CUDA allocator (``torch.cuda.max_memory_allocated``, peaks reset after the
call returns) against the budget: the figure issue #55's first criterion names.

    python benchmarks/gpu/gpu_budget.py benchmarks/gpu/gpu_targets.py:llama1b --budget 24 --output-dropped --json out.json
    python benchmarks/gpu/gpu_budget.py benchmarks/gpu/gpu_targets.py:llama_tiny --budget 0.06 --device cpu   # (a CPU check)

Prints one line (planned in, checked, measured, within or OVER the budget) and writes the JSON; exits 1 when a step
measured over the budget. On a CPU the peaks are remat's CPU meter's (live tensor storages), labelled so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

GiB = 2**30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="a command-line TARGET: gpt, unet, path/to/file.py:function, ...")
    ap.add_argument("--budget", type=float, required=True, help="GiB")
    ap.add_argument("--steps", type=int, default=4, help="real training steps after planning (default 4)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a check of the script)")
    ap.add_argument("--output-dropped", action="store_true", help="the loop keeps only the loss")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args(argv)
    if args.budget <= 0 or args.steps < 1:
        ap.error("--budget must be positive and --steps at least 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu to check the script)")

    import remat
    from remat.cli.targets import resolve_target
    from remat.runtime.measure import run_step, split_inputs
    from remat.runtime.meters import StepMeter

    cuda = device.type == "cuda"
    model, inputs, loss_fn, desc = resolve_target(args.target, device=device, options={})
    loss_fn = loss_fn or remat.default_loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    t0 = time.perf_counter()
    plan = remat.optimize_checkpointing(model, args.budget, inputs, loss_fn=loss_fn, optimizer=opt,
                                        output_alive=not args.output_dropped)
    plan_s = time.perf_counter() - t0
    print(plan, flush=True)
    a, k = split_inputs(inputs)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:  # remat's CPU meter: the state alive all along counted, every storage allocated after it tracked
        meter = StepMeter(device)
        meter.start([*model.parameters(), *model.buffers(), *(t for t in a if isinstance(t, torch.Tensor)),
                     *(t for t in k.values() if isinstance(t, torch.Tensor))])
    times, losses, peaks = [], [], []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        result = run_step(model, a, k, loss_fn, output_alive=not args.output_dropped, optimizer=opt)
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        times.append(time.perf_counter() - t)
        losses.append(float(result.loss))
        del result
    peak = max(peaks) if cuda else meter.stop()
    budget_bytes = int(args.budget * GiB)
    r = dict(target=desc, device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
             meter="torch.cuda.max_memory_allocated" if cuda else "remat's CPU meter (live tensor storages)",
             budget_gib=args.budget, budget_bytes=budget_bytes, plan_s=plan_s, checkpointed=list(plan.checkpointed),
             predicted_peak_bytes=plan.predicted_peak_bytes, checked_peak_bytes=plan.checked_peak_bytes,
             measured_peak_bytes=peak, measured_peak_after_step_bytes=peaks,
             measured_reserved_peak_bytes=torch.cuda.max_memory_reserved() if cuda else None,
             within_budget=peak <= budget_bytes, over_budget_bytes=max(0, peak - budget_bytes),
             step_s=statistics.median(times[1:] or times), predicted_step_s=plan.predicted_step_time_s, losses=losses)
    print(json.dumps(r), flush=True)
    print(f"planned in {plan_s:.1f} s; budget {args.budget} GiB ({budget_bytes:,} bytes); measured peak "
          f"{peak:,} bytes ({r['meter']}) over {args.steps} steps: "
          f"{'within' if r['within_budget'] else 'OVER by ' + format(peak - budget_bytes, ',') + ' bytes'}; "
          f"predicted {plan.predicted_peak_bytes:,}, checked {plan.checked_peak_bytes or 0:,}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0 if r["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
