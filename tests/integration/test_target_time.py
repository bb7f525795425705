"""Step time on a modelled target (issue #40): plans ranked by the target's device model, the predicted step
time, tokens/s and MFU on the plan, the CLI and --json."""

import json

import pytest
import torch
from torch import nn

import remat
from remat import Target
from remat.examples import GPT, make_gpt
from remat.target import timing
from remat.costs.host_time import HostWork
from remat.target.devices import DeviceSpec, cpu_spec
from remat.target.timing import measure_cpu

from cpu_limits import check_rates, cpu_limits, has_float16_arithmetic
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


#: Note [CPU efficiencies]'s sample classes at sizes a fraction of its own (CPU_SAMPLES): measure_cpu runs every
#: sample 4 x 46 steps, 60 s of the 90 it took here with those; these take about 2 s
SMALL_SAMPLES = {
    "matmul": (("Linear 128 x 128, 256 rows", lambda: (nn.Linear(128, 128), (256, 128))),),
    "conv": (("Conv2d 3x3 8 -> 8, 2 x 16 x 16", lambda: (nn.Conv2d(8, 8, 3, padding=1), (2, 8, 16, 16))),),
    "reduction": (("LayerNorm 128, 256 rows", lambda: (nn.LayerNorm(128), (256, 128))),
                  ("softmax over 128, 256 rows", lambda: (nn.Softmax(-1), (256, 128))),
                  ("BatchNorm2d 8, 2 x 16 x 16", lambda: (nn.BatchNorm2d(8), (2, 8, 16, 16))),
                  ("MaxPool2d 2, 2 x 8 x 16 x 16", lambda: (nn.MaxPool2d(2), (2, 8, 16, 16)))),
    "transcendental": (("GELU, 256 x 128", lambda: (nn.GELU(), (256, 128))),
                       ("SiLU, 256 x 128", lambda: (nn.SiLU(), (256, 128)))),
    "pointwise": (("ReLU, 2 x 8 x 16 x 16", lambda: (nn.ReLU(), (2, 8, 16, 16))),
                  ("x * 2 + 1, 256 x 128", lambda: (timing._Affine(), (256, 128)))),
}


class _Float16IsBFloat16:
    """``torch`` as remat.target.timing sees it, but for ``torch.float16``, which is ``torch.bfloat16``."""

    def __getattr__(self, name: str):
        return torch.bfloat16 if name == "float16" else getattr(torch, name)


def cheaper_measurement(mp: pytest.MonkeyPatch) -> None:
    """What makes :func:`measure_cpu` fit the suite (90 s here as it is, 5 s so): the class samples smaller
    (:data:`SMALL_SAMPLES`), and on a CPU without float16 arithmetic (no AVX512-FP16, no AMX-FP16: this one), its
    float16 products (40 s of the 90: 3.1 s a 1024-square product) made in bfloat16, so ``fp16_flops_per_s`` is not
    checked there. The float32 and bfloat16 products, the bandwidth, dropout's generator, the dispatch and the
    class efficiencies are measured by measure_cpu's own code."""
    mp.setattr(timing, "CPU_SAMPLES", SMALL_SAMPLES)
    if not has_float16_arithmetic():
        mp.setattr(timing, "torch", _Float16IsBFloat16())


@pytest.fixture(scope="module")
def measured_here() -> dict[str, float]:
    """:func:`measure_cpu` on this machine, once for the module (:func:`cheaper_measurement`)."""
    with pytest.MonkeyPatch.context() as mp:
        cheaper_measurement(mp)
        return measure_cpu()


def test_this_cpus_measured_rates_are_within_what_its_hardware_can_do(measured_here):
    """measure_cpu's figures against this CPU's own limits (tests/integration/cpu_limits.py: its cores, the
    vector extensions it reports, the highest clock any x86 CPU runs at): float32 and bfloat16 FLOP/s at most
    cores x clock x FLOPs a cycle, the bandwidths at most four 64-byte accesses a core a cycle, the dispatch at least
    0.1 us an operator, each class efficiency in (0, 1]. Upper bounds on rates only: a busy machine reads slower,
    never faster, so nothing here depends on how busy it is."""
    assert set(measured_here) >= {"flops_per_s", "bf16_flops_per_s", "fp16_flops_per_s", "memory_bytes_per_s",
                                  "random_bytes_per_s", "dispatch_s", "threads",
                                  *(f"{cls}_efficiency" for cls in timing.CPU_SAMPLES)}
    assert measured_here["threads"] == torch.get_num_threads()
    check_rates(measured_here)


