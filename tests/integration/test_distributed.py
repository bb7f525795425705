"""One plan for every rank under FSDP2 and DDP (Note [One plan for every rank] in remat.runtime.distributed):
two CPU processes with gloo, a GPT-style model with dropout and a ResNet with BatchNorm."""

from __future__ import annotations

import json
import socket

import pytest
import torch
import remat

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch built without torch.distributed", allow_module_level=True)

import distributed_worker  # noqa: E402
from helpers import needs_fake_world_floor  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    torch.multiprocessing.spawn(distributed_worker.run, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


CASES = distributed_worker.CASES


@pytest.mark.parametrize("case", CASES)
def test_every_rank_checkpoints_the_same_units(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["plan"] == r1["plan"]
    assert [row["units"] for row in r0["rows"]] == [row["units"] for row in r1["rows"]]
    assert r0["rows"][0]["units"], "the least-memory plan checkpoints something"
    assert r0["memory_recorded_with"] == "real"
    # FSDP2 and tensor parallelism are traced with torch.fx without their module hooks (Note [Tracing without
    # module hooks]): the ResNet traces, the GPT does not (fx cannot unpack a proxy's shape; torch.export,
    # which can, would run the hooks); DDP's wrapper is never traced
    assert r0["capture"] == ("fx" if case == "resnet/fsdp2" else "hooks"), r0["capture"]
    assert r0["world"] == 2 and r0["wrapping"].startswith("FSDP2" if "fsdp2" in case else "DDP")


def test_under_fsdp2_a_traced_model_gets_selective_options_that_are_exact(ranks):
    """The ResNet under FSDP2 traces: its units get selective options; two of them forced alone give the plain
    wrapped model's gradients and buffers bitwise, on every rank, and are predicted within 5% of FSDPMemTracker."""
    for rank in ranks:
        forced = rank["resnet/fsdp2"]["selective"]
        assert len(forced) == 2, forced
        for f in forced:
            assert f["mismatches"] == [], f
            assert abs(f["predicted"] - f["measured"]) <= 0.05 * f["measured"], f
    assert ranks[0]["gpt/fsdp2"]["selective"] == [] and ranks[0]["resnet/ddp"]["selective"] == []


def test_under_fsdp2_no_unit_recomputes_another_sharded_module(ranks):
    """The ResNet's blocks are each fully_shard-ed: the container and its segments would recompute them
    (gathering their parameters again in backward); under DDP they are candidates."""
    fsdp = ranks[0]["resnet/fsdp2"]["candidates"]
    assert "blocks.0" in fsdp and "blocks" not in fsdp and not any(u.startswith("blocks[") for u in fsdp)
    ddp = ranks[0]["resnet/ddp"]["candidates"]
    assert "module.blocks" in ddp and any(u.startswith("module.blocks[") for u in ddp)


@pytest.mark.parametrize("case", CASES)
def test_per_rank_peak_meets_the_budget_and_matches_the_prediction(ranks, case):
    for rank in ranks:
        for row in rank[case]["rows"]:
            # torch's own meter (FSDPMemTracker / MemTracker), on a real training step with the plan applied
            assert row["measured"] <= row["budget"], row
            assert abs(row["own_rank_predicted"] - row["measured"]) <= 0.05 * row["measured"], row
            assert row["checked"] <= row["budget"]
    if case.endswith("ddp"):  # rank 1's batch is twice rank 0's: the plan is predicted for the worst rank
        worst = [max(ranks[0][case]["rows"][i]["own_rank_predicted"], ranks[1][case]["rows"][i]["own_rank_predicted"])
                 for i in range(3)]
        assert worst == [row["predicted"] for row in ranks[0][case]["rows"]]
        assert ranks[1][case]["rows"][2]["own_rank_predicted"] > ranks[0][case]["rows"][2]["own_rank_predicted"]


@pytest.mark.parametrize("case", CASES)
def test_gradients_and_buffers_are_bitwise_those_of_the_plain_wrapped_model(ranks, case):
    for rank in ranks:
        assert rank[case]["grad_mismatches"] == []


@pytest.mark.parametrize("case", CASES)
def test_a_saved_plan_applies_on_every_rank_and_refuses_another_wrapping(ranks, case):
    for rank in ranks:
        # every unit of the plan applied, once each (the model lists them in module order, the plan in its own)
        assert sorted(rank[case]["applied"]) == sorted(rank[case]["plan"]), (rank[case]["applied"], rank[case]["plan"])
        assert "this plan was made for" in rank[case]["refused"]


def test_the_command_line_plans_once_for_every_rank(ranks):
    """``remat plan`` under torchrun: rank 0 prints the plan and every rank's measured peak; rank 1 is quiet."""
    r0, r1 = ranks[0]["cli"], ranks[1]["cli"]
    assert r0["code"] == 0 and r1["code"] == 0
    assert "FSDP2 over 2 ranks" in r0["out"] and "checkpointed (" in r0["out"]
    assert "rank 0: peak" in r0["out"] and "rank 1: peak" in r0["out"] and "OVER" not in r0["out"]
    assert r1["out"] == ""
    # remat tradeoff: the hand rules and remat's plans, each measured on every rank (in place)
    assert r0["table_code"] == 0 and r1["table"] == ""
    assert "every_block" in r0["table"] and "remat-op" in r0["table"] and "per rank" in r0["table"]
    assert "measured in place on every rank" in r0["table"] and "infeasible" not in r0["table"]


def test_mismatched_ranks_are_errors_not_hangs(ranks):
    for r, rank in enumerate(ranks):
        assert "wrapped differently on different ranks" in rank["mismatch"]["wrapped_differently"]
        assert "budget_gb differs between ranks (rank 0: 1.0, rank 1: 2.0)" in rank["mismatch"]["budgets_differ"]
    alone = ranks[0]["mismatch"]
    assert "rank(s) [1] of 2 did not call it within 0.5 s" in alone["alone"]
    assert alone["alone_s"] < 30
    # then rank 1 alone calls remat (on a tensor-parallel model): its call counter is one behind rank 0's, whose
    # abandoned call it would have met and then waited in a collective for ever (it hung before); it finds
    # that call's verdict and stops at once
    assert "another rank gave up waiting for this rank" in ranks[1]["mismatch"]["tp_alone"]


def test_the_allocator_level_meter_counts_the_callers_allocations_not_gloos_scratch(ranks):
    """Issue #46: gloo allocates a buffer of its own per collective on its worker threads, whose overlap with the
    step's peak depends on scheduling (a compiled FSDP2 plan read 3,264 bytes over its budget in CI when it did).
    remat's allocator-level meter counts what the caller's thread allocates, as this test's own reading of the
    profiler's events does, and not gloo's scratch (Note [The step's threads] in remat._compat.profiler). With
    every thread counted, the meter read the scratch too: 1,200,000 bytes where the caller's are 1,000,000."""
    for rank in ranks:
        r = rank["gloo-scratch"]
        assert r["others"] >= r["output"], r  # gloo's own thread allocated an output-sized buffer
        assert r["peak"] == r["caller"] and r["scratch"] == r["others"], r
        assert r["caller"] >= r["output"], r


def test_the_allocator_level_meter_counts_gloos_copy_of_a_reduce_scatters_input_as_its_scratch(ranks):
    """CI on a new machine: a compiled FSDP2 plan read 82,432 bytes more than its check in all three steps of the
    test's reading, 3,264 over its budget. Gloo copies a reduce-scatter's input on the caller's thread inside its
    ``c10d::`` operator (the root's gradients: 82,432 bytes) and its work holds the copy; where gloo's thread
    drops the work last, the profiler never reports the free, and the meter counted the copy to the end of the
    step. It is gloo's scratch, as its threads' buffers are (Note [The step's threads] in remat._compat.profiler):
    the meter and this test's reading count the caller's own tensors only, on every rank. Counted, rank 0 (whose
    work gloo's thread drops last, the other rank joining 0.3 s late) read 1,100,000 bytes where its own are
    900,000."""
    for rank in ranks:
        r = rank["gloo-copy"]
        assert r["peak"] == r["caller"] == r["own"], r
        assert r["scratch"] >= r["copy"] and r["others"] >= r["copy"], r


@pytest.mark.parametrize("case", ["tp", "tp-sp"])
def test_tensor_parallel_gets_one_plan_within_budget_and_exact(ranks, case):
    """Issue #26: a Llama-style decoder under torchtitan's tensor-parallel plan (2 ranks, gloo), with and without
    sequence parallelism: one plan on every rank, checkpointing something; each rank's peak by torch's
    MemTracker within the per-rank budget and the prediction; loss and full gradients bitwise those of the plain
    tensor-parallel model; the plan says which units recompute collectives and how many bytes."""
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["plan"] == r1["plan"] and r0["plan"], (r0["plan"], r1["plan"])
    assert r0["wrapping"] == "tensor parallel over 2 ranks (mesh tp=2)"
    for r in (r0, r1):
        assert r["least"] < r["budget"] < r["baseline"]
        assert r["checked"] <= r["budget"] and r["measured"] <= r["budget"], r
        # the per-rank budget holds by remat's check and by two independent meters, torch's MemTracker and the
        # profiler's allocator-level events
        assert max(r["checked"], r["measured"], r["allocated"]) <= r["budget"], r
        # Issue #49: each meter reads its five steps alike. A collective's tensors were freed by whichever thread
        # dropped the last reference, the caller's or gloo's, so steps read apart (in CI one MemTracker reading
        # 23% above the usual; locally eight steps by the allocator's events 1,869,788-2,066,396 bytes): the
        # meters' collectives are settled, waited for until gloo's thread has dropped them (distributed_worker.
        # Settled; Note [Collectives settled] in remat.runtime.distributed)
        assert len(set(r["measured_steps"])) == 1 and len(set(r["allocated_steps"])) == 1, r
        # and the prediction, from remat's one recorded real step (settled too), is within 3% of each meter's
        # reading, either way, with or without sequence parallelism. (It was 5-6% above them while remat planned
        # for a loop that keeps the output, the logits, and the meters ran one that drops it. Under sequence
        # parallelism the recording counted the storages of the collectives' wrapper tensors, which hold no
        # memory: 48 KiB, 2.7% above the allocator's events, Note [Storages without memory] in
        # remat.runtime.tracker; unsettled, in CI it read 176 KiB and 209 KiB above the meters, and locally, once,
        # 23,680 bytes above the plan's settled peak)
        for meter in ("measured", "allocated"):
            assert abs(r["predicted"] - r[meter]) <= 0.03 * r[meter], (meter, r)
        assert r["grad_mismatches"] == []
        # remat's check read three steps by the allocator's events, keeping the largest: under gloo one step's peak
        # is not the next one's (Note [Steps under gloo]; one dispatch-level step missed budgets by up to 9.1% in
        # benchmarks/distributed/tensor_parallel.py)
        assert [n for n in r["notes"] if n.startswith("checked on 3 real steps, the largest by the allocator's events")], \
            r["notes"]
    # which units' recomputation runs collectives again (Note [Recomputed communication]): checkpoint stops a
    # recomputation once backward has what it needs, so a unit's closing all_reduce / reduce_scatter (Rowwise
    # wo, w2) is not run again, and PrepareModuleInput's all_gather runs in a pre-hook, outside a checkpointed
    # attention or feed-forward; a whole layer recomputes its attention's all_reduce (with sequence parallelism:
    # both all_gathers and the attention's reduce_scatter)
    comm = r0["collectives"]
    ops = [f"_c10d_functional.{c}.default" for c in
           (("all_reduce",) if case == "tp" else ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_into_tensor"))]
    assert comm["layers.0"] == comm["layers.1"] == ops, comm
    assert comm["layers.0.attention"] == comm["layers.0.feed_forward"] == [], comm
    by_hand = [n for n in r0["layer_notes"] if n.startswith("recomputes communication in backward")]
    # the activations are 4 x 32 tokens x 64 fp32 = 32,768 bytes; a reduce_scatter makes half of that per rank
    size = "32,768 bytes" if case == "tp" else "81,920 bytes"
    assert by_hand == [f"recomputes communication in backward: 1 unit(s) run {len(ops)} collective(s) again, "
                       f"{size} in all (layers.0: " + (
                           "all_reduce x1" if case == "tp" else "all_gather_into_tensor x2, reduce_scatter_tensor x1")
                       + f", {size}); their time is in the predicted step time (each recomputation was timed for "
                         "real, collectives included: Note [Recomputed communication] in remat.costs.effects)"], by_hand
    # selective options under tensor parallelism (Note [Tracing without module hooks]): the decoder traces
    # with fx, its module hooks left out (with them, SequenceParallel's refused a proxy), and its layers' menus
    # hold the hand policy, which keeps the output of the collective closing the attention (the Rowwise all_reduce;
    # with sequence parallelism the reduce_scatter): that option does not run it again, where the whole layer does
    assert r0["capture"] == "fx"
    closing = "_c10d_functional.all_reduce.default" if case == "tp" else "_c10d_functional.reduce_scatter_tensor.default"
    keeping = [u for u, kept in r0["saved_ops"].items() if u.startswith("layers.0@ops") and f"{closing}#0" in kept]
    assert keeping and all(closing not in comm[u] for u in keeping) and closing in comm["layers.0"], (keeping, comm)
    recomputing = [u for u in r0["plan"] if comm.get(u)]
    notes = [n for n in r0["notes"] if n.startswith("recomputes communication in backward")]
    assert len(notes) == (1 if recomputing else 0), (r0["plan"], notes)
    assert all(f"{u}: " in notes[0] for u in recomputing)


def test_loss_parallel_is_planned_and_exact(ranks):
    """``loss_parallel()`` (logits sharded on the vocabulary, the loss a DTensor whose backward must run inside
    the context): remat's own backward failed and blamed the user's inputs ("the training step fails without
    remat too"); it now runs it inside the context (Note [Loss parallel]): one plan on every rank, within
    budget, and one step gives the plain model's loss and gradients bitwise."""
    r0, r1 = ranks[0]["tp-loss"], ranks[1]["tp-loss"]
    assert r0["plan"] == r1["plan"] and r0["plan"]
    for r in (r0, r1):
        assert r["checked"] <= r["budget"] and r["grad_mismatches"] == [], r


@needs_fake_world_floor
@pytest.mark.parametrize("case", ["gpt/fsdp2", "gpt/fsdp2-keep", "resnet/fsdp2"])
def test_a_world_of_two_modelled_on_the_fake_process_group_predicts_the_real_ranks_peaks(ranks, case):
    """Check (2) of issue #39: the same model and batch as rank 0's, wrapped alike but on torch's fake process group
    at world size 2 in this process (``Target(device="cpu", world=2)``: nothing runs for real), predicts the peak
    that torch's own meter measured on the real 2-rank gloo run, for each plan that run measured."""
    from torch.distributed.fsdp import fully_shard

    kind, how = case.split("/")
    model, inputs, loss_fn, blocks = distributed_worker.model_and_batch(kind, 0)
    names = {id(m): n for n, m in model.named_modules()}
    block_names = [names[id(b)] for b in blocks]

    def parallelize(fake, mesh):
        mods = dict(fake.named_modules())
        for n in block_names:
            fully_shard(mods[n], mesh=mesh, reshard_after_forward=how != "fsdp2-keep")
        fully_shard(fake, mesh=mesh, reshard_after_forward=how != "fsdp2-keep")

    profile = remat.make_profile(model, inputs, loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                 output_alive=False, target=remat.Target(device="cpu", world=2, parallelize=parallelize))
    planner = remat.Planner(profile, granularity="op")
    for row in ranks[0][case]["rows"]:
        predicted = planner.make_plan(tuple(row["units"]), "measured there").predicted_peak_bytes
        # within 1% of the real step as remat meters it (forward and backward at dispatch level, the optimizer's
        # state and step as predicted; the least of ROW_READINGS readings, as torch's meter is read: under gloo a
        # reading may hold a collective's buffer) and within 2% of torch's FSDPMemTracker on a whole real step (which
        # read the ResNet's steps 1.3% below remat's meter)
        assert abs(predicted - row["checked_least"]) <= 0.01 * row["checked_least"], (row, predicted)
        assert abs(predicted - row["measured"]) <= 0.02 * row["measured"], (row, predicted)


@needs_fake_world_floor
@pytest.mark.parametrize("case", ["tp", "tp-sp"])
def test_tensor_parallel_modelled_on_the_fake_process_group_predicts_the_real_ranks_peaks(ranks, case):
    """Check (2) of issue #39 for tensor parallelism (with and without sequence parallelism): the Llama and batch
    of the real 2-rank run, parallelized alike on torch's fake process group in this process, predicts the plan's
    per-rank peak as measured there."""
    from distributed_worker import Llama, apply_tp

    torch.manual_seed(0)
    model = Llama()
    g = torch.Generator().manual_seed(5)
    idx, targets = (torch.randint(0, model.output.out_features, (4, 32), generator=g) for _ in range(2))
    loss_fn = lambda out: torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
    target = remat.Target(device="cpu", world=2, tp=2,
                          parallelize=lambda m, mesh: apply_tp(m, mesh["tp"], case == "tp-sp"))
    profile = remat.make_profile(model, idx, loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                 output_alive=False, target=target)
    r = ranks[0][case]
    predicted = remat.Planner(profile, granularity="op").make_plan(tuple(r["plan"]), "the run's").predicted_peak_bytes
    # Within 1% of the real run's own prediction (made from a recording of its real step), and of torch's
    # MemTracker and the profiler's allocator events on its real steps, with and without sequence parallelism
    # (issue #49: the real readings settled, five steps alike, and neither recording counting the storages of
    # tensors that hold no memory, Note [Storages without memory] in remat.runtime.tracker; before, under sequence
    # parallelism the modelled peak read 1,935,316 bytes against 1,869,788 by the allocator's events and the bands
    # were 1% below and 4% above). (remat's check is not compared: it keeps the largest of three real steps by
    # the allocator's events, which still read frees gloo's threads make unreported, Note [Collectives settled])
    for meter in ("predicted", "measured", "allocated"):
        assert abs(predicted - r[meter]) <= 0.01 * r[meter], (meter, predicted, r)
