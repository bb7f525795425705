"""``remat calibrate`` and device spec files (issue #56): a calibration's measurements mapped to a spec file
(Note [Calibrated fields] in remat.target.calibration), the file read back by ``Target(device=FILE)`` and planned
with, its mistakes refused, and the command's whole pipeline run on the CPU (the hidden ``--measure-on cpu``:
its figures are a CPU's, labelled so). The GPU's own run is benchmarks/gpu/gpu_acceptance.sh's."""

from __future__ import annotations

import json

import pytest
import torch

import remat
from remat import Target
from remat.cli import main
from remat.costs.device_time import EFFICIENCY, op_seconds
from remat.errors import InvalidInputError
from remat.examples import GPT
from remat.costs.device_time import GPU_HOST
from remat.target.calibration import (ClassSample, CopyRate, Environment, GemmRate, HostSample, Measurements,
                                      calibrated_file, generation_for)
from remat.target.devices import EFFICIENCY_CLASSES, KNOWN
from remat.target.timing import rates_of

GIB = 2**30

#: a calibration as an H200 might read, written by hand: the mapping is tested against these numbers
MEASURED = Measurements(
    environment=Environment("NVIDIA H200", True, 150_109_880_320, "2.11.0+cu130", "13.0", "580.159.04", (9, 0),
                            "2026-12-04T18:00:00+00:00", "Linux-x86_64"),
    gemm=(GemmRate("bfloat16", 1024, 2 * 1024**3, 2 * 1024**3 / 300e12),
          GemmRate("bfloat16", 2048, 2 * 2048**3, 2 * 2048**3 / 600e12),
          GemmRate("bfloat16", 4096, 2 * 4096**3, 2 * 4096**3 / 700e12),
          GemmRate("float16", 4096, 2 * 4096**3, 2 * 4096**3 / 720e12),
          GemmRate("tf32", 4096, 2 * 4096**3, 2 * 4096**3 / 350e12),
          GemmRate("float32", 4096, 2 * 4096**3, 2 * 4096**3 / 50e12)),
    samples=(ClassSample("pointwise", "mul", 0, 3 * 2**26, 3 * 2**26 / 3.0e12, ("aten.mul",)),
             ClassSample("pointwise", "cast", 0, 3 * 2**25, 3 * 2**25 / 2.0e12, ("aten._to_copy",)),
             ClassSample("transcendental", "silu", 0, 2**27, 2**27 / 2.5e12, ("aten.silu",)),
             ClassSample("reduction", "softmax", 0, 2**27, 2**27 / 2.4e12, ("aten._softmax",)),
             ClassSample("bandwidth", "copy", 0, 2**28, 2**28 / 4.1e12, ("aten.copy_",)),
             ClassSample("attention", "4x16x2048x128", 10**12, 10**9, 10**12 / 500e12,
                         ("aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_cudnn_attention_backward")),
             ClassSample("foreach", "AdamW", 0, 7 * 2**29, 7 * 2**29 / 2.2e12, ("aten._foreach_add_",))),
    host=HostSample(forward_op_s=15e-6, backward_op_s=11e-6, wall_s=(3e-3, 5e-3), python_s=(1.08e-3, 1.117e-3),
                    ops=(128, 353), label="4 blocks"),
    copies=(CopyRate("device_to_host", True, 2**28, 2**28 / 53e9), CopyRate("host_to_device", True, 2**28, 2**28 / 55e9),
            CopyRate("device_to_host", False, 2**28, 2**28 / 14e9), CopyRate("host_to_device", False, 2**28, 2**28 / 7e9)),
    seconds=41.0, shortest_kernel_s=1.6e-6)


