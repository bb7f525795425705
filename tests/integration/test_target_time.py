"""Step time on a modelled target (issue #40): plans ranked by the target's device model, the predicted step
time, tokens/s and MFU on the plan, the CLI and --json."""

import json

import pytest
import torch
from torch import nn

import remat
from remat import Target
from remat.examples import GPT
from remat.target.devices import DeviceSpec, cpu_spec

from helpers import needs_fake_world_floor

#: this machine's CPU as measured here when the test was written (remat.target.timing.measure_cpu: 182 GFLOP/s
#: float32, 74 GB/s copying), fixed so the test does not depend on the machine it runs on
CPU = DeviceSpec(**{**cpu_spec().to_dict(), "fp32_flops_per_s": 182e9, "hbm_bytes_per_s": 74e9, "sources": ()})
#: what measure_cpu read here on 2026-12-02 and 03 (the timing cache's entries), for the figures a spec does not give
CPU_MEASURED = {"flops_per_s": 434.2e9, "bf16_flops_per_s": 1.66e12, "fp16_flops_per_s": 4.33e11,
                "memory_bytes_per_s": 58.6e9, "random_bytes_per_s": 1.70e9, "dispatch_s": 4.42e-6, "threads": 2.0,
                "matmul_efficiency": 0.867, "conv_efficiency": 0.583, "reduction_efficiency": 0.288,
                "transcendental_efficiency": 0.442, "pointwise_efficiency": 0.610}


@pytest.fixture(autouse=True)
def this_cpu_as_measured(monkeypatch):
    """The CPU target's dispatch cost, class efficiencies and checkpoint bookkeeping as measured here, not on the
    machine the test runs on."""
    from remat.costs.recording import CheckpointOverhead
    from remat.profile import cache

    monkeypatch.setattr(cache, "device_rates", lambda measure: (dict(CPU_MEASURED), "fixed by the test"))
    monkeypatch.setattr(cache, "overhead", lambda device, measure: CheckpointOverhead(9.7e-5, 1.0e-5, 4.1e-5, 5056))


class TwoUnits(nn.Module):
    """Two candidate units that free about as much when checkpointed: ``matmul``, an up- and a down-projection
    (saves the 8x wider hidden: 16 MiB), and ``pointwise``, twelve SiLUs (each saves its input: 2 MiB each);
    a projection before them and one after (so neither is the last unit before the loss, which frees nothing)."""

    def __init__(self, d: int = 256, silus: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d, bias=False)
        self.matmul = nn.Sequential(nn.Linear(d, 8 * d, bias=False), nn.Linear(8 * d, d, bias=False))
        self.pointwise = nn.Sequential(*(nn.SiLU() for _ in range(silus)))
        self.head = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pointwise(self.matmul(self.inp(x))))


def test_the_cpu_and_an_h100_rank_two_plans_oppositely_and_each_gets_the_faster_one():
    """4,096 tokens x 256 in bf16. On this CPU (182 GFLOP/s, 74 GB/s, plus its dispatch per operator) the two
    projections (8.6 GFLOPs) take 47 ms to recompute, a SiLU 0.06 ms; on an H100 (989 TFLOP/s dense bf16 at
    78%, 3.35 TB/s) the projections take 13 us and each SiLU is a 2 us kernel (its launch: 4 MB at 3 TB/s
    takes 1.4 us), so the seven or more SiLUs that free as much cost more. A budget 14 MiB under no
    checkpointing gets SiLUs on the CPU and the projections on the H100."""
    with torch.device("meta"):
        model = TwoUnits().to(torch.bfloat16)
    x = torch.empty(4096, 256, dtype=torch.bfloat16, device="meta")
    loss_fn = lambda out: out.float().square().mean()  # noqa: E731
    plans = {}
    for name, device in (("cpu", CPU), ("h100", "h100-80gb")):
        profile = remat.make_profile(model, x, loss_fn=loss_fn, target=Target(device=device))
        units = {u.name: u for u in profile.units}
        planner = remat.Planner(profile)
        one = {u: planner.make_plan((u,), u) for u in ("pointwise", "matmul")}
        budget = planner.baseline_peak_bytes - 14 * 2**20
        assert all(p.predicted_peak_bytes <= budget for p in one.values()), \
            {u: (p.predicted_peak_bytes, budget) for u, p in one.items()}  # either fits alone
        plans[name] = (planner.plan_for_budget(budget), one, units)
    cpu_plan, cpu_one, cpu_units = plans["cpu"]
    h100_plan, h100_one, h100_units = plans["h100"]
    # the two targets rank the same two plans in opposite order ...
    assert cpu_units["pointwise"].recompute_s < cpu_units["matmul"].recompute_s
    assert h100_units["matmul"].recompute_s < h100_units["pointwise"].recompute_s
    assert cpu_one["pointwise"].predicted_step_time_s < cpu_one["matmul"].predicted_step_time_s
    assert h100_one["matmul"].predicted_step_time_s < h100_one["pointwise"].predicted_step_time_s
    # ... and each target's ILP picks what is faster there: SiLUs (a run of them) here, the projections there
    assert cpu_plan.checkpointed and all(u.startswith("pointwise") for u in cpu_plan.checkpointed), cpu_plan
    assert h100_plan.checkpointed == ("matmul",)


