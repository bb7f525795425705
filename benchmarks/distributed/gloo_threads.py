"""What gloo's worker threads allocate during a compiled FSDP2 step, and whether it meets the step's peak (issue #46,
Note [The step's threads] in remat._compat.profiler): the tests' GPT (2 blocks of width 64, vocabulary 256, batch 8 x
64 per rank), FSDP2 over 2 gloo ranks on this CPU, its first block's MLP checkpointed, compiled with aot_eager, AdamW.
Each of ``STEPS`` steps is read by the profiler's allocator-level events three ways: every thread counted, the
step's own thread only (remat's meter), and the most of gloo's scratch alive at once (what its threads allocate,
and its copies of a reduce-scatter's input, made on the step's thread inside its ``c10d::`` operator).

    python benchmarks/distributed/gloo_threads.py [STEPS]     (default 12; about 30 s)
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint

import remat
from remat.examples import make_gpt


def allocation_events(work) -> tuple[list, int]:
    """The CPU allocator's events while ``work()`` runs, in time order, from the profiler's event tree (each with
    its address, bytes, thread and parent operators), and the calling thread's id."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("bench::caller"):
            pass
        work()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        events.append(e)
        todo += e.children
    caller = next(e.start_tid for e in events if e.name == "bench::caller")
    allocations = [e for e in events
                   if e.tag == torch._C._profiler._EventType.Allocation and e.extra_fields.device.type == "cpu"]
    return sorted(allocations, key=lambda e: e.start_time_ns), caller


def readings(work) -> tuple[int, int, int]:
    """(every thread's peak, the calling thread's peak, gloo's scratch peak) of ``work()``, in bytes above the
    start (:func:`allocation_events`: allocations' addresses, threads and callers). Gloo's scratch: what other
    threads allocate, and what the calling thread allocates inside a ``c10d::`` operator (gloo's copy of a
    reduce-scatter's input, which its work holds and its thread may free, unreported)."""
    allocations, caller = allocation_events(work)
    theirs_live: dict[int, int] = {}
    every = mine = theirs = peaks_every = peaks_mine = peaks_theirs = 0
    for e in allocations:
        f = e.extra_fields
        every += f.alloc_size
        if f.alloc_size > 0 and f.ptr in theirs_live:  # the address handed out again: freed, reported or not
            theirs -= theirs_live.pop(f.ptr)
        if f.alloc_size > 0 and (e.start_tid != caller or in_collective(e)):
            theirs_live[f.ptr] = f.alloc_size
            theirs += f.alloc_size
        elif f.alloc_size < 0 and f.ptr in theirs_live:
            theirs -= theirs_live.pop(f.ptr)
        else:
            mine += f.alloc_size
        peaks_every, peaks_mine, peaks_theirs = max(peaks_every, every), max(peaks_mine, mine), max(peaks_theirs,
                                                                                                   theirs)
    return peaks_every, peaks_mine, peaks_theirs


def in_collective(e) -> bool:
    """Whether the event ``e`` happened inside a ``c10d::`` operator."""
    while (e := e.parent) is not None:
        if e.name.startswith("c10d::"):
            return True
    return False


def rank(r: int, world: int, port: int, steps: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=world)
    torch.set_num_threads(1)
    model, _, _ = make_gpt(layers=2, batch_size=8, seq_len=64, d_model=64, vocab=256, seed=0)
    g = torch.Generator().manual_seed(100 + r)
    idx, targets = (torch.randint(0, 256, (8, 64), generator=g) for _ in range(2))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mlp = model.h[0].mlp
    forward = mlp.forward
    mlp.forward = lambda *a, **k: checkpoint(forward, *a, use_reentrant=False, **k)
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        loss = remat.default_loss(compiled(idx, targets))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    step()
    rows = [readings(step) for _ in range(steps)]
    out = [None] * world
    dist.all_gather_object(out, rows)
    if r == 0:
        print(f"torch {torch.__version__}, {world} gloo ranks, {steps} identical compiled steps; bytes above the "
              "step's start (parameters, optimizer state and batch not included)")
        print("| rank | every thread: least - largest (steps at the largest) | the step's thread | gloo's scratch at "
              "once |")
        print("|---|---|---|---|")
        for k, rs in enumerate(out):
            every = [x[0] for x in rs]
            mine = sorted({x[1] for x in rs})
            theirs = sorted({x[2] for x in rs})
            print(f"| {k} | {min(every):,} - {max(every):,} ({every.count(max(every))} of {len(every)}) | "
                  f"{', '.join(f'{m:,}' for m in mine)} | {', '.join(f'{t:,}' for t in theirs)} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", nargs="?", type=int, default=12, help="compiled steps per rank (default 12)")
    n = parser.parse_args().steps
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    torch.multiprocessing.spawn(rank, args=(2, free, n), nprocs=2, join=True)