def test_a_measurement_that_reads_ten_times_too_fast_is_caught(monkeypatch):
    """The same measurement with its clock reading a tenth of every interval (``_timed``), on one thread: the
    float32 products then read 10x what they reach (here 70 GFLOP/s on one thread, 55-170 on two), above the 6.2
    GHz x 32 FLOPs a core of this CPU (an AMD EPYC, Zen 4: AVX-512 on two 256-bit FMA pipes: 198 GFLOP/s), and
    :func:`check_rates` says so. (One thread: two that share their cores with another process wait for each other
    at every product, and read as little as 55.)"""
    cheaper_measurement(monkeypatch)
    timed = timing._timed
    monkeypatch.setattr(timing, "_timed", lambda fn: timed(fn) / 10)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        broken = measure_cpu()
    finally:
        torch.set_num_threads(threads)
    assert broken["threads"] == 1
    with pytest.raises(AssertionError, match="\n  flops_per_s = ") as caught:
        check_rates(broken)
    assert str(cpu_limits(int(broken["threads"]))) in str(caught.value)


def _recordings(monkeypatch) -> tuple[list, list]:
    """The plain steps' recordings a modelled target times (remat.target.source's ``step_time``) and the profiles
    it returns, as they are made."""
    from remat.target import source

    recordings, profiles = [], []
    step_time, profile = source.step_time, source.ModelledTarget.profile
    monkeypatch.setattr(source, "step_time", lambda rec, *a: recordings.append(rec) or step_time(rec, *a))
    monkeypatch.setattr(source.ModelledTarget, "profile",
                        lambda self, req: profiles.append(profile(self, req)) or profiles[-1])
    return recordings, profiles


def gpt_flops(*, layers: int, batch: int, seq: int, d: int, vocab: int) -> int:
    """FLOPs of a plain step (forward and backward) of remat.examples.GPT, by hand: 6 per token and weight of a
    product (each block's qkv, projection and MLP, 12 d^2; the head tied to the embedding, vocab x d: the
    embeddings themselves are lookups), and the attention's two products (scores and output, 4 x batch x seq^2 x
    d a block forward), three times over for the backward."""
    return 6 * batch * seq * (layers * 12 * d * d + vocab * d) + 3 * 4 * batch * seq * seq * d * layers


