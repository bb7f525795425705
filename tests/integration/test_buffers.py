"""Selective units on modules that own buffers (read-only ones, BatchNorm's running statistics)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from helpers import adam
from remat.api import make_profile
from remat.solve import Planner


class WindowBlock(nn.Module):
    """Attention with a read-only relative-position index buffer, as Swin's blocks have."""

    def __init__(self, d: int = 32, n: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.bias_table = nn.Parameter(torch.zeros(2 * n - 1))
        idx = torch.arange(n)
        self.register_buffer("relative_position_index", (idx[:, None] - idx[None, :] + n - 1))
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = (q @ k.transpose(-1, -2)) / 6.0 + self.bias_table[self.relative_position_index]
        x = x + self.proj(att.softmax(-1) @ v)
        return x + self.mlp(x)


class BNBlock(nn.Module):
    """A residual block with BatchNorm (running statistics updated in forward). zoo.ResBlock computes the
    same, but holds the first ReLU's output in a local until it returns; here it is a temporary, and
    the selective recomputation of the last block then peaks 63 KiB lower than predicted (the strict
    xfail below; with zoo.ResBlock the prediction is exact)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def window_model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(*[WindowBlock() for _ in range(3)])
    return model, torch.randn(32, 16, 32, generator=torch.Generator().manual_seed(1))


def bn_model(blocks: int = 4):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(*[BNBlock() for _ in range(blocks)]).train()
    return model, torch.randn(8, 8, 16, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("make", [window_model, bn_model], ids=["read-only-buffer", "batchnorm"])
def test_every_selective_option_on_modules_with_buffers_is_exact(make):
    """The reported crash (a selective unit on a module owning a buffer it never changes failed in
    backward: "aten.copy_.default encountered during backward but not found in storage"), and BatchNorm
    blocks, which now get selective options too: every option runs, is exact (gradients and running
    statistics) and is predicted within 5%."""
    model, x = make()
    profile = make_profile(model, x, loss_fn=remat.default_loss, optimizer=adam(model.parameters()))
    planner = Planner(profile, granularity="op")
    options = [u for u in planner.model.units if "@ops" in u]
    assert options, "modules with buffers get selective options"
    for unit in options:
        plan = planner.make_plan([unit], "forced")
        fresh, x = make()
        remat.apply_plan(fresh, plan)
        report = remat.check_equivalence(fresh, x)
        assert report.equal, (unit, str(report))
        measured = remat.measure_step(fresh, x, optimizer_factory=adam, repeats=0).peak_bytes
        assert abs(plan.predicted_peak_bytes - measured) <= 0.05 * measured, (unit, plan.predicted_peak_bytes, measured)


def test_optimize_checkpointing_on_a_read_only_buffer_model():
    """The issue's reproduction through the public call: a 4-block toy with a read-only buffer."""
    model, x = window_model()
    probe = remat.optimize_checkpointing(model, 1e3, x, optimizer=adam(model.parameters()))
    remat.remove_checkpointing(model)
    for frac in (0.0, 0.5):
        budget = probe.min_peak_bytes + frac * (probe.baseline_peak_bytes - probe.min_peak_bytes)
        plan = remat.optimize_checkpointing(model, budget / 2**30, x, optimizer=adam(model.parameters()))
        assert remat.check_equivalence(model, x).equal
        remat.remove_checkpointing(model)
        assert plan.checked_peak_bytes <= plan.budget_bytes


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="known over-prediction: the recomputation row of a selective BatchNorm block whose policy keeps "
                   "outputs the plain step frees early (the BatchNorm outputs) is predicted 8.4% above the measured "
                   "peak on the last block of a 2-block model; in the 4-block model that row is not the peak")
def test_selective_batchnorm_recompute_row_of_the_last_block():
    model, x = bn_model(2)
    profile = make_profile(model, x, loss_fn=remat.default_loss, optimizer=adam(model.parameters()))
    planner = Planner(profile, granularity="op")
    # the option that keeps every keepable operator of the last block (the menu's 100% share, always on it):
    # its kept set, and so its memory, does not depend on measured times
    options = [u for u in planner.model.units if u.startswith("1@ops")]
    unit = max(options, key=lambda u: len(profile.unit(u).saved_ops))
    assert "aten.native_batch_norm.default#1" in profile.unit(unit).saved_ops
    plan = planner.make_plan([unit], "forced")
    fresh, x = bn_model(2)
    remat.apply_plan(fresh, plan)
    assert remat.check_equivalence(fresh, x).equal
    measured = remat.measure_step(fresh, x, optimizer_factory=adam, repeats=0).peak_bytes
    assert abs(plan.predicted_peak_bytes - measured) <= 0.05 * measured, (unit, plan.predicted_peak_bytes, measured)
