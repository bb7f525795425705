"""remat's torchtitan integration (issue #61), the fast part: a user's config registry function selecting the policy,
errors carried from the planning process, and ``torchtitan:NAME:FLAVOR`` targets. The jobs on gloo ranks through
torchtitan's ``parallelize_llama``: tests/slow/test_torchtitan_policy.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="torchtitan 0.3 imports triton at import (pip install 'remat[torchtitan]')")
pytest.importorskip("torchtitan", reason="needs torchtitan 0.3: pip install 'remat[torchtitan]'")

import torchtitan_job  # noqa: E402
from remat.errors import InfeasibleBudgetError, InvalidInputError, UnsupportedError  # noqa: E402
from remat.integrations.torchtitan import RematAC, remat_ac  # noqa: E402

GiB = 2**30


def test_a_config_registry_function_selects_remats_policy_with_the_run_read_from_its_config():
    config = torchtitan_job.llama3_debugmodel_remat()
    ac = config.activation_checkpoint
    assert isinstance(ac, RematAC.Config) and ac.budget_gb == torchtitan_job.BUDGET_GB
    assert (ac.local_batch_size, ac.seq_len, ac.param_dtype, ac.loss_chunks) == (4, 512, "float32", 0)
    assert (ac.optimizer, ac.max_norm, ac.compiled, ac.other_parallelism) == ("AdamW", 1.0, False, "")
    assert isinstance(ac.build(dump_folder=""), RematAC)


def test_torchtitans_own_debug_config_is_read_with_its_chunked_loss_and_bf16():
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.parallelism.tensor_parallel_degree = 2
    ac = remat_ac(config, budget_gb=8)
    assert (ac.local_batch_size, ac.seq_len, ac.param_dtype, ac.loss_chunks) == (8, 2048, "bfloat16", 8)
    assert ac.other_parallelism == "tp=2"
    with pytest.raises(UnsupportedError, match="tp=2"):
        ac.build(dump_folder="").apply(torch.nn.Module())


def test_a_policy_without_budget_or_plan_is_refused_with_the_remedy():
    from torchtitan.models.llama3 import model_registry

    with torch.device("meta"):
        model = model_registry("debugmodel").model.build()
    with pytest.raises(InvalidInputError, match="budget_gb"):
        RematAC.Config().build(dump_folder="").apply(model)


def test_an_infeasible_budget_from_the_planning_process_is_raised_with_the_least_peak():
    from remat.integrations.torchtitan.policy import from_result

    with pytest.raises(InfeasibleBudgetError, match="no step ran") as e:
        from_result({"error": "InfeasibleBudgetError", "message": "least 1.0 GiB", "budget_bytes": 1,
                     "min_feasible_bytes": GiB})
    assert (e.value.budget_bytes, e.value.min_feasible_bytes) == (1, GiB)


def test_a_torchtitan_target_builds_the_packages_model_with_its_flavour():
    from remat.cli.targets import resolve_target

    step, (tokens,), loss_fn, desc, parallelize = resolve_target("torchtitan:llama3:debugmodel",
                                                                 device=torch.device("meta"),
                                                                 options={"batch_size": 2, "seq_len": 64},
                                                                 with_parallelize=True)
    assert tokens.shape == (2, 64) and callable(parallelize)
    assert sum(p.numel() for p in step.parameters()) == 6_163_712  # torchtitan's Llama 3 debug model
    assert "FlexAttention planned as SDPA" in desc
    with pytest.raises(InvalidInputError, match="flavours: debugmodel"):
        resolve_target("torchtitan:llama3:9B", device=torch.device("meta"))
    with pytest.raises(InvalidInputError, match="torchtitan:NAME:FLAVOR"):
        resolve_target("torchtitan:llama3", device=torch.device("meta"))
