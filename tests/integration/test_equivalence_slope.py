"""Note [Is the gradient its own loss's?] (remat.check.slope): where a checkpointed step differs from the plain one,
the equivalence check tells a forward that computed another loss (its gradient right for it) from a
recomputation that computed otherwise than its forward (the gradient silently wrong), by the loss's slope along
gradient directions, from the gradient and from central differences of the checkpointed loss itself.

Measured on the U-Net below (dropout 0.1 in every level, 'd1' and 'mid' checkpointed), slope from the gradient
against slope from the loss, along the whole gradient / d1.4.weight's / mid.0.weight's: a correct recomputation
0.0% / 0.16% / 0.47% apart; a recomputation that draws its dropout masks again from another generator state
(``preserve_rng_state=False``) 2.5% / 27% / 16% apart. The check's bound is 5%."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from helpers import dropout_unet
from remat.rewrite import checkpoint_modules
from remat.check.verify import slope_check

UNITS = ["d1", "mid"]


@pytest.mark.parametrize("dropout", [nn.Dropout2d, nn.Dropout])
def test_a_recomputation_that_draws_other_masks_is_caught(dropout):
    """The check can fail: masks drawn again from another generator state make the gradient another loss's."""
    model, x, loss_fn = dropout_unet(dropout)
    checkpoint_modules(model, UNITS, preserve_rng_state=False)
    report = remat.check_equivalence(model, x, loss_fn=loss_fn)
    assert not report.equal and "loss" not in report.mismatched  # the forward drew the plain step's masks
    assert report.slope is not None and not report.slope.consistent, report.slope
    assert report.slope.directions[0] == "gradient" and len(report.slope.directions) == 1 + len(UNITS)
    assert "NOT the slope of the step's own loss" in str(report)


def test_a_correct_recomputation_is_its_own_loss_s_gradient():
    model, x, loss_fn = dropout_unet()
    checkpoint_modules(model, UNITS)
    report = remat.check_equivalence(model, x, loss_fn=loss_fn)
    assert report.equal and report.slope is None, str(report)
    slope = slope_check(model, model, (x,), {}, loss_fn)
    assert slope.consistent, slope
    assert len(slope.directions) == 1 + len(UNITS)
    # the gradient's own slope is its norm; the loss's central differences agree closely
    assert all(abs(a - b) <= 0.01 * abs(a) for a, b in zip(slope.from_gradient, slope.from_loss)), slope


def test_a_forward_that_computed_another_loss_is_told_apart():
    """Against a reference whose first dropout drops more, the checkpointed step's loss differs, and its gradient
    is still the slope of its own loss: the report says the forward computed another loss, not that the
    recomputation went wrong."""
    model, x, loss_fn = dropout_unet()
    reference = copy.deepcopy(model)
    reference.d1[3].p = 0.3
    checkpoint_modules(model, UNITS)
    before = [p.detach().clone() for p in model.parameters()], [b.clone() for b in model.buffers()]
    report = remat.check_equivalence(model, x, loss_fn=loss_fn, reference=reference)
    assert "loss" in report.mismatched and report.slope is not None and report.slope.consistent, str(report)
    assert "computed another loss" in str(report)
    # nothing of the model's changed: the slope check moves copies' parameters and puts them back
    assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before[1], model.buffers()))
    assert all(p.grad is None for p in model.parameters())
