"""benchmarks/gpu/gpu_acceptance.sh, the script a session with a GPU runs (issue #55), refuses what it cannot run before
it installs or runs anything: it parses, and a missing wheel or an unknown part exits 2 with one line."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "gpu_acceptance.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_usage_a_missing_wheel_and_an_unknown_part_exit_2(tmp_path):
    r = run(tmp_path=tmp_path)
    assert r.returncode == 2 and "PULP_WHEEL" in r.stderr
    r = run(str(tmp_path / "no.whl"), tmp_path=tmp_path)
    assert r.returncode == 2 and "no PuLP wheel at" in r.stderr
    wheel = tmp_path / "pulp-0-py3-none-any.whl"
    wheel.write_bytes(b"")
    r = run(str(wheel), "accuracy-gpt", "bogus", tmp_path=tmp_path)
    assert r.returncode == 2 and "unknown part bogus" in r.stderr
    assert not (tmp_path / "out").exists()  # nothing installed or run


def test_each_part_runs_its_command_and_the_exit_status_counts_the_failures(tmp_path):
    """The script's plumbing on a machine without a GPU: PYTHON is a stand-in that logs its arguments and fails
    for the accuracy part, so every part runs its own command, each gets a line in summary.txt with its exit
    status, and the script's exit status is the number of parts that failed (here 1)."""
    calls = tmp_path / "calls.log"
    stand_in = tmp_path / "python"
    stand_in.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n"
                        "case \"$*\" in *'remat accuracy gpt'*) exit 1 ;; esac\nexit 0\n")
    stand_in.chmod(0o755)
    wheel = tmp_path / "pulp-0-py3-none-any.whl"
    wheel.write_bytes(b"")
    r = subprocess.run(["bash", str(SCRIPT), str(wheel), "calibrate", "accuracy-gpt", "ranking"],
                       capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "PYTHON": str(stand_in),
                            "REMAT_SITE": str(tmp_path / "site")})
    assert r.returncode == 1, r.stdout + r.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary] == ["env", "calibrate", "host-figures", "accuracy-gpt", "ranking"]
    assert [line.split()[1] for line in summary] == ["rc=0", "rc=0", "rc=0", "rc=1", "rc=0"]
    logged = calls.read_text()
    assert "-m pip install" in logged and f"--out {tmp_path / 'out'}/h200-calibrated.json" in logged
    assert "benchmarks/plans/ranking.py --device cuda" in logged and "remat accuracy gpt --layers 12" in logged
