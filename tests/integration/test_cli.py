"""The command line through its real entry point (main(argv)), on tiny built-in examples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remat import Plan
from remat.cli import main
from helpers import needs_compiled_floor, run_cli

ROOT = Path(__file__).resolve().parents[2]
TINY_GPT = ["gpt", "--layers", "2", "--batch-size", "4", "--seq-len", "64", "--d-model", "32", "--device", "cpu"]
TINY_UNET = ["unet", "--batch-size", "4", "--image-size", "32", "--depth", "2", "--device", "cpu"]


run = run_cli


def test_tradeoff_table_json_and_plot(capsys, tmp_path):
    code, out, err = run(capsys, "tradeoff", *TINY_GPT, "--points", "3", "--repeats", "1", "--warmup", "0", "--granularity", "both",
                         "--json", str(tmp_path / "rows.json"), "--plot", str(tmp_path / "curve.png"))
    assert code == 0, err
    for label in ("every_block", "every_2nd_block", "remat", "predicted", "measured"):
        assert label in out
    assert "timing: " in out and "each plan once however many budgets" in out  # issue #60: what its timing took
    data = json.loads((tmp_path / "rows.json").read_text())
    assert data["meta"]["target"].startswith("gpt") and data["meta"]["torch"] == torch.__version__
    rows = data["rows"]
    assert [r["strategy"] for r in rows[:3]] == ["none", "every_block", "every_2nd_block"]
    remat_rows = [r for r in rows if r["strategy"] == "remat"]
    assert len(remat_rows) == 3 and len([r for r in rows if r["strategy"] == "remat-op"]) == 3
    fields = {"budget_bytes", "checkpointed", "predicted_peak_bytes", "measured_peak_bytes", "predicted_step_time_s",
              "measured_step_time_s", "measured_overhead", "solve_time_s", "status", "budget_met"}
    assert all(fields <= r.keys() for r in rows)
    for r in rows:
        if r["strategy"].startswith("remat"):
            assert r["measured_peak_bytes"] <= r["budget_bytes"] and r["budget_met"] is True
    assert remat_rows[0]["budget_bytes"] < remat_rows[-1]["budget_bytes"]
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tradeoff_reports_an_unreachable_budget_and_goes_on(capsys, tmp_path):
    code, out, err = run(capsys, "tradeoff", *TINY_UNET, "--budgets", "0.000001,1", "--repeats", "1", "--granularity", "both",
                         "--warmup", "0", "--json", str(tmp_path / "rows.json"))
    assert code == 0, err
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    for name in ("remat", "remat-op"):
        mine = [r for r in rows if r["strategy"] == name]
        assert mine[0]["status"] == "infeasible" and "least achievable peak" in mine[0]["note"]
        assert mine[1]["status"] == "fits" and mine[1]["budget_met"] is True
    assert "infeasible" in out


def test_plan_then_verify_the_saved_plan(capsys, tmp_path):
    code, out, err = run(capsys, "profile", *TINY_UNET)
    assert code == 0, err
    assert "capture: fx" in out and "down.0" in out and "freed if ckpt" in out
    code, out, err = run(capsys, "plan", *TINY_UNET, "--budget", "0.0054", "--out", str(tmp_path / "p.json"))
    assert code == 0, err
    plan = Plan.load(tmp_path / "p.json")
    assert plan.checkpointed and plan.predicted_peak_bytes <= plan.budget_bytes
    assert "peak breakdown (predicted" in out and "optimizer state [AdamW]" in out
    code, out, err = run(capsys, "verify", *TINY_UNET, "--plan", str(tmp_path / "p.json"))
    assert code == 0, err
    assert "equivalent" in out and "within budget" in out


def test_verify_with_a_budget_and_custom_file_target(capsys):
    code, out, err = run(capsys, *VERIFY_CUSTOM)
    assert code == 0, err
    assert "remat equivalence check: equivalent" in out


MISTAKES = [
    (["profile", "nosuchmodel"], "unknown target 'nosuchmodel'"),
    (["profile", "examples/custom_target.py:nope"], "has no function 'nope'"),
    (["profile", "no/such/file.py:build"], "does not exist"),
    (["profile", "remat.examples:EXAMPLES"], "has no function 'EXAMPLES'"),
    (["profile", "no_such_package.mod:build"], "cannot import module 'no_such_package.mod'"),
    (["plan", "unet", "--budget", "0.0000001", "--image-size", "16", "--device", "cpu"],
     "least peak any checkpointing plan reaches"),
]
VERIFY_CUSTOM = ["verify", f"{ROOT / 'examples' / 'custom_target.py'}:build", "--budget", "0.006", "--device", "cpu"]


@pytest.mark.parametrize("argv, message", MISTAKES)
def test_user_mistakes_exit_2_with_one_line(capsys, monkeypatch, argv, message):
    monkeypatch.chdir(ROOT)
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_function_returning_the_wrong_thing(capsys, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def build():\n    return 42\n")
    code, out, err = run(capsys, "profile", f"{bad}:build")
    assert code == 2 and "must return (model, example_inputs)" in err and "Traceback" not in err


def test_bad_budget_and_missing_cuda(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "gpt", "--budget", "lots"])
    assert e.value.code == 2
    assert "not a number of GiB" in capsys.readouterr().err
    if not torch.cuda.is_available():
        code, out, err = run(capsys, "profile", "gpt", "--device", "cuda")
        assert code == 2 and "CUDA is not available" in err


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(Exception, match="unknown target"):
        main(["profile", "nosuchmodel", "--debug"])


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "remat", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("remat ")


@pytest.mark.parametrize("flag, expected", [([], "op"), (["--granularity", "block"], "block")])
def test_plan_passes_granularity_through(capsys, monkeypatch, flag, expected):
    import remat.cli

    seen = {}
    real = remat.cli.optimize_checkpointing

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(remat.cli, "optimize_checkpointing", spy)
    code, out, err = run(capsys, "plan", *TINY_GPT, "--budget", "1", *flag)
    assert code == 0, err
    assert seen["granularity"] == expected


def test_output_dropped_reaches_the_plan(capsys, tmp_path):
    """--output-dropped plans for a loop that drops the model's output after the loss (HF Trainer,
    torchtitan): the saved plan says so, and so does its printout."""
    code, out, err = run(capsys, "plan", *TINY_UNET, "--budget", "0.0054", "--output-dropped",
                         "--out", str(tmp_path / "p.json"))
    assert code == 0, err
    assert Plan.load(tmp_path / "p.json").output_alive is False
    assert "output dropped after the loss" in out


def test_maxbatch_table_compare_and_plot(capsys, tmp_path):
    """remat maxbatch: the largest batch per strategy, each confirmed on a real step, remat's above both rules."""
    tiny = ["gpt", "--layers", "2", "--seq-len", "32", "--d-model", "64", "--device", "cpu"]
    code, out, err = run(capsys, "maxbatch", *tiny, "--budget", "0.005", "--compare", "--repeats", "1",
                         "--plot", str(tmp_path / "sizes.png"))
    assert code == 0, err
    sizes = dict(line.removeprefix("largest that fits: ").split(" (")[0].replace(",", "").split(" ")[i:i + 2]
                 for line in out.splitlines() if line.startswith("largest that fits") for i in (0, 2, 4))
    assert set(sizes) == {"ilp", "every_block", "none"}
    assert int(sizes["ilp"]) > int(sizes["every_block"]) > int(sizes["none"])
    assert out.count("its least measured peak is over the budget") == 3
    assert (tmp_path / "sizes.png").stat().st_size > 0


