"""Dropout inside checkpointed units under inductor (issue #36; Note [Random operators under compile] in
remat.rewrite): the planned compiled step draws what the plain compiled step draws (eager's random numbers,
``fallback_random``), compiled whole and per block, where torch's own recomputation of random operators drew
other masks (these tests failed before: loss 0.72289 against 0.72129 with Dropout2d, 0.72287 against 0.72533
with Dropout); where inductor orders the two programs' random kernels otherwise, the recomputation still draws
its forward's numbers; and remat proves its plan on compiled steps before it returns it (Note [Compiled plans
are proved] in remat.check.compiled), a proof that can fail."""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
from torch import nn

import remat
import remat.rewrite
from helpers import dropout_unet
from test_compile import Layers, train
from remat.rewrite import checkpoint_modules

#: segments of levels and whole levels, the first level among them (its dropout draws first)
UNITS = ["d1[0:5]", "mid", "u1[0:3]"]
#: compiled checkpointed against compiled plain: the same function, another program (Note [Compiled tolerance])
ATOL = 1e-6


@contextlib.contextmanager
def random_numbers(eager: bool):
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=eager):
        yield
    torch._dynamo.reset()


def one_step(model, compiled, x, loss_fn):
    torch.manual_seed(0)
    loss = loss_fn(compiled(x))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, \
        {n: b.clone() for n, b in model.named_buffers()}


def assert_alike(a, b):
    assert a[0] == pytest.approx(b[0], abs=ATOL)
    assert max((a[1][n] - b[1][n]).abs().max().item() for n in a[1]) <= ATOL
    assert max((a[2][n].double() - b[2][n].double()).abs().max().item() for n in a[2]) <= ATOL


@pytest.mark.parametrize("dropout", [nn.Dropout2d, nn.Dropout])
def test_compiled_whole_draws_the_plain_compiled_steps_numbers(dropout):
    """Loss, every gradient and BatchNorm's statistics of one step equal the plain compiled step's; the
    equivalence check on the compiled model says so too."""
    model, x, loss_fn = dropout_unet(dropout)
    plain = copy.deepcopy(model)
    checkpoint_modules(model, UNITS)
    with random_numbers(True):
        assert_alike(one_step(model, torch.compile(model), x, loss_fn), one_step(plain, torch.compile(plain), x, loss_fn))
        report = remat.check_equivalence(torch.compile(model), x, loss_fn=loss_fn)
    assert report.equal and report.compiled.startswith("torch.compile of the whole model"), str(report)


def test_blocks_compiled_in_place_draw_the_plain_compiled_steps_numbers():
    """Each level compiled in place (``Module.compile()``, after checkpointing: torchtitan's order), with
    checkpointed segments inside the levels and whole levels: as the plain model compiled the same way."""
    model, x, loss_fn = dropout_unet(nn.Dropout2d, level=Layers)
    plain = copy.deepcopy(model)
    checkpoint_modules(model, UNITS)
    with random_numbers(True):
        for m in (model, plain):
            for level in (m.d1, m.d2, m.mid, m.u2, m.u1):
                level.compile()
        assert_alike(one_step(model, model, x, loss_fn), one_step(plain, plain, x, loss_fn))
        report = remat.check_equivalence(model, x, loss_fn=loss_fn)
    assert report.equal and "5 submodules in place" in report.compiled, str(report)


def test_with_inductors_own_random_numbers_the_recomputation_draws_its_forwards():
    """Inductor's own random numbers: the plain program draws the five masks in the order 1, 4, 5, 2, 3 (as it
    schedules kernels that read no activation), the planned one in another, so the two steps differ; the
    planned gradient is still the slope of its own loss, and with dropout off (eval mode) the two are equal."""
    model, x, loss_fn = dropout_unet()
    checkpoint_modules(model, ["mid", "u2"])  # (UNITS draw alike here: 'mid' and 'u2' reorder)
    with random_numbers(False):
        report = remat.check_equivalence(torch.compile(model), x, loss_fn=loss_fn)
        assert report.slope is not None and report.slope.consistent, str(report)
        assert "loss" in report.mismatched, str(report)
        evaluated = remat.check_equivalence(torch.compile(copy.deepcopy(model).eval()), x, loss_fn=loss_fn)
    assert evaluated.equal, str(evaluated)


