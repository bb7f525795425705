"""The rank side of tests/integration/test_distributed.py: two CPU processes (gloo), FSDP2 and DDP.

``run(rank, ...)`` builds each model wrapped as asked, plans with remat on every rank, and writes what
it saw to ``out/rank<r>.json`` for the test to compare across ranks."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import remat
from remat.api import plan_checked
from remat.distributed import ranks_for
from remat.examples import make_gpt
from remat.measure import split_inputs
from zoo import ResNet

WRAPPINGS = ("fsdp2", "fsdp2-keep", "ddp")  # fsdp2-keep: reshard_after_forward=False
#: FSDP2 with a mixed-precision policy ("fsdp2-bf16": bf16 parameters, fp32 reductions) is not among them:
#: on CPU with gloo its per-rank memory varies from run to run (least peak 1.56-1.65 MiB over three
#: profiles of the same tiny GPT), which a deterministic test cannot hold to 5%
#: reshard_after_forward=False on the GPT only: what it changes is FSDP2's, not the model's (the ResNet case
#: took 7 s of a suite that must stay under 5 minutes)
CASES = [f"{k}/{w}" for k in ("gpt", "resnet") for w in WRAPPINGS if (k, w) != ("resnet", "fsdp2-keep")]
#: the cases that plan through ``remat.optimize_checkpointing`` (the others apply the planner's middle plan)
ONE_CALL = {("gpt", "fsdp2"), ("resnet", "ddp")}


def model_and_batch(kind: str, rank: int, batch_scale: int = 1):
    """The same initial model on every rank; each rank its own batch (``batch_scale`` times the size)."""
    g = torch.Generator().manual_seed(100 + rank)
    if kind == "gpt":
        # activations large against one block's gradient buffers, whose asynchronous release by gloo's threads
        # moves the peak by up to one such buffer from step to step (94 KiB: 4.4% of a 4 x 32-token batch)
        model, _, _ = make_gpt(layers=2, batch_size=8, seq_len=64, d_model=64, vocab=256, seed=0)
        n = 8 * batch_scale
        idx, targets = (torch.randint(0, 256, (n, 64), generator=g) for _ in range(2))
        return model, (idx, targets), remat.default_loss, list(model.h)
    torch.manual_seed(0)
    model = ResNet().train()
    x = torch.randn(4 * batch_scale, 3, 16, 16, generator=g)
    y = torch.randint(0, 5, (4 * batch_scale,), generator=g)
    return model, (x,), (lambda out: F.cross_entropy(out, y)), list(model.blocks)


def wrap(model: torch.nn.Module, blocks: list, how: str) -> torch.nn.Module:
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if how == "fsdp2-bf16" \
        else MixedPrecisionPolicy()
    for b in blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=how != "fsdp2-keep", mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=how != "fsdp2-keep", mp_policy=mp)
    return model


def build(kind: str, how: str, rank: int, batch_scale: int = 1):
    model, inputs, loss_fn, blocks = model_and_batch(kind, rank, batch_scale)
    model = wrap(model, blocks, how)
    return model, inputs, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-3)


def independent_peak(model, inputs, loss_fn, opt, how: str) -> int:
    """One training step's peak on this rank by torch's own meters (FSDPMemTracker, MemTracker): the second
    of two steps (the first creates the optimizer state), output dropped after the loss. Those meters do not
    see the CPU RNG state each checkpointed call saves (``torch.get_rng_state``, outside the dispatcher):
    the states made in the measured step are added (each lives until its unit's backward, so all of them
    can be alive at a forward-end peak)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from remat._compat import rng_states_reported

    rng_states: list[int] = []

    if how == "ddp":
        tracker = MemTracker()
        tracker.track_external(model, opt)
    else:
        tracker = FSDPMemTracker(model, opt)
    with tracker:
        for step in range(2):
            with rng_states_reported(lambda t: rng_states.append(t.untyped_storage().nbytes()) if step else None):
                loss = loss_fn(model(*inputs))
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
            if step == 0:
                tracker.reset_mod_stats()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]) + sum(rng_states)


def one_step(model, inputs, loss_fn, seed: int):
    torch.manual_seed(seed)
    loss = loss_fn(model(*inputs))
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g  # every rank's shard, gathered
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return loss.detach(), grads, buffers


def bitwise_equal(a, b) -> list[str]:
    (la, ga, ba), (lb, gb, bb) = a, b
    bad = [] if torch.equal(la, lb) else ["loss"]
    bad += [n for n in ga if not torch.equal(ga[n], gb[n])]
    bad += [f"buffer:{n}" for n in ba if not torch.equal(ba[n], bb[n])]
    return bad


