"""benchmarks/gpu_acceptance.sh, the script a session with a GPU runs (issue #55), refuses what it cannot run before
it installs or runs anything: it parses, and a missing wheel or an unknown part exits 2 with one line."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_acceptance.sh"

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