def test_maxbatch_needs_a_sized_target(capsys, tmp_path):
    f = tmp_path / "fixed.py"
    f.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(4, 1), torch.randn(8, 4)\n")
    code, _, err = run(capsys, "maxbatch", f"{f}:build", "--budget", "1", "--device", "cpu")
    assert code == 2 and "takes no batch_size= argument" in err


@needs_compiled_floor
def test_plan_for_the_compiled_step(capsys, tmp_path):
    """remat plan --compile BACKEND: the plan (saved and printed) is the compiled step's, checked on it."""
    code, out, err = run(capsys, "plan", *TINY_UNET, "--budget", "1", "--compile", "aot_eager",
                         "--out", str(tmp_path / "p.json"))
    assert code == 0, err
    plan = Plan.load(tmp_path / "p.json")
    assert "backend='aot_eager'" in plan.compiled and plan.checked_peak_bytes <= plan.budget_bytes
    assert "compiled step:" in out and "(compiled)" in out
    code, _, err = run(capsys, "plan", *TINY_UNET, "--budget", "1", "--compile-mode", "max-autotune")
    assert code == 2 and "--compile-mode goes with --compile" in err


@needs_compiled_floor
def test_tradeoff_of_the_compiled_step(capsys, tmp_path):
    """remat tradeoff --compile: every row's peak measured on a compiled step, remat's rows within their budgets,
    in the memory of one model (timed in place)."""
    code, out, err = run(capsys, "tradeoff", *TINY_UNET, "--points", "2", "--repeats", "1", "--warmup", "0",
                         "--compile", "aot_eager", "--json", str(tmp_path / "rows.json"))
    assert code == 0, err
    assert "every row compiled with torch.compile (backend=aot_eager)" in out
    data = json.loads((tmp_path / "rows.json").read_text())
    assert "aot_eager" in data["meta"]["compiled"]
    rows = data["rows"]
    assert [r["strategy"] for r in rows[:2]] == ["none", "every_block"]
    mine = [r for r in rows if r["strategy"] == "remat-op"]
    assert len(mine) == 2 and all(r["budget_met"] and r["measured_peak_bytes"] <= r["budget_bytes"] for r in mine)
    assert mine[-1]["budget_bytes"] == rows[0]["measured_peak_bytes"]  # the sweep ends at the compiled plain peak


