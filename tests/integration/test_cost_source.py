"""Where costs come from is one interface (Issue #38; Note [Where costs come from] in remat.api.source): a second
implementation of CostSource plans through optimize_checkpointing with the cost model, the solver and the
rewriter as they are."""

import torch
from torch import nn

import remat
import remat.api.request
from remat.api.source import MeasuredHere


class GivenProfile:
    """A cost source that profiles nothing: it hands over a Profile made beforehand and takes the solver's plan
    unchecked, as a source for a device that is not here would."""

    def __init__(self, profile):
        self.given = profile
        self.calls: list[str] = []

    def describe(self) -> str:
        return "given"

    def profile(self, req):
        self.calls.append("profile")
        return self.given

    def choose(self, req, planner, profile):
        self.calls.append("choose")
        return planner.plan_for_budget(req.budget_bytes), ("planned from a given profile",)


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)))
    return model, torch.randn(32, 64)


def test_another_cost_source_plans_through_the_same_pipeline(monkeypatch):
    model, x = _model()
    profile = remat.make_profile(model, x)
    planner = remat.Planner(profile)
    budget = (planner.min_peak_bytes + planner.baseline_peak_bytes) // 2
    source = GivenProfile(profile)
    monkeypatch.setattr(remat.api.request, "MeasuredHere", lambda: source)
    plan = remat.optimize_checkpointing(model, budget / 2**30, x)
    assert source.calls == ["profile", "choose"]
    assert plan.checkpointed == planner.plan_for_budget(budget).checkpointed and plan.checkpointed
    assert "planned from a given profile" in plan.notes
    assert sorted(remat.checkpointed_modules(model)) == sorted(plan.checkpointed)  # rewritten as usual


def test_the_default_source_is_measured_here():
    model, x = _model()
    req = remat.api.request.request(model, 1.0, x, loss_fn=None, optimizer=None, time_limit_s=None, check=True,
                                    granularity="op", output_alive=True, grad_accumulation=False,
                                    zero_grad_after_forward=False, timeout_s=None, compile=None)
    assert isinstance(req.source, MeasuredHere) and req.source.describe() == "measured on this machine"
