"""Per-rank peak and step time under tensor parallelism and FSDP2 x TP (2-D), run by hand (issue #26).

    python benchmarks/distributed/tensor_parallel.py [--layers 4] [--dim 256] [--batch 8] [--seq 128] [--out FILE]

A Llama-style decoder (tests/integration/distributed_worker.py's, torchtitan's module names and
tensor-parallel plan) on CPU with gloo, three meshes, each in its own spawned group of processes:

* ``tp=2``: tensor parallel over 2 ranks;
* ``tp=2+sp``: with sequence parallelism (norms sharded on the sequence, all_gather / reduce_scatter);
* ``dp=2 x tp=2``: 4 ranks, FSDP2 (``fully_shard`` per layer and the root) over the "dp" dimension of a 2-D
  mesh and tensor parallel over "tp", each dp rank its own batch.

Per mesh: the per-rank peak (the profiler's allocator-level events, the least and the largest of three
steps: under gloo identical steps differ, Note [Steps under gloo] in remat.runtime.distributed) and median step time (the
slowest rank's) of the plain model, of "every layer" (torchtitan's full AC) and of torchtitan's selective op
AC (each layer checkpointed keeping every other matrix product, attention and reduce_scatter outputs); then
remat's plan at each rule's largest peak and halfway between remat's least peak and no checkpointing, each measured
the same way and
checked bitwise against the plain model (loss and full gradients). On 2 cores, 4 ranks share 2 cores:
compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "integration"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import distributed_worker as w  # noqa: E402
from distributed import _gather, selective  # noqa: E402  (benchmarks/distributed/distributed.py: torchtitan's selective op AC)

import remat  # noqa: E402
from remat.rewrite import checkpoint_modules  # noqa: E402

MiB = 2**20
RULES = ("every layer", "torchtitan selective op")
MESHES = {"tp=2": (2, False, False), "tp=2+sp": (2, True, False), "dp=2 x tp=2": (4, False, True)}


def build(args, sp: bool, two_d: bool, rule: str = "none"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sizes = dict(layers=args.layers, d=args.dim, heads=args.heads, vocab=args.vocab)
    if two_d:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model, idx, loss_fn = w.tensor_parallel(sp, mesh=mesh["tp"], batch_seed=mesh.get_local_rank("dp"),
                                                shape=(args.batch, args.seq), **sizes)
    else:
        model, idx, loss_fn = w.tensor_parallel(sp, shape=(args.batch, args.seq), **sizes)
    if rule == "every layer":
        checkpoint_modules(model, [f"layers.{i}" for i in range(args.layers)])
    elif rule == "torchtitan selective op":
        for layer in model.layers:
            selective(layer)
    if two_d:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, idx, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-3)


def measure(model, idx, loss_fn, opt, two_d: bool, steps: int) -> tuple[int, int, float]:
    """(per-rank peak bytes: the least and the largest of three steps, median step seconds), the worst over
    ranks. The peaks: the profiler's allocator-level events, three steps after a first
    (``distributed_worker.allocator_peak``): they see every allocation, the CPU RNG states checkpoint saves
    included, which torch's MemTracker does not (adding all of a step's RNG states to its reading, as the tests
    do, over-counts those already freed at the peak: it read remat's plan at torchtitan's peak 11 KiB over that
    budget where these events read it 9 KiB under). Under gloo identical steps differ (Note [Steps under gloo]
    in remat.runtime.distributed): the largest is what the loop reaches, and what remat's check keeps."""
    readings = w.allocator_peak(model, (idx,), loss_fn, opt, keep=list)
    least, largest = min(readings), max(readings)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss_fn(model(idx)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return max(_gather(least)), max(_gather(largest)), max(_gather(statistics.median(times)))


def run(rank: int, world: int, port: int, name: str, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    _, sp, two_d = MESHES[name]
    rows = []
    def peaks(least: int, largest: int) -> str:
        return f"{least / MiB:.2f}-{largest / MiB:.2f}"

    lo, hi, plain_step = measure(*build(args, sp, two_d), two_d, args.steps)
    rows.append(f"| {name} | none (plain) | | | {peaks(lo, hi)} | | {plain_step * 1e3:.0f} ms | 1.00 | |")
    budgets = []
    for rule in RULES:
        lo, hi, step = measure(*build(args, sp, two_d, rule), two_d, args.steps)
        rows.append(f"| {name} | {rule} | {args.layers} | | {peaks(lo, hi)} | | {step * 1e3:.0f} ms | "
                    f"{step / plain_step:.2f} | |")
        budgets.append((f"at {rule}'s largest peak", hi))
    model, idx, loss_fn, opt = build(args, sp, two_d)
    # the loop measured here drops the output (the logits) once the loss exists: planned for that loop
    profile = remat.make_profile(model, idx, loss_fn=loss_fn, optimizer=opt, output_alive=False)
    planner = remat.Planner(profile, ranks=w.ranks_for(model)[1].gather(profile))
    halfway = (planner.min_peak_bytes + planner.baseline_peak_bytes) // 2
    for label, budget in (*budgets, ("halfway: least to none", halfway)):
        model, idx, loss_fn, opt = build(args, sp, two_d)
        try:
            plan = remat.optimize_checkpointing(model, budget / 2**30, idx, loss_fn=loss_fn, optimizer=opt,
                                                output_alive=False)
        except remat.InfeasibleBudgetError as e:
            rows.append(f"| {name} | remat {label} ({budget / MiB:.2f}) | refused: least "
                        f"{e.min_feasible_bytes / MiB:.2f} | | | | | | |")
            continue
        lo, hi, step = measure(model, idx, loss_fn, opt, two_d, args.steps)
        fresh, _, _, _ = build(args, sp, two_d)
        remat.apply_plan(fresh, plan)
        plain, _, _, _ = build(args, sp, two_d)
        bad = w.bitwise_equal(w.one_step(plain, (idx,), loss_fn, seed=7), w.one_step(fresh, (idx,), loss_fn, seed=7))
        bad = [b for r in _gather(bad) for b in r]
        comm = sum(len(profile.unit(u).recomputed_collectives) for u in plan.checkpointed)
        comm_bytes = sum(b for u in plan.checkpointed for _, b in profile.unit(u).recomputed_collectives)
        selective = sum("@ops" in u for u in plan.checkpointed)
        rows.append(f"| {name} | remat {label} ({budget / MiB:.2f}) | {len(plan.checkpointed)} "
                    f"({selective} selective; {comm} collectives again, {comm_bytes:,} bytes) | {plan.predicted_peak_bytes / MiB:.2f} | "
                    f"{peaks(lo, hi)} | {'yes' if hi <= budget else 'NO' if lo > budget else 'least only'} | "
                    f"{step * 1e3:.0f} ms | {step / plain_step:.2f} | {'yes' if not bad else 'NO: ' + ', '.join(bad[:3])} |")
    if rank == 0:
        Path(out).write_text("\n".join(rows) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sizes = dict(layers=4, dim=256, heads=4, vocab=1024, batch=8, seq=128, steps=5)
    for name, default in sizes.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--meshes", default=",".join(MESHES), help="comma-separated: " + ", ".join(MESHES))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lines = [f"torch {torch.__version__}, CPU (gloo); Llama-style decoder {args.layers} layers x {args.dim}, vocab "
             f"{args.vocab}, batch {args.batch} x {args.seq} per data-parallel rank, AdamW; per-rank peaks in MiB "
             f"(the profiler's allocator-level events: the least and the largest of 3 steps; a budget is met when the largest is "
             f"within it), step time the slowest rank's median of {args.steps}; "
             "`python benchmarks/distributed/tensor_parallel.py`", "",
             "| mesh | plan | units | predicted (remat's) | per-rank peak | budget met | step | step / plain | exact |",
             "|---|---|---:|---:|---:|---|---:|---:|---|"]
    print("\n".join(lines), flush=True)
    for name in args.meshes.split(","):
        world = MESHES[name][0]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = Path(f"/tmp/remat-tp-{os.getpid()}.md")
        torch.multiprocessing.spawn(run, args=(world, port, name, args, str(out)), nprocs=world, join=True)
        rows = out.read_text().splitlines()
        print("\n".join(rows), flush=True)
        lines += rows
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
