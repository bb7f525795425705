"""Promises at their edges (issue #62), tried as a user would: an eager plan compiled later, a loss that fails on a
later call, an optimizer over other parameters, a model in eval mode. Each ends in a step that trains as promised,
a clear RematError, or a note in the plan; the user's model and state are untouched either way."""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from helpers import needs_compiled_floor
from test_compile import eager_random, graph_breaks, train, two_block_gpt
from test_errors import assert_same, state_of
from remat.examples import make_gpt
from remat.rewrite import checkpoint_modules

#: compiled remat vs compiled plain (as tests/integration/test_compile.py: the same function, another program)
ATOL = 1e-6


@needs_compiled_floor
def test_an_eager_plans_regions_compiled_later_train_like_the_plain_compiled_model():
    """Note [Regions under torch.compile] in remat.rewrite.forwards: region units, which remat offers only for eager
    loops, compiled later by the user. Before, the region's forward (a traced graph run node by node) broke Dynamo's
    graph, the checkpoint ran eagerly with the compiled policy, and the first backward failed inside torch
    (``RuntimeError: Tensor cached during selective activation checkpoint has been mutated``: eager dropout's mask,
    kept, then scaled in place)."""
    model, inputs, loss_fn = two_block_gpt()
    loss_fn = loss_fn or remat.default_loss
    plain = copy.deepcopy(model)
    checkpoint_modules(model, ["h.0[ln_1:ln_2]", "h.1[ln_2:]"])
    eager_model, eager_plain = copy.deepcopy(model), copy.deepcopy(plain)
    with eager_random():
        assert graph_breaks(copy.deepcopy(model), inputs) == 0
        backend = "aot_eager_decomp_partition"
        ref_losses, ref_grads = train(torch.compile(plain, backend=backend), inputs, loss_fn)
        losses, grads = train(torch.compile(model, backend=backend), inputs, loss_fn)
    assert losses == pytest.approx(ref_losses, abs=ATOL)
    assert max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads) <= ATOL
    # eagerly, the same plan still checkpoints its regions, as planned, with the plain model's losses and gradients
    assert remat.checkpointed_modules(eager_model) == ["h.0[ln_1:ln_2]", "h.1[ln_2:]"]
    eager_losses, eager_grads = train(eager_model, inputs, loss_fn)
    plain_losses, plain_grads = train(eager_plain, inputs, loss_fn)
    assert eager_losses == plain_losses
    assert all(torch.equal(eager_grads[n], plain_grads[n]) for n in plain_grads)


def full_state(model, opt):
    """test_errors' state (parameters, gradients, buffers, optimizer state, RNG, forwards, training flags) and every
    module's hooks."""
    hooks = [(tuple(m._forward_hooks), tuple(m._forward_pre_hooks), tuple(m._backward_hooks),
              tuple(m._backward_pre_hooks)) for m in model.modules()]
    return state_of(model, opt), hooks


def assert_untouched(before, after):
    assert_same(before[0], after[0])
    assert before[1] == after[1]


def hooked(model):
    """``model`` with a forward hook and a pre-hook a user registered (they must stay, and stay outside)."""
    model.h[0].register_forward_hook(lambda m, i, o: None)
    model.register_forward_pre_hook(lambda m, i: None)
    return model


def small_gpt():
    return make_gpt(layers=2, batch_size=2, seq_len=8, d_model=16, heads=2, vocab=32, dropout=0.1)


def trained(model, inputs):
    """``model`` after one Adam step, gradients left in place: every part of the training state is set."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(*inputs).backward()
    opt.step()
    model(*inputs).backward()
    return opt


def test_a_loss_that_fails_on_a_later_call_is_the_users_failure_named_by_its_call():
    """Note [Whose failure] in remat.api.inputs: a loss function that raises on its third call (its first two ran,
    and so does the plain step that judges) was reported as remat's own failure (InternalError: "This is remat's
    failure, not your inputs' ... please report it")."""
    model, inputs, _ = small_gpt()
    opt = trained(hooked(model), inputs)
    before = full_state(model, opt)
    calls = []

    def loss_fn(out):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("bad label")
        return out

    with pytest.raises(remat.UserCodeError, match=r"loss_fn .loss_fn. raised on its call 3 .*RuntimeError: bad label") \
            as err:
        remat.optimize_checkpointing(model, 0.0005, inputs, loss_fn=loss_fn, optimizer=opt)
    assert not isinstance(err.value, remat.InternalError)
    assert isinstance(err.value.__cause__, RuntimeError) and str(err.value.__cause__) == "bad label"
    assert "report" not in str(err.value)
    assert_untouched(before, full_state(model, opt))


