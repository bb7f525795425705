"""Train a GPT-style decoder with FSDP2 under a per-rank memory budget chosen by remat.

    torchrun --nproc_per_node 2 examples/fsdp_train.py [--budget-gb G] [--steps 3] [--ddp]

Runs on CPU (gloo) and unchanged on GPUs (nccl, one per rank). remat is called on every rank, on the
model as it trains (``fully_shard`` on each block and the root, or ``DistributedDataParallel`` with
--ddp): every rank gets the same plan. Without --budget-gb the budget is halfway between the least
per-rank peak remat can reach and the plain step's peak. Each rank prints its predicted and measured
peak (torch's FSDPMemTracker / MemTracker on CPU, the CUDA allocator on GPUs) against the budget.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import remat
from remat.examples import make_gpt
from remat.solve.plan import fmt_bytes


def measured_peak(model, batch, optimizer, device: torch.device, ddp: bool) -> int:
    """One training step's peak on this rank (the second of two: the first creates optimizer state)."""
    def step():
        model(*batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        return torch.cuda.max_memory_allocated(device)
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker() if ddp else FSDPMemTracker(model, optimizer)
    if ddp:
        tracker.track_external(model, optimizer)
    with tracker:
        step()
    return int(tracker.get_tracker_snapshot("peak")[device]["Total"])


def build(args, device: torch.device, rank: int):
    model, _, _ = make_gpt(layers=args.layers, batch_size=args.batch_size, seq_len=args.seq_len, device=device)
    g = torch.Generator().manual_seed(rank)  # each rank its own batch
    batch = tuple(torch.randint(0, 512, (args.batch_size, args.seq_len), generator=g).to(device) for _ in range(2))
    if args.ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, batch, torch.optim.AdamW(model.parameters(), lr=3e-4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gb", type=float, default=None, help="GiB of peak memory per rank for one step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--ddp", action="store_true", help="DistributedDataParallel instead of FSDP2")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    budget_gb = args.budget_gb
    if budget_gb is None:
        model, batch, optimizer = build(args, device, rank)
        plain = max(all_gather(measured_peak(*build(args, device, rank), device, args.ddp)))
        try:  # ask for the impossible once to learn the least per-rank peak (every rank gets the same answer)
            remat.optimize_checkpointing(model, 1e-9, batch, optimizer=optimizer)
        except remat.InfeasibleBudgetError as e:
            budget_gb = (e.min_feasible_bytes + plain) / 2 / 2**30

    model, batch, optimizer = build(args, device, rank)
    plan = remat.optimize_checkpointing(model, budget_gb, batch, optimizer=optimizer)
    if rank == 0:
        print(plan)
    for step in range(args.steps):
        loss = model(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    peak = measured_peak(model, batch, optimizer, device, args.ddp)
    for r, (units, p) in enumerate(all_gather((plan.checkpointed, peak))):
        if rank == 0:
            print(f"rank {r}: {len(units)} units checkpointed; predicted {fmt_bytes(plan.predicted_peak_bytes)} "
                  f"(worst rank), checked {fmt_bytes(plan.checked_peak_bytes)}, measured {fmt_bytes(p)}; budget "
                  f"{fmt_bytes(plan.budget_bytes)}: {'met' if p <= plan.budget_bytes else 'OVER'}")
    dist.barrier()  # no rank tears the group down while another still talks to it
    dist.destroy_process_group()


def all_gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


if __name__ == "__main__":
    main()