def _file(tmp_path, data, name="gpu.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def _gpt(d_model=64, seq=64):
    """A GPT on the meta device (nothing allocated: a modelled target records it on fake tensors)."""
    with torch.device("meta"):
        model = GPT(256, seq, d_model, 2, 2, 0.0)
    ids = torch.zeros(4, seq, dtype=torch.long, device="meta")
    return model, (ids, ids)


def test_a_calibration_becomes_a_spec_file_that_target_reads_with_each_figure_measured_or_carried(tmp_path):
    path = _file(tmp_path, calibrated_file(MEASURED, KNOWN["h200"]))
    spec = Target(device=str(path)).spec
    assert spec.name == "h200-calibrated" and spec.generation == "hopper" and spec.vendor == "NVIDIA"
    # measured: memory, copies (pinned), the host, the efficiencies (fractions of the base's peaks)
    assert spec.memory_bytes == 150_109_880_320
    assert spec.device_to_host_bytes_per_s == 53_000_000_000 and spec.host_to_device_bytes_per_s == 55_000_000_000
    assert (spec.host_forward_op_s, spec.host_backward_op_s) == (15e-6, 11e-6)
    assert spec.shortest_kernel_s == 1.6e-6
    eff = {cls: (c, m) for cls, c, m in spec.efficiency}
    # products: the sizes but the smallest (2048: 600, 4096: 700 TFLOP/s) over the H200's dense 989.5
    assert eff["matmul"] == (pytest.approx((600 / 989.5 + 700 / 989.5) / 2, rel=1e-9), None)
    assert eff["attention"] == (pytest.approx(500 / 989.5, rel=1e-9), None)
    # elementwise: bytes over the H200's 4.8 TB/s over the time (two samples: their bytes over their time)
    pointwise = (3 * 2**26 + 3 * 2**25) / (3 * 2**26 / 3.0e12 + 3 * 2**25 / 2.0e12)
    assert eff["pointwise"] == (None, pytest.approx(pointwise / 4.8e12, rel=1e-9))
    assert eff["transcendental"][1] == pytest.approx(2.5 / 4.8) and eff["reduction"][1] == pytest.approx(2.4 / 4.8)
    assert eff["foreach"][1] == pytest.approx(2.2 / 4.8) and "conv" not in eff
    # carried from the base: the datasheet's peaks, its links; each note says which
    h200 = KNOWN["h200"]
    assert (spec.bf16_flops_per_s, spec.hbm_bytes_per_s, spec.link_bytes_per_s) == (
        h200.bf16_flops_per_s, h200.hbm_bytes_per_s, h200.link_bytes_per_s)
    assert spec.sources_of("bf16_flops_per_s")[0][1].startswith("carried from the base h200: ")
    for field in ("memory_bytes", "host_forward_op_s", "device_to_host_bytes_per_s", "efficiency.matmul"):
        (doc, note), = spec.sources_of(field)
        assert doc.startswith("remat calibrate on NVIDIA H200 (compute capability 9.0), 2026-12-04T18:00:00+00:00: "
                              "torch 2.11.0+cu130, CUDA 13.0, driver 580.159.04"), (field, doc)
        assert "carried" not in note
    assert "from pageable memory: 14.0 GB/s" in spec.sources_of("device_to_host_bytes_per_s")[0][1]
    assert "float16 at 0.73" in spec.sources_of("efficiency.matmul")[0][1]  # 720 of 989.5, noted
    # the raw measurements are kept in the file, and read back the same
    assert Measurements.from_dict(json.loads(path.read_text())["calibration"]) == MEASURED


def test_a_gpu_not_in_the_table_gets_its_peaks_measured_and_says_so(tmp_path):
    path = _file(tmp_path, calibrated_file(MEASURED, None, name="my-gpu"))
    spec = Target(device=str(path)).spec
    assert spec.name == "my-gpu"
    # each dtype's best rate, the best bandwidth (the plain copy's 4.1 TB/s), noted as not a datasheet's
    assert (spec.bf16_flops_per_s, spec.fp16_flops_per_s, spec.tf32_flops_per_s, spec.fp32_flops_per_s) == (
        700e12, 720e12, 350e12, 50e12)
    assert spec.hbm_bytes_per_s == 4_100_000_000_000 and spec.link_bytes_per_s is None
    assert "not a datasheet peak" in spec.sources_of("bf16_flops_per_s")[0][1]
    eff = {cls: (c, m) for cls, c, m in spec.efficiency}
    assert eff["matmul"][0] == pytest.approx((600 / 700 + 1.0) / 2)
    assert eff["transcendental"][1] == pytest.approx(2.5 / 4.1)


def test_the_time_model_reads_the_calibrated_fields_and_a_changed_field_moves_the_step_as_it_says(tmp_path,
                                                                                                  monkeypatch):
    data = calibrated_file(MEASURED, KNOWN["h200"])
    path = _file(tmp_path, data)
    target = Target(device=str(path))
    rates = rates_of(target, torch.bfloat16)
    spec_eff = {cls: (c, m) for cls, c, m in target.spec.efficiency}
    assert rates.efficiency_of("matmul").compute == spec_eff["matmul"][0]
    assert rates.efficiency_of("matmul").memory == EFFICIENCY["matmul@hopper"].memory  # not calibrated: the table's
    assert rates.efficiency_of("pointwise").memory == spec_eff["pointwise"][1]
    assert rates.efficiency_of("conv") == EFFICIENCY["conv"]
    assert rates.efficiency_of("matmul").measured_on == "h200-calibrated"
    assert (rates.host.forward_op_s, rates.host.backward_op_s) == (15e-6, 11e-6)
    # the selective figures: not calibrated, the built-in host's (the H200's)
    assert (rates.host.selective_forward_op_s, rates.host.selective_recompute_op_s) == (
        GPU_HOST.selective_forward_op_s, GPU_HOST.selective_recompute_op_s)
    assert rates.launch_s == 1.6e-6  # the floor of any operator: the shortest kernel measured
    assert op_seconds("aten.add.Tensor", 4, 48, rates) == 1.6e-6
    # a product's time is its FLOPs at the calibrated fraction of the peak
    flops = 2 * 8192 * 4096 * 4096
    assert op_seconds("aten.mm.default", flops, 1, rates) == pytest.approx(
        flops / (989.5e12 * spec_eff["matmul"][0]), rel=1e-12)

    # planning with the file: the plain step's forward is its recorded operators at the file's rates; halving the
    # products' fraction in the file lengthens it by exactly what the model says for those operators
    from remat.target import source

    recordings, forwards = [], []
    step_time = source.step_time
    monkeypatch.setattr(source, "step_time", lambda rec, rates, *a: recordings.append((rec, rates))
                        or forwards.append(step_time(rec, rates, *a)) or forwards[-1])
    # products large enough to take longer than a launch (a 4 x 512 x 1024 batch: 4.3 GFLOP for the MLP's first)
    model, batch = _gpt(1024, 512)
    plan = remat.optimize_checkpointing(model, 100.0, batch, target=target)
    assert plan.predicted_step_time_s > 0 and plan.target
    data["efficiency"]["matmul"]["compute"] /= 2
    slower = Target(device=str(_file(tmp_path, data, "slower.json")))
    model, batch = _gpt(1024, 512)
    remat.optimize_checkpointing(model, 100.0, batch, target=slower)
    (rec, fast_rates), (_, slow_rates) = recordings
    assert slow_rates.efficiency_of("matmul").compute == fast_rates.efficiency_of("matmul").compute / 2
    by_op = [(op_seconds(op.name, op.flops, op.bytes_accessed, fast_rates),
              op_seconds(op.name, op.flops, op.bytes_accessed, slow_rates)) for op in rec.forward_ops]
    assert forwards[0].forward_s == pytest.approx(sum(a for a, _ in by_op), rel=1e-9)
    assert forwards[1].forward_s == pytest.approx(sum(b for _, b in by_op), rel=1e-9)
    assert forwards[1].forward_s > forwards[0].forward_s


@pytest.mark.parametrize("data, words", [
    ({"name": "x"}, "lacks memory_bytes"),
    ({"name": "x", "memory_bytes": 1e9, "bf16_flops_per_s": "fast"}, "bf16_flops_per_s must be a number"),
    ({"name": "x", "memory_bytes": 1e9, "hbm_speed": 1e12}, "unknown field(s) ['hbm_speed']"),
    ({"base": "h900"}, "base 'h900' is not a built-in device"),
    ({"base": "h200", "efficiency": {"matmull": {"compute": 0.8}}}, "efficiency of 'matmull': not an operator class"),
    ({"base": "h200", "efficiency": {"matmul": {"compute": -0.8}}}, "efficiency.matmul.compute must be a positive"),
    ({"base": "h200", "efficiency": {"matmul": 0.8}}, "efficiency.matmul must be an object"),
    ({"base": "h200", "host_forward_op_s": 0}, "host_forward_op_s must be a positive number of seconds"),
    ({"base": "h200", "host_backward_op_s": -1e-6}, "host_backward_op_s must be a positive number of seconds"),
    ({"base": "h200", "host_selective_forward_op_s": 4e-5}, "unknown field(s) ['host_selective_forward_op_s']"),
    ({"base": "h200", "shortest_kernel_s": "2us"}, "shortest_kernel_s must be a positive number of seconds"),
    ({"base": "h200", "sources": [["hbm", "doc", "note"]]}, "each source must be (field, document, note)"),
    ([1, 2], "holds one JSON object"),
])
def test_a_spec_files_mistakes_are_refused_naming_the_file_and_the_field(tmp_path, data, words):
    path = _file(tmp_path, data)
    with pytest.raises(InvalidInputError) as e:
        Target(device=str(path))
    assert str(path) in str(e.value) and words in str(e.value), str(e.value)


def test_a_file_that_is_not_json_or_not_there_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidInputError, match="cannot read the device spec .*bad.json"):
        Target(device=str(bad))
    with pytest.raises(InvalidInputError, match="no device spec file at .*missing.json"):
        Target(device=str(tmp_path / "missing.json"))