def test_a_model_that_fails_on_a_later_call_is_the_users_failure():
    """The same for the model's own forward: a block that raises on its fourth call."""
    model, inputs, _ = small_gpt()
    opt = trained(model, inputs)
    before = state_of(model, opt)
    block = model.h[1]
    calls = []
    forward = type(block).forward

    class Flaky(type(block)):
        def forward(self, x):
            calls.append(1)
            if len(calls) == 4:
                raise ValueError("the cache is full")
            return forward(self, x)

    block.__class__ = Flaky
    with pytest.raises(remat.UserCodeError, match=r"Flaky\.forward .*ValueError: the cache is full") as err:
        remat.optimize_checkpointing(model, 0.0005, inputs, optimizer=opt)
    assert isinstance(err.value.__cause__, ValueError)
    block.__class__ = type(model.h[0])
    assert_same(before, state_of(model, opt))


def test_an_optimizer_over_parameters_that_are_not_the_models_is_refused():
    """An optimizer over another tensor was accepted without a word and its state priced as the model's."""
    model, inputs, _ = small_gpt()
    opt = trained(model, inputs)
    other = torch.nn.Parameter(torch.randn(1000, 100))
    before = state_of(model, opt)
    foreign = torch.optim.Adam([other])
    with pytest.raises(remat.InvalidInputError, match=r"1 of its 1 parameters are not the model's.*\(1000, 100\)"):
        remat.optimize_checkpointing(model, 0.01, inputs, optimizer=foreign)
    # some of the model's parameters and one other: named by its place in param_groups
    mixed = torch.optim.SGD([{"params": list(model.h[0].parameters())}, {"params": [other]}], lr=0.1)
    with pytest.raises(remat.InvalidInputError, match=r"1 of its \d+ parameters are not the model's: "
                                                      r"param_groups\[1\]\['params'\]\[0\] of shape \(1000, 100\)"):
        remat.optimize_checkpointing(model, 0.01, inputs, optimizer=mixed)
    assert_same(before, state_of(model, opt))
    # a subset of the model's parameters (fine-tuning) is the model's
    tuned = copy.deepcopy(model)
    subset = torch.optim.SGD(tuned.h[1].parameters(), lr=0.1)
    plan = remat.optimize_checkpointing(tuned, 0.01, inputs, optimizer=subset)
    assert plan.optimizer == "SGD"


def test_a_model_in_eval_mode_is_planned_for_its_training_step_and_given_back_in_eval_mode():
    """A model in eval mode (Hugging Face's from_pretrained returns one) was recorded as it was: no dropout, and the
    plan then applied to training. Now its training step is planned, the plan says so, and the model comes back in eval
    mode, each module's flag as it was, on success and on failure."""
    model, inputs, _ = small_gpt()
    opt = trained(model, inputs)
    in_training = copy.deepcopy(model)
    reference = remat.optimize_checkpointing(in_training, 0.01, inputs, optimizer=trained(in_training, inputs))
    hooked(model).eval()
    model.h[1].mlp.train()  # one module in training mode: the model is planned as it is
    planned_as_is = remat.optimize_checkpointing(copy.deepcopy(model), 0.01, inputs)
    assert not any("eval mode" in n for n in planned_as_is.notes)
    model.h[1].mlp.eval()
    before = full_state(model, opt)
    plan = remat.optimize_checkpointing(model, 0.01, inputs, optimizer=opt)
    assert not model.training and not any(m.training for m in model.modules())
    assert plan.baseline_peak_bytes == reference.baseline_peak_bytes  # the step with dropout's masks
    assert any("eval mode" in n and "training step" in n for n in plan.notes), plan.notes
    remat.remove_checkpointing(model)
    assert_untouched(before, full_state(model, opt))
    with pytest.raises(remat.InfeasibleBudgetError):
        remat.optimize_checkpointing(model, 1e-6, inputs, optimizer=opt)
    assert_untouched(before, full_state(model, opt))
