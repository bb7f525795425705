"""Per-rank peak and step time under FSDP2: remat's plans against the hand rules, at the same budgets.

    python benchmarks/distributed/distributed.py [--ranks 2] [--layers 4] [--out FILE]      (spawns the ranks)
    torchrun --nproc_per_node N benchmarks/distributed/distributed.py [...]                 (the same, launched by torchrun)

A GPT-style decoder (dropout on) with ``fully_shard`` on each block and the root; CPU with gloo, or one GPU
per rank with nccl, unchanged. Hand rules: FSDP2 alone; "every block" (each block checkpointed: torchtitan's
full activation checkpointing); torchtitan's selective op policy (each block checkpointed keeping the
attention kernels and every other matmul); and "every 2nd block" (torchtitan's selective layer policy).
For each rule the per-rank peak is measured on three steps (the profiler's allocator-level events on CPU,
the allocator on GPUs: the least and the largest, which under gloo differ), and remat is asked for a plan
with the largest as its per-rank budget, then measured the same way. Step times:
median of --steps steps, the slowest rank's.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import remat
from remat.examples import make_gpt
from remat.rewrite import checkpoint_modules

MiB = 2**20
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
#: torchtitan's op-level selective AC (``_op_sac_save_list``): matrix products (every other one), attention,
#: and reduce_scatter's outputs (under sequence parallelism: a recomputation does not communicate them again;
#: FSDP2's own reduce_scatter runs in backward, outside any checkpoint)
_KEEP = _MATMULS | {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _torchtitan_policy():
    """torchtitan's op-level selective AC: keep attention, reduce_scatter's outputs and every other matmul of a
    block, recompute the rest."""
    count = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in _MATMULS:
            count[mode] += 1
        keep = func in _KEEP and not (func in _MATMULS and count[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def selective(block: torch.nn.Module) -> None:
    """torchtitan's selective op AC on one block (its ``ptd_checkpoint_wrapper`` with the policy above)."""
    forward = type(block).forward.__get__(block)
    block.forward = functools.partial(checkpoint, forward, use_reentrant=False, preserve_rng_state=True,
                                      context_fn=_torchtitan_policy)


def build(args, device: torch.device, rule: str):
    model, _, _ = make_gpt(layers=args.layers, batch_size=args.batch_size, seq_len=args.seq_len, device=device)
    g = torch.Generator().manual_seed(dist.get_rank())
    batch = tuple(torch.randint(0, 512, (args.batch_size, args.seq_len), generator=g).to(device) for _ in range(2))
    blocks = [f"h.{i}" for i in range(args.layers)]
    if rule == "every block":
        checkpoint_modules(model, blocks)
    elif rule == "every 2nd block":
        checkpoint_modules(model, blocks[::2])
    elif rule == "torchtitan selective op":
        for block in model.h:
            selective(block)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, batch, torch.optim.AdamW(model.parameters(), lr=3e-4)


def measure(model, batch, opt, device: torch.device, steps: int) -> tuple[int, int, float]:
    """(per-rank peak bytes: the least and the largest of three steps, median step seconds), the worst over
    ranks. On CPU the peaks are the profiler's allocator-level events plus the parameters, batch and optimizer
    state alive before each step: they see gloo's buffers and when they are really freed, which under gloo
    differs from step to step (Note [Steps under gloo] in remat.runtime.distributed; remat's check keeps the largest
    of three such steps). On CUDA the allocator's."""
    def step():
        model(*batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    readings = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            readings.append(torch.cuda.max_memory_allocated(device))
        else:
            from remat._compat import profiler_memory_peak
            from remat.runtime.measure import tensor_bytes

            state = [*model.parameters(), *(t for t in batch if torch.is_tensor(t))]
            state += [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
            readings.append(tensor_bytes(state) + profiler_memory_peak(step, device))
    times = []
    for _ in range(steps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return max(_gather(min(readings))), max(_gather(max(readings))), max(_gather(statistics.median(times)))


def _gather(x):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def run(rank: int, world: int, port: int, args) -> None:
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    lines = []

    def say(line: str = "") -> None:
        if rank == 0:
            print(line, flush=True)
            lines.append(line)

    meter = "the allocator" if cuda else "the profiler's allocator-level events"
    say(f"torch {torch.__version__}, {world} ranks on {'CUDA' if cuda else 'CPU (gloo)'}; GPT {args.layers} blocks, "
        f"batch {args.batch_size} x {args.seq_len} per rank, FSDP2 (reshard_after_forward=True), AdamW; per-rank "
        f"peaks in MiB ({meter}, the least and the "
        f"largest of 3 steps; remat's budget: the rule's largest), step time the slowest rank's median of {args.steps}")
    say()
    say("| hand rule | its peak | its step | remat: units | remat peak | remat step | budget met | remat / rule step |")
    say("|---|---:|---:|---:|---:|---:|---|---:|")
    for rule in ("none", "every block", "every 2nd block", "torchtitan selective op"):
        lo, peak, step_s = measure(*build(args, device, rule), device, args.steps)
        model, batch, opt = build(args, device, "none")
        try:
            plan = remat.optimize_checkpointing(model, peak / 2**30, batch, optimizer=opt)
        except remat.InfeasibleBudgetError as e:
            say(f"| {rule} | {lo / MiB:.2f}-{peak / MiB:.2f} | {step_s * 1e3:.0f} ms | refused: least "
                f"{e.min_feasible_bytes / MiB:.2f} | | | | |")
            continue
        r_lo, r_peak, r_step = measure(model, batch, opt, device, args.steps)
        met = "yes" if r_peak <= peak else "NO" if r_lo > peak else "least only"
        say(f"| {rule} | {lo / MiB:.2f}-{peak / MiB:.2f} | {step_s * 1e3:.0f} ms | {len(plan.checkpointed)} | "
            f"{r_lo / MiB:.2f}-{r_peak / MiB:.2f} | {r_step * 1e3:.0f} ms | {met} | {r_step / step_s:.2f} |")
    if rank == 0 and args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if "RANK" in os.environ:  # launched by torchrun
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(run, args=(args.ranks, port, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