def test_a_file_derived_from_a_builtin_overrides_some_fields_and_carries_the_rest(tmp_path):
    path = _file(tmp_path, {"base": "H200", "hbm_bytes_per_s": 4.0e12, "documents": {"mine": "my measurement"},
                            "sources": [["hbm_bytes_per_s", "doc:mine", "STREAM copy"]], "host_backward_op_s": 2e-5})
    spec = Target(device=str(path)).spec
    h200 = KNOWN["h200"]
    assert spec.name == "gpu" and spec.hbm_bytes_per_s == 4_000_000_000_000
    assert spec.bf16_flops_per_s == h200.bf16_flops_per_s and spec.memory_bytes == h200.memory_bytes
    assert spec.generation == "hopper"  # the base's, which a built-in reads from its name
    assert spec.sources_of("hbm_bytes_per_s") == (("my measurement", "STREAM copy"),)
    assert spec.sources_of("host_backward_op_s") == ((str(path), "given in this file without a note"),)
    assert all(note.startswith("carried from the base h200: ") for _, note in spec.sources_of("memory_bytes"))
    # the time model: the host's backward figure the file's, the rest the built-in host's
    rates = rates_of(Target(device=str(path)), torch.bfloat16)
    assert rates.host.backward_op_s == 2e-5 and rates.host.forward_op_s == rates_of(
        Target(device="h200"), torch.bfloat16).host.forward_op_s


