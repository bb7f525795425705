"""remat's activation-checkpointing policy inside torchtitan 0.3 (issue #61), through torchtitan's own functions:
its config registry and ``parallelize_llama`` on its Llama 3 debug model with one and two gloo ranks (tests/integration/
torchtitan_job.py), against torchtitan's FullAC and no checkpointing. Slow (about 75 s for one rank on 2 cores: each
job plans twice in a process of its own); the fast checks are in tests/integration/test_torchtitan.py."""

from __future__ import annotations

import json
import socket

import pytest
import torch

pytest.importorskip("triton", reason="torchtitan 0.3 imports triton at import (pip install 'remat[torchtitan]')")
pytest.importorskip("torchtitan", reason="needs torchtitan 0.3: pip install 'remat[torchtitan]'")

import torchtitan_job  # noqa: E402
from remat.errors import PlanMismatchError  # noqa: E402
from remat.integrations.torchtitan import RematAC  # noqa: E402
from remat.solve.plan import Plan  # noqa: E402

GiB = 2**30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_job(out, world: int, variants: tuple[str, ...]) -> list[dict]:
    try:
        torch.multiprocessing.spawn(torchtitan_job.run, args=(world, free_port(), str(out), variants), nprocs=world,
                                    join=True)
    except torch.multiprocessing.ProcessExitedException as e:
        raise AssertionError(f"{e}; the stages each rank reached: {torchtitan_job.progress(out, world)}") from e
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The job on ``world`` ranks, run once per world for the module."""
    done: dict = {}

    def run(world: int):
        if world not in done:
            out = tmp_path_factory.mktemp(f"torchtitan{world}")
            done[world] = out, spawn_job(out, world, ("none", "full", "remat", "refused"))
        return done[world]
    return run


@pytest.fixture(params=[1, 2], ids=["1 rank", "2 ranks"])
def job(request, jobs):
    return jobs(request.param)


@pytest.fixture
def one_rank(jobs):
    out, ranks = jobs(1)
    return out, ranks[0]


def test_in_parallelize_llama_the_plan_meets_the_budget_with_the_gradients_of_full_ac_and_of_none(job):
    out, ranks = job
    assert len({json.dumps(r["remat"]["plan_checkpointed"]) for r in ranks}) == 1, "one plan for every rank"
    for rank, r in enumerate(ranks):
        remat_run = r["remat"]
        assert remat_run["plan_checkpointed"], "the budget needs checkpointing"
        assert remat_run["predicted_peak_bytes"] <= remat_run["budget_bytes"] == int(torchtitan_job.BUDGET_GB * GiB)
        assert remat_run["measured_peak_bytes"] <= remat_run["budget_bytes"], remat_run
        assert r["none"]["measured_peak_bytes"] > remat_run["budget_bytes"], "without checkpointing it does not fit"
        assert remat_run["loss"] == r["full"]["loss"] == r["none"]["loss"]
        grads = {v: torch.load(out / f"grads-{v}-rank{rank}.pt") for v in ("none", "full", "remat")}
        assert grads["remat"].keys() == grads["none"].keys() == grads["full"].keys()
        for name, g in grads["remat"].items():
            assert torch.equal(g, grads["none"][name]), name
            assert torch.equal(g, grads["full"][name]), name


def test_a_budget_below_the_least_peak_stops_the_job_on_every_rank_before_the_model_exists(job):
    for r in job[1]:
        refused = r["refused"]
        assert refused["error"] == "InfeasibleBudgetError" and not refused["materialized"]
        assert refused["min_feasible_bytes"] > torchtitan_job.REFUSED_GB * GiB
        assert "no step ran" in refused["message"]


def test_the_saved_plan_applies_and_another_models_plan_is_refused(one_rank, tmp_path):
    from torchtitan.models.llama3 import model_registry

    out, r = one_rank
    saved = out / "dump-remat" / "remat_plan.json"
    assert Plan.load(saved).checkpointed == tuple(r["remat"]["plan_checkpointed"])
    config = model_registry("debugmodel").model
    with torch.device("meta"):
        same = config.build()
    policy = RematAC.Config(plan_path=str(saved)).build(dump_folder="")
    policy.apply(same)
    assert policy.plan.checkpointed == tuple(r["remat"]["plan_checkpointed"])
    config.layers = config.layers[:4]
    with torch.device("meta"):
        other = config.build()
    with pytest.raises(PlanMismatchError, match="another model"):
        RematAC.Config(plan_path=str(saved)).build(dump_folder="").apply(other)


def test_the_command_line_plans_a_torchtitan_model_by_name_for_gpus_not_here(capsys, tmp_path):
    """``remat plan torchtitan:llama3:debugmodel --device h100-80gb --world 8``: the package's model, its FSDP2
    wrapping, FlexAttention planned as the GPU's SDPA; every figure predicted."""
    from remat.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "torchtitan:llama3:debugmodel", "--device", "h100-80gb", "--world", "8", "--batch", "2",
                 "--seq", "2048", "--budget", "0.5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "x 8 ranks (FSDP 8)" in printed and "torchtitan's apply_fsdp_to_decoder" in printed
    assert "FlexAttention planned as SDPA" in printed
    plan = Plan.load(out)
    assert plan.predicted_reserved_bytes <= 0.5 * GiB


def test_a_mixture_of_experts_from_the_package_plans_for_gpus_not_here(capsys):
    """DeepSeek-V3's debug flavour as the installed torchtitan builds it (MoE layers, their FSDP2 wrapping), planned for
    two H100s on fake tensors."""
    from remat.cli import main

    assert main(["plan", "torchtitan:deepseek_v3:debugmodel", "--device", "h100-80gb", "--world", "2", "--batch", "2",
                 "--seq", "256", "--budget", "1"]) == 0
    printed = capsys.readouterr().out
    assert "torchtitan deepseek_v3 debugmodel" in printed and "x 2 ranks (FSDP 2)" in printed
