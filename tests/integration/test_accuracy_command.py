"""``remat accuracy`` (issue #55): the prediction for a GPU beside the same plans run on it. Here the whole command
runs with its measuring half on the CPU (the hidden ``--measure-on cpu``, remat's CPU meter), so that the table,
the JSON and the pairing of each predicted row with the plan that was measured are tested for real; the GPU's own
figures are test_cuda_accuracy_command's (skipped without CUDA)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

import remat
from helpers import run_cli
from remat.errors import InvalidInputError, UnsupportedError
from remat.sweeps.accuracy import check_prediction, measure_plans_here
from remat.target.this_gpu import match_spec
from remat.target.devices import KNOWN

TINY = ["gpt", "--layers", "2", "--batch-size", "2", "--seq-len", "32", "--d-model", "32"]


run = run_cli


def test_accuracy_table_json_and_the_plans_measured_are_the_rows_plans(capsys, tmp_path):
    path = tmp_path / "rows.json"
    code, out, err = run(capsys, "accuracy", *TINY, "--device", "h100-80gb", "--measure-on", "cpu", "--steps", "3",
                         "--budget", "0.0000001,1", "--json", str(path))
    assert code == 0, err
    data = json.loads(path.read_text())
    rows = data["rows"]
    labels = [r["label"] for r in rows]
    assert labels[:3] == ["none", "every block", "every 2nd block"], labels
    # every plan asked for is a row or a note saying why not (a plan equal to an earlier row's, a budget below the
    # least peak)
    for asked in ("remat least", "remat halfway", "remat @ 1 GiB"):
        assert asked in labels or any(n.startswith(f"{asked}: the same plan as") for n in data["notes"]), \
            (labels, data["notes"])
    assert any(n.startswith("remat @ ") and ": infeasible (budget" in n for n in data["notes"]), data["notes"]
    assert data["predicted_for"]["name"] == "h100-80gb" and data["spec_source"] == "given with --device"
    assert data["measured_on"].startswith("cpu") and "CPU meter" in data["meter"] and "not of a GPU" in data["meter"]
    assert data["meta"]["target"].startswith("gpt") and data["steps"] == 3
    for r in rows:
        # the model that ran had exactly the row's plan in it (read back from the model, not copied from the plan)
        assert sorted(r["measured_checkpointed"]) == sorted(r["checkpointed"]), r
        assert len(r["step_times_s"]) == 3 and len(r["losses"]) == 3
        assert r["measured_step_time_s"] == statistics.median(r["step_times_s"][1:])
        # a CUDA target's prediction has a reserved peak; remat's CPU meter has none
        assert r["predicted_reserved_peak_bytes"] >= r["predicted_allocated_peak_bytes"] > 0
        assert r["measured_reserved_peak_bytes"] is None and r["reserved_error"] is None
        assert r["allocated_error"] == pytest.approx(
            r["predicted_allocated_peak_bytes"] / r["measured_allocated_peak_bytes"] - 1)
        assert r["error"] is None
    by = {r["label"]: r for r in rows}
    # the rows measured what they say: checkpointing every block holds less than none, as predicted
    assert by["every block"]["measured_allocated_peak_bytes"] < by["none"]["measured_allocated_peak_bytes"]
    assert by["every block"]["predicted_allocated_peak_bytes"] < by["none"]["predicted_allocated_peak_bytes"]
    # the same plan trains the same: losses of every row equal the plain row's (same seed, same batch)
    for r in rows:
        assert r["losses"] == pytest.approx(by["none"]["losses"], rel=1e-5)
    # the table prints each row; the caption says what is predicted and what measured
    for label in labels:
        assert label in out
    for words in ("allocated", "reserved", "step time", "error", "predicted on this machine for NVIDIA H100 SXM 80GB",
                  "not measured", "measured on cpu", "CPU meter", "steps 2-3 of 3"):
        assert words in out, words


class _RunsOutOnStep2(torch.nn.Module):
    """A model whose second step raises what an exhausted GPU raises."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.lin(x).sum()


