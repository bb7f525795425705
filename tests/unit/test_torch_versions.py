"""The torch releases remat supports: the floor is declared where it is checked, features that need a later
release refuse with the version they need, and the releases CI runs the suite on are the ones the private-torch
layer says it was checked on (Issue #37)."""

import re
from pathlib import Path

import pytest
import torch

import remat
from remat import _compat
from remat._compat import CHECKED_ON, COMPILED_FLOOR, TORCH_FLOOR, require_torch, torch_release

ROOT = Path(__file__).resolve().parents[2]


def test_release_numbers_are_read_from_torch_version_strings():
    assert torch_release("2.15.0+cu132") == (2, 15)
    assert torch_release("2.13.0+cpu") == (2, 13)
    assert torch_release("2.10.0a0+git1234") == (2, 10)
    assert torch_release("2.6.0") == (2, 6)
    assert torch_release() == tuple(int(x) for x in torch.__version__.split(".")[:2])


def test_a_feature_that_needs_a_later_torch_says_which(monkeypatch):
    """The check can fail: on an older torch it refuses, naming the feature, both versions and the upgrade."""
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    with pytest.raises(remat.UnsupportedError) as e:
        require_torch("planning a compiled step", (2, 9), "its inductor lacks an API")
    message = str(e.value)
    assert "planning a compiled step needs torch >= 2.9; this is torch 2.6.0+cu124 (its inductor lacks an API)" in message
    assert "pip install 'torch>=2.9'" in message
    require_torch("planning a compiled step", (2, 6))  # the release itself: no error
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    require_torch("planning a compiled step", (2, 9))


def test_the_declared_floor_is_the_one_remat_checks():
    """pyproject.toml's torch requirement, the README's and remat's own floor are one number."""
    floor = f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=([0-9.]+)"', pyproject).group(1) == floor
    assert f"torch>={floor}" in (ROOT / "README.md").read_text()
    assert TORCH_FLOOR < COMPILED_FLOOR and torch_release() >= TORCH_FLOOR
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == remat.__version__


def test_the_releases_ci_runs_are_the_ones_checked_on():
    """CHECKED_ON (named in remat's report of its own failures) is what .ci/run runs the suite on: the floor, the
    local 2.13 build (scripts/test.sh) and the releases scripts/torch-leg.sh installs."""
    ci = (ROOT / ".ci" / "run").read_text()
    legs = {".".join(v.split(".")[:2]) for v in re.findall(r"torch-leg\.sh ([0-9.]+)", ci)}
    assert legs | {"2.13"} == set(CHECKED_ON), (legs, CHECKED_ON)
    assert f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}" in legs


def test_the_compiled_call_accessors_round_trip():
    """remat._compat's accessors of ``Module._compiled_call_impl`` and ``Module._call_impl`` on this release."""
    m = torch.nn.Linear(2, 2)
    assert _compat.compiled_call(m) is None
    m.compile(backend="eager")
    impl = _compat.compiled_call(m)
    assert impl is not None and _compat.compiled_submodules(torch.nn.Sequential(m)) == ["0"]
    _compat.set_compiled_call(m, None)
    assert _compat.compiled_call(m) is None and _compat.compiled_submodules(torch.nn.Sequential(m)) == []
    _compat.set_compiled_call(m, impl)
    assert _compat.compiled_call(m) is impl
    _compat.set_compiled_call(m, None, absent=True)
    assert "_compiled_call_impl" not in m.__dict__
    assert _compat.module_call(m).__func__ is torch.nn.Module._call_impl


def test_storage_keys_are_one_identity_for_views_and_their_storage():
    t = torch.zeros(4)
    assert _compat.storage_key(t) == _compat.storage_key(t[1:]) == _compat.untyped_storage_key(t.untyped_storage())
    assert _compat.storage_key(t) != _compat.storage_key(torch.zeros(4))


def test_lightnings_compiled_module_is_read_or_none():
    class Module:
        pass

    plain = Module()
    assert _compat.lightning_compiled(plain) is None
    compiled = Module()
    compiled._compiler_ctx = {"compiler": "dynamo", "dynamo_ctx": "ctx", "original_forward": "f",
                              "original_training_step": "s"}
    assert _compat.lightning_compiled(compiled) == ("f", "s", "ctx")


def test_remat_refuses_a_torch_below_the_floor_when_imported():
    """On a torch older than the floor ``import remat`` stops with an UnsupportedError naming both releases, not
    with an ImportError or InternalError from deep inside a stage (torch 2.4.1's quick start did before)."""
    import subprocess
    import sys

    code = ("import torch; torch.__version__ = '2.7.1'\n"
            "try:\n    import remat\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    floor = f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}"
    assert out.startswith(f"UnsupportedError remat needs torch >= {floor}; this is torch 2.7.1"), out
    assert f"pip install 'torch>={floor}'" in out
