"""The public API is one namespace: what the CLI, tests and benchmarks need is exported, and what it
raises is a RematError."""

from __future__ import annotations

import pytest
import torch

import remat
from helpers import adam, case
from remat.rewrite import checkpoint_modules
from test_errors import assert_same, state_of


def test_every_exported_name_exists_and_help_shows_the_pipeline():
    assert len(set(remat.__all__)) == len(remat.__all__)
    for name in remat.__all__:
        assert getattr(remat, name) is not None, name
    doc = remat.__doc__
    for stage in ("capture", "profile/", "costs/", "solve/", "rewrite", "check/"):  # the stages, in order
        assert stage in doc, stage
    assert [doc.index(s) for s in ("capture", "profile/", "costs/", "solve/", "rewrite", "check/")] == sorted(
        doc.index(s) for s in ("capture", "profile/", "costs/", "solve/", "rewrite", "check/"))


def test_make_profile_planner_and_checked_plan_leave_the_model_as_it_was():
    c = case("gpt")
    model, inputs, loss_fn = c.factory()
    opt = adam(model.parameters())
    checkpoint_modules(model, ["h.0"])  # the user's own (remat) checkpointing survives
    before = state_of(model, opt)
    profile = remat.make_profile(model, inputs, loss_fn=loss_fn, optimizer=opt)
    planner = remat.Planner(profile)
    budget = c.budgets((0.5,))[0]
    plan = remat.checked_plan(model, inputs, planner, budget, loss_fn=loss_fn)
    assert plan.checked_peak_bytes is not None and plan.checked_peak_bytes <= budget
    assert plan.breakdown.total_bytes == plan.predicted_peak_bytes
    assert_same(before, state_of(model, opt))
    assert remat.checkpointed_modules(model) == ["h.0"]
    with pytest.raises(remat.InfeasibleBudgetError):
        remat.checked_plan(model, inputs, planner, planner.min_peak_bytes // 2, loss_fn=loss_fn)
    assert_same(before, state_of(model, opt))


def test_remat_raises_only_its_own_errors():
    model, inputs, loss_fn = case("gpt").factory()
    with pytest.raises(remat.PlanMismatchError, match="no unit named"):
        checkpoint_modules(model, ["nope"])
    with pytest.raises(remat.InvalidInputError, match="example_inputs must be"):
        remat.make_profile(model, object())
    with pytest.raises(remat.InvalidInputError, match="already checkpointed; cannot also checkpoint segments"):
        seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        checkpoint_modules(seq, ["0"])  # fine
        wrapped = torch.nn.Sequential(seq)
        checkpoint_modules(wrapped, ["0"])
        checkpoint_modules(wrapped, ["0[0:2]"])  # segments inside a checkpoint made before: not in this order
    profile = case("gpt").profile
    with pytest.raises(remat.InvalidInputError, match="no unit named 'nope'"):
        profile.unit("nope")
    with pytest.raises(remat.InvalidInputError, match="not candidate units"):
        remat.Planner(profile).model.peak_bytes(["nope"])