def run(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    result: dict = {}
    for name in CASES:
        kind, how = name.split("/")
        result[name] = case(kind, how, rank, Path(out))
    result["cli"] = cli(rank)
    result["mismatch"] = mismatch(rank)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears the group down while another still talks to it (a failing rank ends spawn)
    dist.destroy_process_group()


def case(kind: str, how: str, rank: int, out: Path) -> dict:
    """Plans at three budgets from one gathered profile; each plan measured by torch's own meter; gradients
    of the middle plan against the plain wrapped model; the middle plan saved and applied on every rank."""
    # rank 1 trains a batch twice as large for DDP: one plan must fit the worst rank
    scale = 2 if how == "ddp" and rank == 1 else 1
    model, inputs, loss_fn, opt = build(kind, how, rank, scale)
    args, kwargs = split_inputs(inputs)
    profile = remat.make_profile(model, inputs, loss_fn=loss_fn, optimizer=opt, output_alive=False)
    wrapping, ranks = ranks_for(model)
    planner = remat.Planner(profile, ranks=ranks.gather(profile))
    try:  # the least peak remat promises: measured on one real step (Note [Least peak is a promise])
        plan_checked(model, args, kwargs, loss_fn, torch.device("cpu"), planner, 0, ranks=ranks)
    except remat.InfeasibleBudgetError as e:
        lo = e.min_feasible_bytes
    hi = planner.baseline_peak_bytes
    rows, plans = [], []
    for f in (0.0, 0.5, 0.9):
        budget = int(lo + f * (hi - lo)) + max(4096, lo // 50)  # 2% for the asynchronous frees (see above)
        plan = plan_checked(model, args, kwargs, loss_fn, torch.device("cpu"), planner, budget, ranks=ranks)
        plans.append(plan)
        fresh, inputs2, loss2, opt2 = build(kind, how, rank, scale)
        remat.apply_plan(fresh, plan)
        rows.append(dict(budget=budget, units=list(plan.checkpointed), predicted=plan.predicted_peak_bytes,
                         own_rank_predicted=planner.model.members[rank].peak_bytes(plan.checkpointed),
                         checked=plan.checked_peak_bytes, measured=independent_peak(fresh, inputs2, loss2, opt2, how)))
    # gradients and a saved plan: the one-call path for one case per wrapping (it profiles again), the middle
    # plan above for the others
    model, inputs, loss_fn, opt = build(kind, how, rank, scale)
    if (kind, how) in ONE_CALL:
        plan = remat.optimize_checkpointing(model, rows[1]["budget"] / 2**30, inputs, loss_fn=loss_fn,
                                            optimizer=opt, output_alive=False)
    else:
        plan = plans[1]
        remat.apply_plan(model, plan)
    plain, _, _, _ = build(kind, how, rank, scale)
    diff = bitwise_equal(one_step(plain, inputs, loss_fn, seed=7), one_step(model, inputs, loss_fn, seed=7))
    path = out / f"{kind}-{how}.json"
    if rank == 0:
        plan.save(path)
    dist.barrier()
    again, _, _, _ = build(kind, how, rank, scale)
    remat.apply_plan(again, remat.Plan.load(path))
    refused = ""
    try:
        other = "ddp" if how != "ddp" else "fsdp2"
        remat.apply_plan(build(kind, other, rank, scale)[0], plan)
    except remat.PlanMismatchError as e:
        refused = str(e)
    return dict(rows=rows, plan=list(plan.checkpointed), wrapping=plan.wrapping, world=plan.world_size,
                grad_mismatches=diff, applied=remat.checkpointed_modules(again), refused=refused,
                memory_recorded_with=profile.memory_recorded_with, capture=profile.capture_path,
                candidates=[u.name for u in profile.candidates()])


def cli_target():
    """A command-line target: the GPT wrapped by FSDP2 on this rank (``remat plan FILE:cli_target``)."""
    model, inputs, loss_fn, _ = build("gpt", "fsdp2", dist.get_rank())
    return model, inputs, loss_fn


def cli(rank: int) -> dict:
    """``remat plan`` run on every rank, as torchrun would run it."""
    import contextlib
    import io

    from remat.cli import main

    os.environ.update(WORLD_SIZE=str(dist.get_world_size()), RANK=str(rank))
    buf, table = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["plan", f"{__file__}:cli_target", "--budget", "0.0075", "--optimizer", "adamw"])
    with contextlib.redirect_stdout(table):
        table_code = main(["tradeoff", f"{__file__}:cli_target", "--budgets", "0.0075", "--repeats", "1",
                           "--optimizer", "adamw"])
    del os.environ["WORLD_SIZE"], os.environ["RANK"]
    return dict(code=code, out=buf.getvalue(), table_code=table_code, table=table.getvalue())


def mismatch(rank: int) -> dict:
    """A model wrapped differently on the two ranks, then remat called on rank 0 only: errors, no hang."""
    out = {}
    model, inputs, loss_fn, opt = build("gpt", "fsdp2" if rank == 0 else "fsdp2-keep", rank)
    try:
        remat.optimize_checkpointing(model, 1.0, inputs, loss_fn=loss_fn, optimizer=opt, timeout_s=60)
    except remat.InvalidInputError as e:
        out["wrapped_differently"] = str(e)
    model, inputs, loss_fn, opt = build("gpt", "fsdp2", rank)
    try:  # the same wrapping, another budget on each rank
        remat.optimize_checkpointing(model, 1.0 + rank, inputs, loss_fn=loss_fn, optimizer=opt, timeout_s=60)
    except remat.InvalidInputError as e:
        out["budgets_differ"] = str(e)
    dist.barrier()
    t0 = time.monotonic()
    if rank == 0:
        model, inputs, loss_fn, _ = model_and_batch("gpt", rank)  # not wrapped: no collective to build it
        opt = torch.optim.AdamW(model.parameters())
        try:
            remat.optimize_checkpointing(model, 1.0, inputs, loss_fn=loss_fn, optimizer=opt, timeout_s=3)
        except remat.InvalidInputError as e:
            out["alone"] = str(e)
    out["alone_s"] = time.monotonic() - t0
    dist.barrier()
    return out