def test_the_cpu_targets_step_time_is_the_roofline_of_its_recorded_operators_at_the_rates_measured_here(
        measured_here, monkeypatch):
    """``Target(device="cpu")`` times the step by this machine's rates as measure_cpu read them: each recorded
    operator, forward and backward, takes max(FLOPs / (FLOP/s x e), bytes / (bandwidth x e)) plus the measured
    dispatch, e its class's measured efficiency (dropout's masks: their bytes at the generator's rate), summed here
    by the test (Note [Device time model]); the FLOPs are counted by hand, and the MFU is they over the plan's
    predicted step time at the measured float32 FLOP/s. (No time is measured against a prediction: the project's
    tests assert no time; benchmarks/accuracy/time_model.py compares them, docs/results.md.)"""
    from remat.costs.device_time import op_class
    from remat.profile import cache

    m = dict(measured_here)
    monkeypatch.setattr(cache, "device_rates", lambda measure: (dict(m), "measured by the test's fixture"))
    recordings, _ = _recordings(monkeypatch)

    def seconds(op) -> float:
        if op.flops <= 0 and op.bytes_accessed <= 0:  # a view: no kernel
            return 0.0
        cls = op_class(op.name)
        if op.random and cls in ("pointwise", "transcendental"):
            return op.bytes_accessed / m["random_bytes_per_s"] + m["dispatch_s"]
        e = m[f"{'matmul' if cls == 'attention' else cls}_efficiency"]
        return max(op.flops / (m["flops_per_s"] * e), op.bytes_accessed / (m["memory_bytes_per_s"] * e)) \
            + m["dispatch_s"]

    model, inputs, _ = make_gpt(layers=2, batch_size=2, seq_len=32, d_model=64, vocab=256, dropout=0.1)
    profile = remat.make_profile(model, inputs, optimizer=torch.optim.AdamW(model.parameters()),
                                 target=Target(device="cpu"))
    (rec,) = recordings
    # dropout: after the embeddings, and in each block on the attention's weights, its output and the MLP's
    assert sum(op.random for op in rec.forward_ops) == 7
    assert profile.forward_s == pytest.approx(sum(map(seconds, rec.forward_ops)), rel=1e-9)
    assert profile.backward_s == pytest.approx(sum(map(seconds, rec.backward_ops)), rel=1e-9)
    flops = gpt_flops(layers=2, batch=2, seq=32, d=64, vocab=256)
    assert profile.model_flops == flops == sum(op.flops for op in (*rec.forward_ops, *rec.backward_ops))
    planner = remat.Planner(profile)
    plan = planner.plan_for_budget((planner.min_peak_bytes + planner.baseline_peak_bytes) // 2)
    assert plan.checkpointed and plan.peak_flops_per_s == m["flops_per_s"]
    assert plan.predicted_step_time_s == pytest.approx(
        profile.forward_s + profile.backward_s + profile.optimizer_s + plan.predicted_recompute_s, rel=1e-12)
    assert plan.predicted_mfu == pytest.approx(flops / plan.predicted_step_time_s / m["flops_per_s"], rel=1e-12)


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


def test_a_plan_for_gpus_shows_its_predicted_step_time_tokens_per_second_and_mfu(tmp_path, monkeypatch):
    """The step's FLOPs counted by hand (:func:`gpt_flops`), its seconds recomputed by the test from the recorded
    operators at the H100's published figures (67 TFLOP/s dense float32, 3.35 TB/s, a 2 us launch, the efficiency
    table's fractions: Note [Device time model]), the recomputation's products counted by torch's counter on the
    checkpointed model, and the MFU from these."""
    from torch.utils.flop_counter import FlopCounterMode

    from remat.costs.device_time import EFFICIENCY, GPU_LAUNCH_S, op_class

    def seconds(op) -> float:
        if op.flops <= 0 and op.bytes_accessed <= 0:
            return 0.0
        cls = op_class(op.name)
        eff = EFFICIENCY.get(f"{cls}@hopper") or EFFICIENCY[cls]
        return max(op.flops / (67e12 * eff.compute), op.bytes_accessed / (3.35e12 * eff.memory), GPU_LAUNCH_S)

    from remat.costs.device_time import GPU_HOST
    from remat.profile import cache

    monkeypatch.setattr(cache, "host_work", lambda rec, where, measure: WORK)
    recordings, profiles = _recordings(monkeypatch)
    with torch.device("meta"):
        model = GPT(1024, 256, 256, 4, 4, 0.0)
    ids = torch.zeros(8, 256, dtype=torch.long, device="meta")
    plan = remat.optimize_checkpointing(model, 0.2, (ids, ids), optimizer=torch.optim.AdamW(model.parameters()),
                                        target=Target(device="h100-80gb"))
    (rec,), (profile,) = recordings, profiles
    assert plan.tokens_per_step == 8 * 256
    assert plan.predicted_tokens_per_s == pytest.approx(8 * 256 / plan.predicted_step_time_s)
    flops = gpt_flops(layers=4, batch=8, seq=256, d=256, vocab=1024)
    assert plan.model_flops == flops == sum(op.flops for op in (*rec.forward_ops, *rec.backward_ops))
    assert profile.forward_s == pytest.approx(sum(map(seconds, rec.forward_ops)), rel=1e-9)
    assert profile.backward_s == pytest.approx(sum(map(seconds, rec.backward_ops)), rel=1e-9)
    # AdamW reads each parameter, its gradient and two moments and writes three of them: at the HBM's full rate
    # at least (every operator is slower: 92% of it, and a launch)
    assert profile.optimizer_s >= 7 * 4 * sum(p.numel() for p in model.parameters()) / 3.35e12
    # what the plan recomputes: products the checkpointed model runs beyond the plain step's, at 78% of peak at best
    with FlopCounterMode(display=False) as counter:
        remat.default_loss(model(ids, ids)).backward()
    recomputed = counter.get_total_flops() - flops
    assert plan.checkpointed and recomputed > 0
    assert plan.predicted_recompute_s >= recomputed / (67e12 * EFFICIENCY["matmul"].compute)
    # the host (Note [Host time decomposed]): the model's own work (fixed here: 3 ms forward, 1 ms backward) and
    # GPU_HOST's cost per operator; a checkpointed unit adds its bookkeeping to the forward (the fixture's 97 us a
    # call, 10 us a saved tensor) and recomputes its operators at the model's and the device's cost each
    op = GPU_HOST.forward_op_s
    assert profile.forward_host_s == pytest.approx(3e-3 + WORK.forward_ops * op, rel=1e-12)
    assert profile.backward_host_s == pytest.approx(1e-3 + WORK.backward_ops * GPU_HOST.backward_op_s, rel=1e-12)
    units = [profile.unit(u) for u in plan.checkpointed]
    for u in units:
        recomputed = (u.recompute_end if u.recompute_end is not None else u.forward_end) - u.forward_start + 1
        assert u.recompute_host_s == pytest.approx(recomputed * (3e-3 / WORK.forward_ops + op), rel=1e-12)
        assert u.forward_host_s == pytest.approx(9.7e-5 + len(u.drops) * 1.0e-5, rel=1e-12)
    assert plan.predicted_step_time_s == pytest.approx(
        max(profile.forward_s, profile.forward_host_s + sum(u.forward_host_s for u in units))
        + max(profile.backward_s + sum(u.recompute_s for u in units),
              profile.backward_host_s + sum(u.recompute_host_s for u in units)) + profile.optimizer_s, rel=1e-12)
    # MFU: the plain step's FLOPs over the plan's predicted step at the H100's float32 peak
    assert plan.peak_flops_per_s == 67e12
    assert plan.predicted_mfu == pytest.approx(flops / plan.predicted_step_time_s / 67e12, rel=1e-12)
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


#: the model's own host work in test_a_plan_for_gpus_shows_..., fixed (measured, it is this machine's)
WORK = HostWork(forward_python_s=3e-3, backward_python_s=1e-3, forward_ops=400, backward_ops=600)


class _Blocks(nn.Module):
    """Four Linear + GELU blocks; ``pause_s``: host time the forward spends in its own Python before each block
    (a model whose code does more per operator: logging, shape checks, a Python loop over heads)."""

    def __init__(self, pause_s: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4))
        self.pause_s = pause_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        for block in self.blocks:
            if self.pause_s:
                time.sleep(self.pause_s)
            x = block(x)
        return x


