"""Offloaded steps measured on a GPU against their prediction (issue #50): for a few budgets, remat's plan for this
GPU with offloading offered is applied and run for real; the script prints the measured reserved peak and step
time next to the predicted ones, and checks the gradients against the plain step's. Needs a CUDA GPU in remat's
device table (its host link is the spec's); not run on the CPU machine remat is developed on (no GPU lent there).

    python benchmarks/gpu/offload_gpu.py                  # the built-in GPT at a size that fills a few GiB
    python benchmarks/gpu/offload_gpu.py --layers 8 --d-model 1024 --seq-len 1024 --batch 8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import remat
from remat.examples import make_gpt
from remat.target.spec_file import device_spec


def step(model, idx, targets, opt):
    torch.manual_seed(0)
    logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def measured(model, idx, targets, steps: int = 5) -> tuple[int, float]:
    """Reserved peak (bytes) over ``steps`` AdamW steps and their median time (s), after one warm-up step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    step(model, idx, targets, opt)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(model, idx, targets, opt)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return torch.cuda.memory_stats()["reserved_bytes.all.peak"], statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: nothing measured")
    name = torch.cuda.get_device_name()
    spec = device_spec(name)
    model, (idx, targets), _ = make_gpt(layers=a.layers, d_model=a.d_model, seq_len=a.seq_len,
                                        batch_size=a.batch, device="cuda")
    loss_fn = lambda out: torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
    plain_reserved, plain_s = measured(copy.deepcopy(model), idx, targets)
    target = remat.Target(device=spec)
    print(f"{name} ({spec.name}), host link {spec.host_link_bytes_per_s / 1e9:.1f} GB/s each way (spec); plain step "
          f"measured {plain_reserved / 2**30:.2f} GiB reserved, {plain_s * 1e3:.1f} ms")
    print(f"{'budget GiB':>10} | {'offloaded':>9} | {'ckpt':>4} | {'reserved GiB pred/meas':>22} | "
          f"{'step ms pred/meas':>17} | {'grads exact':>11}")
    for frac in (0.6, 0.75, 0.9):
        budget = frac * plain_reserved / 2**30
        m = copy.deepcopy(model)
        plan = remat.optimize_checkpointing(m, budget, idx, loss_fn=loss_fn, target=target, offload=True)
        reserved, seconds = measured(m, idx, targets)
        exact = not remat.check_equivalence(m, idx, loss_fn=loss_fn).mismatched
        print(f"{budget:>10.2f} | {len(plan.offloaded):>9} | {len(plan.checkpointed):>4} | "
              f"{plan.predicted_reserved_bytes / 2**30:>10.2f} / {reserved / 2**30:<9.2f} | "
              f"{plan.predicted_step_time_s * 1e3:>7.1f} / {seconds * 1e3:<7.1f} | {str(exact):>11}")


if __name__ == "__main__":
    main()