def test_a_target_that_puts_its_own_folder_first_keeps_it(tmp_path, capsys, monkeypatch):
    """Issue #36.3: the loader put the target file's folder first on ``sys.path`` and popped ``sys.path[0]``
    afterwards, which removed the target's own entry instead of remat's when the file inserts a folder first
    itself; a model module its function imports lazily was then not found (this test failed with
    ModuleNotFoundError). Exactly the entry remat added is removed."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "lazy_model_36.py").write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n")
    (tmp_path / "target.py").write_text(
        "import sys\n"
        "from pathlib import Path\n"
        "here = Path(__file__).resolve().parent\n"
        "sys.path.insert(0, str(here / 'models'))\n"
        "def build():\n"
        "    import torch\n"
        "    from lazy_model_36 import build as make\n"
        "    return make(), torch.randn(4, 8)\n")
    before = list(sys.path)
    code, out, err = run(capsys, "profile", f"{tmp_path / 'target.py'}:build")
    assert code == 0, err
    assert sys.path == [str(tmp_path / "models")] + before


def test_the_suites_cpu_command_lines_stay_on_the_cpu_where_a_gpu_is(monkeypatch):
    """Every command line of the suite that builds and runs a model on the CPU says ``--device cpu``: with a GPU
    present the default device is cuda (``remat.cli.common._device``), and the model would be moved there (on the
    H200 machine the two gloo ranks' ``remat plan`` of test_distributed.py exited 2 so). Here CUDA is made to look
    available and each command line stops where the target is built, with the device it was asked for."""
    import distributed_worker
    import remat.cli.common as common

    class Built(Exception):
        pass

    def built(target, *, device, **kwargs):
        raise Built(torch.device(device))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(common, "resolve_target", built)
    assert common._device(None).type == "cuda"  # what an invocation without --device gets on a GPU machine
    lines = [["tradeoff", *TINY_GPT], ["plan", *TINY_UNET, "--budget", "1"], ["profile", *TINY_UNET], VERIFY_CUSTOM,
             distributed_worker.CLI_PLAN, distributed_worker.CLI_TRADEOFF,
             *(argv for argv, _ in MISTAKES if argv[1] in ("gpt", "unet"))]
    for argv in lines:
        with pytest.raises(Built) as e:
            main(list(argv))
        assert e.value.args[0] == torch.device("cpu"), argv


def test_under_torchrun_device_cpu_joins_the_ranks_with_gloo_where_a_gpu_is(monkeypatch):
    """``torchrun ... remat plan --device cpu`` on a machine with a GPU: the ranks' model is on the CPU, so the
    process group remat joins is gloo's (NCCL moves no CPU tensor); it picked NCCL whenever CUDA was there."""
    import torch.distributed as dist

    class Joined(Exception):
        pass

    def join(backend, *args, **kwargs):
        raise Joined(backend)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", join)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Joined) as e:
        main(["profile", *TINY_GPT])
    assert e.value.args[0] == "gloo"
    with pytest.raises(Joined) as e:  # without --device the default is cuda there, and so NCCL
        main(["profile", *TINY_GPT[:-2]])
    assert e.value.args[0] == "nccl"