def test_a_plan_for_gpus_shows_its_predicted_step_time_tokens_per_second_and_mfu(tmp_path):
    with torch.device("meta"):
        model = GPT(1024, 256, 256, 4, 4, 0.0)
    ids = torch.zeros(8, 256, dtype=torch.long, device="meta")
    plan = remat.optimize_checkpointing(model, 0.2, (ids, ids), optimizer=torch.optim.AdamW(model.parameters()),
                                        target=Target(device="h100-80gb"))
    assert plan.tokens_per_step == 8 * 256
    assert plan.predicted_tokens_per_s == pytest.approx(8 * 256 / plan.predicted_step_time_s)
    # FLOPs of a plain step (forward and backward) over the predicted time and the H100's float32 peak
    assert plan.peak_flops_per_s == 67e12 and 0 < plan.predicted_mfu < 0.78
    assert plan.model_flops == pytest.approx(3 * 2 * 8 * 256 * sum(p.numel() for p in model.parameters()), rel=0.35)
    text = str(plan)
    assert "tokens/s per device" in text and "MFU" in text and "(predicted, not measured)" in text
    saved = tmp_path / "plan.json"
    plan.save(saved)
    d = json.loads(saved.read_text())
    assert d["predicted_tokens_per_s"] == pytest.approx(plan.predicted_tokens_per_s)
    assert d["predicted_mfu"] == pytest.approx(plan.predicted_mfu)
    assert remat.Plan.load(saved).predicted_mfu == pytest.approx(plan.predicted_mfu)


def test_the_command_line_shows_predicted_step_time_tokens_per_second_and_mfu(capsys, tmp_path):
    from remat.cli import main

    code = main(["tradeoff", "gpt", "--layers", "2", "--batch", "4", "--seq", "32", "--d-model", "32", "--device",
                 "h100-80gb", "--points", "2", "--json", str(tmp_path / "rows.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "tokens/s per" in out and "MFU" in out and "step time" in out and "not measured" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows["predicted"] is True and rows["measured"] is False
    first = rows["rows"][0]
    assert first["predicted_tokens_per_s"] == pytest.approx(4 * 32 / first["predicted_step_time_s"])
    assert 0 < first["predicted_mfu"] < 1
    code = main(["plan", "gpt", "--layers", "2", "--batch", "4", "--seq", "32", "--d-model", "32", "--device",
                 "h100-80gb", "--budget", "1", "--json", str(tmp_path / "plan.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "predicted throughput:" in out and "tokens/s per device" in out
    assert json.loads((tmp_path / "plan.json").read_text())["predicted_tokens_per_s"] > 0


@needs_fake_world_floor
def test_the_optimizer_steps_time_on_sharded_parameters_leaves_out_dtensors_sharding_propagation():
    """The first time a DTensor operator is seen, DTensor works out its output's sharding by running it at global
    shapes (then caches it): not a kernel of the step. Counted, the first profile of a process read gradient
    clipping and a foreach AdamW step on FSDP 8 as twice as long as every later one (torchtitan's 8B: 58 ms, then
    29 ms; here 54 and 38 us). Shapes of its own here, so that DTensor's cache is cold."""
    with torch.device("meta"):
        model = GPT(328, 24, 88, 2, 2, 0.0)
    ids = torch.zeros(2, 24, dtype=torch.long, device="meta")
    first, second = (remat.make_profile(model, (ids, ids), optimizer=torch.optim.AdamW(model.parameters()),
                                        target=Target(device="h100-80gb", world=8, clip_grad_norm=1.0)).optimizer_s
                         for _ in range(2))
    assert first == second > 0
