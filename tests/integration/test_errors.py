"""Bad input gets a clear remat error, and a failed call leaves everything as it was."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import remat
from helpers import adam, case
from zoo import resnet


def state_of(model: nn.Module, opt: torch.optim.Optimizer):
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "param_ids": [id(p) for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "opt": copy.deepcopy(opt.state_dict()),
        "rng": torch.get_rng_state(),
        "forwards": [m.__dict__.get("forward") for m in model.modules()],
        "training": [m.training for m in model.modules()],
    }


def assert_same(a, b):
    assert a["param_ids"] == b["param_ids"]
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
    assert all(torch.equal(x, y) for x, y in zip(a["buffers"], b["buffers"]))
    assert torch.equal(a["rng"], b["rng"])
    assert a["forwards"] == b["forwards"]
    assert a["training"] == b["training"]
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for name in sa[k]:
            x, y = sa[k][name], sb[k][name]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


@pytest.fixture
def trained_resnet():
    """A ResNet with BatchNorm that has trained a step: gradients, optimizer state and buffers are set."""
    model, inputs, loss_fn = resnet()
    opt = adam(model.parameters())
    loss_fn(model(*inputs)).backward()
    opt.step()
    loss_fn(model(*inputs)).backward()  # leave gradients in place too
    return model, inputs, loss_fn, opt


@pytest.mark.parametrize("budget", [0, -1.0, math.nan, math.inf, "2", None, True])
def test_budget_must_be_positive_finite(trained_resnet, budget):
    model, inputs, loss_fn, opt = trained_resnet
    before = state_of(model, opt)
    with pytest.raises(remat.InvalidInputError, match="budget_gb must be a positive finite number"):
        remat.optimize_checkpointing(model, budget, inputs, loss_fn=loss_fn, optimizer=opt)
    assert_same(before, state_of(model, opt))


def test_budget_below_minimum_states_minimum_and_leaves_everything(trained_resnet):
    model, inputs, loss_fn, opt = trained_resnet
    before = state_of(model, opt)
    with pytest.raises(remat.InfeasibleBudgetError) as err:
        remat.optimize_checkpointing(model, 1e-5, inputs, loss_fn=loss_fn, optimizer=opt)
    msg = str(err.value)
    assert "least peak any checkpointing plan reaches" in msg
    assert "memory no plan removes" in msg and "optimizer state" in msg and "Raise budget_gb" in msg
    assert err.value.min_feasible_bytes > err.value.budget_bytes
    assert_same(before, state_of(model, opt))
    # and the stated minimum is indeed achievable
    plan = remat.optimize_checkpointing(model, err.value.min_feasible_bytes / 2**30 * 1.0001, inputs,
                                        loss_fn=loss_fn, optimizer=opt)
    assert plan.predicted_peak_bytes <= err.value.min_feasible_bytes


def test_success_changes_only_the_forwards(trained_resnet):
    model, inputs, loss_fn, opt = trained_resnet
    before = state_of(model, opt)
    c = case("resnet")
    plan = remat.optimize_checkpointing(model, c.budgets((0.3,))[0] / 2**30, inputs, loss_fn=loss_fn,
                                        optimizer=opt)
    after = state_of(model, opt)
    assert plan.checkpointed
    after["forwards"] = before["forwards"]
    assert_same(before, after)


def test_budget_above_peak_is_an_empty_plan():
    model, inputs, loss_fn = resnet()
    plan = remat.optimize_checkpointing(model, 10.0, inputs, loss_fn=loss_fn)
    assert plan.checkpointed == () and plan.solver_status == "fits"
    assert any("fits the budget without checkpointing" in n for n in plan.notes)
    assert any("no optimizer given" in n for n in plan.notes)
    assert plan.breakdown.optimizer_state_bytes == 0
    # the breakdown's label is longer than its column: still apart from its figure (it printed "...counted)]0.0 MiB")
    assert "optimizer state [none (no optimizer given: no optimizer state counted)] 0.0 MiB" in str(plan)
    assert remat.checkpointed_modules(model) == []


def test_inputs_on_another_device():
    model, inputs, loss_fn = resnet()
    with pytest.raises(remat.InvalidInputError, match="example input on meta but the model is on cpu"):
        remat.optimize_checkpointing(model, 1.0, inputs[0].to("meta"), loss_fn=loss_fn)


def test_inputs_the_model_rejects():
    model, inputs, loss_fn = resnet()
    before = [b.clone() for b in model.buffers()]
    with pytest.raises(remat.InvalidInputError, match="training step fails without remat too on example_inputs"):
        remat.optimize_checkpointing(model, 1.0, torch.randn(2, 5, 16, 16), loss_fn=loss_fn)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    with pytest.raises(remat.InvalidInputError, match="example_inputs must be"):
        remat.optimize_checkpointing(model, 1.0, "not a tensor", loss_fn=loss_fn)


def test_loss_must_be_scalar_with_gradient():
    model, inputs, _ = resnet()
    with pytest.raises(remat.InvalidInputError, match="loss_fn must return a scalar tensor"):
        remat.optimize_checkpointing(model, 1.0, inputs, loss_fn=lambda out: out)
    with pytest.raises(remat.InvalidInputError, match="the loss has no gradient"):
        remat.optimize_checkpointing(model, 1.0, inputs, loss_fn=lambda out: out.detach().sum())




class _LogitsAndLoss(nn.Module):
    """nanoGPT's ``GPT.forward(idx, targets)``: returns ``(logits, loss)``."""

    def __init__(self, heads: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 5)
        self.heads = heads

    def forward(self, x, y):
        logits = self.head(self.body(x))
        losses = tuple(nn.functional.cross_entropy(logits, y) * (i + 1) for i in range(self.heads))
        return (logits, *losses)