class _Chatty(_Blocks):
    def __init__(self) -> None:
        super().__init__(pause_s=0.005)


def test_a_model_with_more_python_per_operator_is_predicted_more_host_time():
    """Issue #60: the same operators, one model spending 5 ms of its own before each of its 4 blocks: its
    predicted forward host time is larger by at least those 20 ms (the model's own work is measured on the model,
    Note [Host time decomposed]), its backward's is not, and its plain step is predicted slower by as much; the
    operators each dispatches are the same, and the device's cost per operator is GPU_HOST's for both."""
    from remat.api.profiling import make_profile
    from remat.costs.device_time import GPU_HOST

    profiles = []
    for model in (_Blocks(), _Chatty()):
        x = torch.randn(8, 64)
        profiles.append(make_profile(model, (x,), target=Target(device="h200")))
    plain, chatty = profiles
    assert [u.name for u in plain.units] == [u.name for u in chatty.units]
    assert chatty.forward_host_s - plain.forward_host_s >= 4 * 0.005
    assert abs(chatty.backward_host_s - plain.backward_host_s) < 4 * 0.005 / 2
    assert chatty.step_time_s - plain.step_time_s >= 4 * 0.005 - (plain.forward_host_s - plain.forward_s)
    # the notes say where each part came from
    note = next(n for n in chatty.notes if n.startswith("host:"))
    assert "fake tensors" in note and f"{GPU_HOST.forward_op_s * 1e6:.2f} us a forward operator" in note
