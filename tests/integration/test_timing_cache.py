"""Reproducible plans: the timing cache (Note [Timing cache] in remat.profile.cache; issue #24, item 4)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import remat
import remat.profile
from remat.examples import make_gpt
from remat.solve import Planner


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE", "1")
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    return tmp_path / "timings"


def _no_timed_steps(*a, **k):
    raise AssertionError("a timed step ran although the step's times were cached")


def _gpt():
    model, batch, _ = make_gpt(layers=2, batch_size=4, seq_len=32, d_model=64, vocab=128)
    return model, batch, torch.optim.AdamW(model.parameters())


def test_a_second_profile_reads_the_first_ones_times_and_gets_the_same_plans(cache_on, monkeypatch):
    model, batch, opt = _gpt()
    first = remat.make_profile(model, batch, optimizer=opt)
    assert len(list(cache_on.glob("step-*.json"))) == 1
    assert not any("timing cache" in n for n in first.notes)
    monkeypatch.setattr(remat.profile, "time_units", _no_timed_steps)
    model2, batch2, opt2 = _gpt()  # a new model object: the key is the step, not the object
    second = remat.make_profile(model2, batch2, optimizer=opt2)
    assert any("timing cache" in n and str(cache_on) in n for n in second.notes)
    assert second.units == first.units  # every cost, time included
    assert (second.forward_s, second.backward_s) == (first.forward_s, first.backward_s)
    a, b = Planner(first, granularity="op"), Planner(second, granularity="op")
    assert a.min_peak_bytes < a.baseline_peak_bytes
    budgets = [a.min_peak_bytes + (a.baseline_peak_bytes - a.min_peak_bytes) * k // 9 for k in range(10)]
    plans = [(a.plan_for_budget(x).checkpointed, b.plan_for_budget(x).checkpointed) for x in budgets]
    assert all(p == q for p, q in plans)
    assert len({p for p, _ in plans}) >= 3  # the budgets span several plans, not one


def test_another_batch_shape_is_measured_again(cache_on, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    remat.make_profile(model, torch.randn(8, 16))
    calls = []
    real = remat.profile.time_units
    monkeypatch.setattr(remat.profile, "time_units", lambda *a, **k: calls.append(1) or real(*a, **k))
    remat.make_profile(model, torch.randn(4, 16))
    assert calls == [1] and len(list(cache_on.glob("step-*.json"))) == 2
    remat.make_profile(model, torch.randn(8, 16))  # the first shape again: cached
    assert calls == [1]


def test_an_unreadable_entry_is_measured_again_and_rewritten(cache_on, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 16)
    remat.make_profile(model, x)
    (entry,) = cache_on.glob("step-*.json")
    entry.write_text("{not json")
    calls = []
    real = remat.profile.time_units
    monkeypatch.setattr(remat.profile, "time_units", lambda *a, **k: calls.append(1) or real(*a, **k))
    profile = remat.make_profile(model, x)
    assert calls == [1] and not any("timing cache" in n for n in profile.notes)
    assert json.loads(entry.read_text())["format"] == remat.profile.cache.FORMAT


def test_remat_cache_0_reads_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE", "0")
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    remat.make_profile(model, torch.randn(8, 16))
    remat.make_profile(model, torch.randn(8, 16))
    assert not any(tmp_path.rglob("*.json"))