def _budget(model, x, loss_fn) -> float:
    """A budget between the least and the most compiled peak remat finds (GiB)."""
    roomy = remat.optimize_checkpointing(model, 1.0, x, loss_fn=loss_fn)
    return 0.85 * roomy.checked_peak_bytes / 2**30


def test_optimize_checkpointing_on_a_compiled_unet_proves_its_plan():
    """The issue's case as a user meets it: ``optimize_checkpointing(torch.compile(model), ...)`` near the
    compiled peak; the plan says it was proved on a compiled step, and the planned model trains like the plain
    model compiled. Its every-block program recomputing dropout was compiled and measured too, and held more than
    keeping dropout's outputs (1.4 MiB against 1.3): the plan keeps them and says so (Note [Two programs per plan]
    in remat.solve.calibrated)."""
    model, x, loss_fn = dropout_unet()
    plain = torch.compile(copy.deepcopy(model))
    compiled = torch.compile(model)
    with random_numbers(True):
        plan = remat.optimize_checkpointing(compiled, _budget(compiled, x, loss_fn), x, loss_fn=loss_fn)
        assert plan.checkpointed and plan.checked_peak_bytes <= plan.budget_bytes
        assert any(n.startswith("proved on one compiled step") for n in plan.notes), plan.notes
        assert plan.compiled_random == "keep"
        assert any(n.startswith("random operators' outputs kept in the checkpointed units: recomputing them")
                   and "with them recomputed" in n for n in plan.notes), plan.notes
        ref_losses, ref_grads = train(plain, x, loss_fn, steps=2)
        losses, grads = train(compiled, x, loss_fn, steps=2)
    assert losses == pytest.approx(ref_losses, abs=ATOL)
    assert max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads) <= ATOL


def test_a_plan_drawing_other_numbers_is_taken_only_with_its_own_gradient(monkeypatch):
    """With random operators recomputed as torch does by itself (``run_and_save_rng_state``, before the fix), the
    planned compiled U-Net draws other masks than the plain compiled step: remat's proof finds the planned
    gradient to be its own loss's and the two steps equal with dropout off, and says so in the plan's note."""
    replay = functools.partial(remat.rewrite.keep_ops_contexts, (), False)
    replay.cache_hash = "test: random operators replayed"  # (AOTAutograd's cache must not take remat's policy)
    monkeypatch.setattr(remat.rewrite.forwards, "unit_policy", lambda saved_ops, random: replay)
    model, x, loss_fn = dropout_unet()
    compiled = torch.compile(model)
    with random_numbers(True):
        plan = remat.optimize_checkpointing(compiled, _budget(compiled, x, loss_fn), x, loss_fn=loss_fn)
    note = [n for n in plan.notes if n.startswith("proved on compiled steps")]
    assert note and "draws other random numbers" in note[0] and "the gradient is the slope" in note[0], plan.notes


def test_the_proof_fails_where_the_planned_step_computes_otherwise(monkeypatch):
    """The proof can fail: a checkpointed call that scales its result by 1 + 1e-3 under compile (a wrong
    program) is refused, in training and with dropout off alike, and the model is left as it was."""
    real = remat.rewrite.call._checkpointed_call

    def scaled(*a, **kw):
        out = real(*a, **kw)
        return out * (1 + 1e-3) if torch.compiler.is_compiling() else out

    monkeypatch.setattr(remat.rewrite.forwards, "_checkpointed_call", scaled)
    model, x, loss_fn = dropout_unet()
    compiled = torch.compile(model)
    before = copy.deepcopy(model.state_dict())
    with random_numbers(True):
        budget = _budget(compiled, x, loss_fn)
        with pytest.raises(remat.EquivalenceError) as caught:
            remat.optimize_checkpointing(compiled, budget, x, loss_fn=loss_fn)
    message = str(caught.value)
    assert "does not compute what the plain compiled step computes" in message, message
    assert "compared with every module in eval mode" in message and "NOT equivalent" in message, message
    assert remat.checkpointed_modules(model) == []
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(m.training for m in model.modules())