def test_a_row_that_runs_out_of_memory_is_a_row_with_its_error_and_the_random_state_is_given_back():
    before = torch.random.get_rng_state()
    rows = measure_plans_here(lambda device: (_RunsOutOnStep2().to(device), torch.ones(2, 4, device=device)), [None, None],
                         "cpu", optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1), steps=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    for r in rows:  # each row its own fresh model: both ran one step, then ran out
        assert r.error.startswith("out of memory on the device: CUDA out of memory")
        assert r.measured_allocated_peak_bytes is None and r.measured_step_time_s is None
        assert len(r.losses) == 1 and len(r.step_times_s) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_in_one_line(capsys):
    code, out, err = run(capsys, "accuracy", *TINY)
    assert code == 2
    assert "CUDA" in err and "remat tradeoff TARGET --device h100-80gb" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(UnsupportedError, match="CUDA"):
        check_prediction(lambda device: remat.examples.make_gpt(device=device))


@pytest.mark.parametrize("argv, message", [
    (["--world", "2", "--device", "h100-80gb"], "--world 1"),
    (["--fsdp", "2", "--device", "h100-80gb"], "--world 1"),
    (["--steps", "1", "--device", "h100-80gb"], "--steps must be 2 or more"),
    (["--offload", "--device", "h100-80gb"], "--offload"),
    (["--device", "no-such-gpu"], "unknown device"),
])
def test_mistakes_exit_2(capsys, argv, message):
    code, out, err = run(capsys, "accuracy", *TINY, "--measure-on", "cpu", *argv)
    assert code == 2 and message in err, err


def test_a_device_torch_does_not_know_is_refused_in_one_line(capsys):
    code, out, err = run(capsys, "accuracy", *TINY, "--device", "cuda:x")
    assert code == 2 and "--device cuda:x: not a device torch knows here" in err, err


def test_measuring_on_a_cpu_needs_the_spec_given(capsys):
    code, out, err = run(capsys, "accuracy", *TINY, "--measure-on", "cpu")
    assert code == 2 and "--device GPU" in err, err


def test_this_gpu_matched_against_the_table():
    spec, how = match_spec("NVIDIA H200", (9, 0), 150_109_880_320)  # as torch reported the shared H200
    assert spec.name == "h200" and spec.memory_bytes == 150_109_880_320 and "the table's h200" in how
    assert "memory as torch reports it here" not in how  # the table holds that figure
    # an H200 whose torch reports other memory (a MIG slice, another driver): the spec takes what torch reports
    spec, how = match_spec("NVIDIA H200", (9, 0), 140_000_000_000)
    assert spec.name == "h200" and spec.memory_bytes == 140_000_000_000 and "memory as torch reports it here" in how
    spec, how = match_spec("NVIDIA H100 80GB HBM3", (9, 0), KNOWN["h100-80gb"].memory_bytes)
    assert spec == KNOWN["h100-80gb"] and "memory" not in how
    spec, how = match_spec("NVIDIA H200 NVL", (9, 0), 150_000_000_000)  # a name the table lacks that holds one it has
    assert spec.name == "h200" and "holds the table's h200" in how
    spec, how = match_spec("NVIDIA GH200 480GB", (9, 0), 102_000_000_000)  # by compute capability
    assert spec.name == "h100-80gb" and "compute capability 9.0" in how and spec.memory_bytes == 102_000_000_000
    with pytest.raises(InvalidInputError, match="not in remat's device table"):
        match_spec("NVIDIA GeForce GTX 1080", (6, 1), 8_500_000_000)


@pytest.mark.cuda
def test_cuda_accuracy_command(capsys, tmp_path):
    """On a GPU: the tiny GPT's rows measured by the CUDA allocator, each beside its prediction for this GPU."""
    path = tmp_path / "rows.json"
    code, out, err = run(capsys, "accuracy", *TINY, "--json", str(path))
    assert code == 0, err
    data = json.loads(path.read_text())
    assert data["meter"].startswith("torch.cuda.memory_stats()") and torch.cuda.get_device_name() in data["measured_on"]
    for r in data["rows"]:
        assert sorted(r["measured_checkpointed"]) == sorted(r["checkpointed"]) and r["error"] is None
        assert r["measured_reserved_peak_bytes"] >= r["measured_allocated_peak_bytes"] > 0
        # issue #55's bound for a GPU target, on a model this small loose by the allocator's 2 MiB segments
        assert abs(r["allocated_error"]) <= 0.1, r
