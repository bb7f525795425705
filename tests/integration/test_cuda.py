"""The same guarantees on CUDA, where the allocator's statistics measure every byte (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.examples import make_gpt, make_unet

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("make", [make_gpt, make_unet], ids=["gpt", "unet"])
def test_cuda_budget_met_and_gradients_equal(make):
    model, inputs, loss_fn = make(device="cuda")
    loss_fn = loss_fn or remat.default_loss
    opt = torch.optim.AdamW(model.parameters())
    args, kwargs = remat.api.split_inputs(inputs)
    profile = remat.make_profile(model, inputs, loss_fn=loss_fn, optimizer=opt)
    planner = remat.Planner(profile)
    budget = (planner.min_peak_bytes + planner.baseline_peak_bytes) // 2
    plan = remat.optimize_checkpointing(model, budget / 2**30, inputs, loss_fn=loss_fn, optimizer=opt)
    measured = remat.measure_step(model, inputs, loss_fn=loss_fn,
                                  optimizer_factory=lambda p: torch.optim.AdamW(p))
    assert measured.method == "cuda allocator"
    assert measured.peak_bytes <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes
    report = remat.check_equivalence(model, inputs, loss_fn=loss_fn)
    assert report.equal, str(report)


def test_cuda_every_selective_option_predicted_and_equivalent():
    """Each policy on the menu of one GPT block, on CUDA: peak within 5% of the allocator's, gradients exact."""
    model, inputs, _ = make_gpt(device="cuda")
    args, kwargs = remat.api.split_inputs(inputs)
    profile = remat.make_profile(model, inputs, loss_fn=remat.default_loss,
                                     optimizer=torch.optim.AdamW(model.parameters()))
    planner = remat.Planner(profile, granularity="op")
    names = [u.name for u in profile.candidates() if u.name.startswith("h.1@ops")]
    assert names
    for name in names:
        plan = planner.make_plan([name], "hand")
        m, inp, _ = make_gpt(device="cuda")
        remat.apply_plan(m, plan)
        measured = remat.measure_step(m, inp, optimizer_factory=lambda p: torch.optim.AdamW(p))
        assert abs(plan.predicted_peak_bytes - measured.peak_bytes) <= 0.05 * measured.peak_bytes, name
        assert remat.check_equivalence(m, inp).equal, name