def test_default_loss_of_a_logits_and_loss_output_is_the_loss():
    torch.manual_seed(0)
    model = _LogitsAndLoss()
    x, y = torch.randn(4, 8), torch.randint(0, 5, (4,))
    logits, loss = model(x, y)
    assert remat.default_loss((logits, loss)) is loss  # not sum(logits) + loss
    plan = remat.optimize_checkpointing(model, 1.0, (x, y))
    assert any("default loss" in n and "output[1]" in n for n in plan.notes), plan.notes


def test_default_loss_refuses_an_output_it_cannot_read():
    torch.manual_seed(0)
    model = _LogitsAndLoss(heads=2)
    x, y = torch.randn(4, 8), torch.randint(0, 5, (4,))
    with pytest.raises(remat.InvalidInputError, match=r"2 scalar tensors.*pass loss_fn="):
        remat.default_loss(model(x, y))
    with pytest.raises(remat.InvalidInputError, match=r"2 scalar tensors.*pass loss_fn="):
        remat.optimize_checkpointing(model, 1.0, (x, y))


def test_model_without_trainable_parameters():
    model, inputs, loss_fn = resnet()
    model.requires_grad_(False)
    with pytest.raises(remat.InvalidInputError, match="no trainable parameters"):
        remat.optimize_checkpointing(model, 1.0, inputs, loss_fn=loss_fn)
    with pytest.raises(remat.InvalidInputError, match="must be a torch.nn.Module"):
        remat.optimize_checkpointing(lambda x: x, 1.0, inputs)


def test_saved_plan_that_does_not_match(tmp_path):
    c = case("resnet")
    model, inputs, loss_fn = c.fresh()
    plan = remat.optimize_checkpointing(model, c.budgets((0.3,))[0] / 2**30, inputs, loss_fn=loss_fn)
    plan.save(tmp_path / "plan.json")
    other = case("unet").fresh()[0]
    with pytest.raises(remat.PlanMismatchError, match="made for another model"):
        remat.apply_plan(other, remat.Plan.load(tmp_path / "plan.json"))
    assert remat.checkpointed_modules(other) == []
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(remat.PlanMismatchError, match="cannot read a remat plan"):
        remat.Plan.load(tmp_path / "bad.json")


def test_inputs_the_model_rejects_say_so_with_the_users_exception():
    model, inputs, loss_fn = resnet()
    with pytest.raises(remat.InvalidInputError, match="fails without remat too.*RuntimeError") as err:
        remat.optimize_checkpointing(model, 1.0, torch.randn(2, 5, 16, 16), loss_fn=loss_fn)
    assert isinstance(err.value.__cause__, RuntimeError)  # the user's own exception, chained


@pytest.mark.parametrize("stage, target", [
    ("profile", "remat.profile.step.record_step"),
    ("profile", "remat.profile.time_units"),
    ("check", "remat.api.checking.measure_checked_peak"),
])
def test_remats_own_failure_is_an_internal_error_not_the_users(trained_resnet, monkeypatch, stage, target):
    """A failure inside remat (seen: an AttributeError from torch's FSDP state while profiling) is not
    blamed on the user's inputs: an InternalError names the stage, chains the cause and says how to
    report it; the model and training state are restored."""
    model, inputs, loss_fn, opt = trained_resnet
    before = state_of(model, opt)
    monkeypatch.setenv("REMAT_CACHE", "0")  # c_budget profiles the same step: time_units must run

    def broken(*a, **k):
        raise AttributeError("'FSDPCommContext' object has no attribute 'all_gather_copy_in_stream'")

    module, _, name = target.rpartition(".")
    monkeypatch.setattr(module + "." + name, broken)
    with pytest.raises(remat.InternalError, match=f"remat failed in its {stage} stage") as err:
        remat.optimize_checkpointing(model, c_budget(model, inputs, loss_fn), inputs, loss_fn=loss_fn, optimizer=opt)
    assert err.value.stage == stage
    assert isinstance(err.value.__cause__, AttributeError)
    assert "your training step runs without remat" in str(err.value) and "report" in str(err.value)
    assert not isinstance(err.value, remat.InvalidInputError)
    assert_same(before, state_of(model, opt))


def c_budget(model, inputs, loss_fn) -> float:
    """A budget between the least and the no-checkpointing peak of the ResNet zoo model (GiB)."""
    c = case("resnet")
    return c.budgets((0.3,))[0] / 2**30