def test_the_efficiency_classes_are_the_time_models():
    assert set(EFFICIENCY_CLASSES) == {k.split("@")[0] for k in EFFICIENCY}
    assert [generation_for(c) for c in ((8, 0), (8, 9), (9, 0), (10, 0), (12, 0), (7, 5), None)] == [
        "ampere", "ada", "hopper", "blackwell", "blackwell", "", ""]


def test_the_command_runs_its_whole_pipeline_on_the_cpu_labelled_not_a_gpu_calibration(capsys, tmp_path):
    path = tmp_path / "cpu.json"
    rng = torch.get_rng_state()
    code = main(["calibrate", "--measure-on", "cpu", "--out", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert torch.equal(rng, torch.get_rng_state())  # it seeds its own draws and gives the random state back
    assert "NOT a GPU calibration" in out and str(path) in out
    data = json.loads(path.read_text())
    assert "base" not in data and data["name"] == "cpu-test-calibration"
    assert "NOT a GPU calibration" in data["documents"]["calibration"]
    measured = Measurements.from_dict(data["calibration"])
    assert not measured.environment.is_gpu and measured.environment.device_name == "cpu"
    # every measurement ran: products in three dtypes (no TF32 on a CPU), every class, the host, copies each way
    assert {g.dtype for g in measured.gemm} == {"bfloat16", "float16", "float32"}
    assert {s.op_class for s in measured.samples} == {"pointwise", "transcendental", "reduction", "bandwidth",
                                                      "attention", "foreach"}
    attention, = [s for s in measured.samples if s.op_class == "attention"]
    assert any("attention" in o and o.endswith("backward") for o in attention.operators) and attention.flops > 0
    assert 0 < measured.host.ops[0] < measured.host.ops[1]
    # the decomposition (Note [Host time decomposed]): each phase's wall less the blocks' own work, per operator
    for i, op_s in enumerate((measured.host.forward_op_s, measured.host.backward_op_s)):
        assert op_s == pytest.approx((measured.host.wall_s[i] - measured.host.python_s[i]) / measured.host.ops[i])
    assert {(c.direction, c.pinned) for c in measured.copies} == {("device_to_host", False), ("host_to_device", False)}
    # the file: every field the time model reads, each noted as the CPU test run's
    spec = Target(device=str(path)).spec
    for field in ("bf16_flops_per_s", "hbm_bytes_per_s", "host_forward_op_s", "host_backward_op_s",
                  "device_to_host_bytes_per_s", "host_to_device_bytes_per_s"):
        assert getattr(spec, field) is not None, field
        assert "CPU test run, not a GPU calibration" in spec.sources_of(field)[0][1], field
    assert {c for c, _, _ in spec.efficiency} == {"matmul", "attention", "pointwise", "transcendental", "reduction",
                                                  "foreach"}
    # and it plans
    model, batch = _gpt()
    plan = remat.optimize_checkpointing(model, 1.0, batch, target=Target(device=str(path)))
    assert plan.predicted_step_time_s > 0


def test_the_base_is_the_table_entry_torchs_name_for_the_gpu_holds_never_a_guess_by_capability():
    from argparse import Namespace

    from remat.cli.calibrate import _base

    args = Namespace(base=None)
    assert _base(args, "NVIDIA H200")[0].name == "h200"
    assert _base(args, "NVIDIA H100 80GB HBM3")[0].name == "h100-80gb"
    assert _base(args, "NVIDIA GeForce RTX 4090")[0] is None
    assert _base(Namespace(base="none"), "NVIDIA H200")[0] is None
    assert _base(Namespace(base="a100"), "NVIDIA H200")[0].name == "a100-80gb"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_command_refuses_in_one_line(capsys):
    code = main(["calibrate", "--out", "never.json"])
    out, err = capsys.readouterr()
    assert code == 2 and "CUDA" in err and "--device h100-80gb" in err and len(err.strip().splitlines()) == 1


def test_a_device_torch_does_not_know_is_refused_in_one_line(capsys):
    """``--device h200`` names a spec in every other command; here it was handed to torch.device, whose RuntimeError
    reached the user as a traceback."""
    code = main(["calibrate", "--device", "h200", "--out", "never.json"])
    out, err = capsys.readouterr()
    assert code == 2 and "--device h200: not a device torch knows here" in err and "cuda:N" in err, err
    assert len(err.strip().splitlines()) == 1


def test_the_command_lines_device_takes_the_file(capsys, tmp_path):
    path = _file(tmp_path, calibrated_file(MEASURED, KNOWN["h200"]))
    code = main(["plan", "gpt", "--layers", "2", "--batch-size", "2", "--seq-len", "32", "--d-model", "32",
                 "--device", str(path), "--budget", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "NVIDIA H200 (calibrated 2026-12-04)" in out and "modelled here, not run" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a CUDA GPU")
def test_on_a_gpu_every_measurement_runs_and_the_file_plans(tmp_path):
    """On the GPU: what the CPU run cannot reach (TF32, pinned copies, the CUDA graph's shortest kernel, the GPU's
    own names) runs and lands in the file. No figure is asserted (the tests assert no time)."""
    from remat.target.measure_device import measure

    m = measure("cuda", quick=True)
    props = torch.cuda.get_device_properties(0)
    assert m.environment.is_gpu and m.environment.total_memory_bytes == props.total_memory
    assert m.environment.capability == (props.major, props.minor)
    assert {g.dtype for g in m.gemm} == {"bfloat16", "float16", "tf32", "float32"}
    assert {(c.direction, c.pinned) for c in m.copies} == {(d, p) for d in ("device_to_host", "host_to_device")
                                                           for p in (True, False)}
    assert m.shortest_kernel_s is not None and m.host.ops[1] > 0
    path = _file(tmp_path, calibrated_file(m, None, name="here"))
    spec = Target(device=str(path)).spec
    assert spec.generation == generation_for((props.major, props.minor)) and spec.shortest_kernel_s is not None
    assert spec.sources_of("memory_bytes")[0][0].startswith(f"remat calibrate on {props.name}")
    model, batch = _gpt()
    assert remat.optimize_checkpointing(model, 1.0, batch, target=Target(device=str(path))).predicted_step_time_s > 0


def test_the_spec_table_prints_each_field_in_its_unit():
    """fields_table printed the shortest kernel (seconds) as a bandwidth ("0.0 GB/s"): each field in its own unit."""
    import dataclasses

    from rich.console import Console

    from remat.cli.calibrate import fields_table

    spec = dataclasses.replace(KNOWN["h200"], shortest_kernel_s=2.5e-6, host_forward_op_s=29e-6)
    console = Console(record=True, width=200)
    console.print(fields_table(spec, KNOWN["h200"]))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in console.export_text().splitlines()
            if line.count("│") >= 3}
    assert rows["shortest_kernel_s"] == "2.50 us" and rows["host_forward_op_s"] == "29.00 us"
    assert rows["hbm_bytes_per_s"].endswith("GB/s") and rows["bf16_flops_per_s"].endswith("TFLOP/s")


def test_the_compute_capability_measured_is_the_one_the_attention_rules_read(tmp_path):
    """A calibrated sm 8.6 GPU (an RTX 3090's class: "ampere", not an A100) and an sm 12.0 one ("blackwell", not a
    B200) had their attention kernels chosen as sm 8.0's and 10.0's: the capability went only into the raw
    measurements, and the spec's field the rules asked for did not exist. Now the file carries it and the rules
    read it; a malformed one is refused naming the field."""
    import dataclasses

    from remat.errors import InvalidInputError
    from remat.target.attention import gpu_of

    for capability, generation in (((8, 6), "ampere"), ((12, 0), "blackwell")):
        env = dataclasses.replace(MEASURED.environment, device_name="NVIDIA Some GPU", capability=capability)
        data = calibrated_file(dataclasses.replace(MEASURED, environment=env), None)
        assert data["compute_capability"] == list(capability) and data["generation"] == generation
        target = Target(device=str(_file(tmp_path, data, f"sm{capability[0]}{capability[1]}.json")))
        assert target.spec.compute_capability == capability
        assert gpu_of(target) == ("NVIDIA", capability)
    assert gpu_of(Target(device="h200")) == (KNOWN["h200"].vendor, (9, 0))  # a built-in: its generation's
    with pytest.raises(InvalidInputError, match="compute_capability must be"):
        dataclasses.replace(KNOWN["h200"], compute_capability=(9,))
