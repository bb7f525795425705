"""Offloaded units (issue #50, the mechanism: Note [Offloaded units] in remat.rewrite.offload): the saved
activations of chosen modules go to host buffers in the forward and come back for the backward. On this CPU the
"device" is host memory too, so what is checked here is the mechanism: exactness, the pool, the bookkeeping, what
a step's own allocations are once the pool is warm; not what a GPU would free or how long its copies take."""

import copy

import pytest
import torch

from remat.errors import InvalidInputError, PlanMismatchError, UnsupportedError
from remat.examples import make_gpt
from remat.rewrite import checkpoint_modules, checkpointed_modules, remove_checkpointing
from remat.rewrite.install import offloaded_modules
from remat.rewrite.offload import MIN_OFFLOAD_BYTES, offload_modules, offloadable, offloader_for
from remat.runtime.tracker import StorageTracker

BLOCKS = ["h.0", "h.1", "h.2", "h.3"]


def _gpt():
    model, (idx, targets), _ = make_gpt()
    return model, idx, targets


def _steps(model, idx, targets, n=3, seed=7):
    """``n`` AdamW steps, dropout on, each seeded alike: the losses, the last step's gradients, the parameters
    and buffers after them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for i in range(n):
        torch.manual_seed(seed + i)
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, grads, [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def test_offloaded_blocks_train_bitwise_as_the_plain_model_with_dropout_on():
    """Nothing is recomputed, so nothing is drawn again: three AdamW steps with every block's activations
    offloaded give the plain model's losses, gradients, parameters and buffers, bitwise."""
    model, idx, targets = _gpt()
    plain = copy.deepcopy(model)
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    offload_modules(model, BLOCKS)
    got, expected = _steps(model, idx, targets), _steps(plain, idx, targets)
    for a, b in zip(got, expected):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    off = offloader_for(model)
    assert off.offloaded_tensors > 0 and off.offloaded_bytes >= off.offloaded_tensors * MIN_OFFLOAD_BYTES


def test_a_broken_copy_back_is_caught_by_the_exactness_test(monkeypatch):
    """The check above can fail: a copy back that perturbs one element changes the gradients."""
    import remat.rewrite.offload as offload

    model, idx, targets = _gpt()
    plain = copy.deepcopy(model)
    offload_modules(model, BLOCKS)
    real = offload.Offloader.unpack

    def perturbed(self, unit, packed):
        out = real(self, unit, packed)
        return out + 1e-3 if isinstance(packed, offload._Parked) and out.is_floating_point() else out

    monkeypatch.setattr(offload.Offloader, "unpack", perturbed)
    got, expected = _steps(model, idx, targets, n=1), _steps(plain, idx, targets, n=1)
    assert not all(torch.equal(x, y) for x, y in zip(got[1], expected[1]))


def test_the_host_pool_is_reused_from_the_second_step_and_every_buffer_comes_back():
    model, idx, targets = _gpt()
    offload_modules(model, BLOCKS)
    off = offloader_for(model)
    _steps(model, idx, targets, n=1)
    allocated, held = off.pool.allocations, off.pool.held_bytes
    assert allocated > 0 and off.pool.in_use_bytes == 0
    _steps(model, idx, targets, n=3)
    assert (off.pool.allocations, off.pool.held_bytes, off.pool.in_use_bytes) == (allocated, held, 0)


def test_with_a_warm_pool_the_steps_own_allocations_peak_lower_than_the_plain_steps():
    """What this CPU can show of the memory: with the host buffers allocated by the first step (apart from the
    step's own allocations, as a GPU's pinned pool is apart from its device memory), the forward and backward's
    own peak, read by remat's dispatch-level meter, is below the plain step's by most of what was offloaded."""
    def peak(model, pool=()):
        with StorageTracker("cpu", ignore=pool) as tracker:
            torch.manual_seed(1)
            logits = model(idx)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        model.zero_grad(set_to_none=True)
        return tracker.peak_bytes

    model, idx, targets = _gpt()
    plain = peak(copy.deepcopy(model))
    offload_modules(model, BLOCKS)
    peak(model)  # warms the pool
    off = offloader_for(model)
    before = off.offloaded_bytes
    offloaded = peak(model, off.pool.buffers())
    moved = off.offloaded_bytes - before
    assert offloaded < plain, (offloaded, plain)
    # a block's tensors come back one block ahead: two blocks' worth may be back at once
    assert plain - offloaded >= moved - 2 * moved // len(BLOCKS), (plain, offloaded, moved)


def test_offloading_touches_nothing_else_and_is_undone():
    model, idx, targets = _gpt()
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    offload_modules(model, ["h.1", "h.3"])
    assert offloaded_modules(model) == ["h.1", "h.3"] and checkpointed_modules(model) == []
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert remove_checkpointing(model) == ["h.1", "h.3"]
    assert offloaded_modules(model) == [] and all("forward" not in m.__dict__ for m in model.modules())


def test_a_unit_is_kept_recomputed_or_offloaded_not_two_of_them():
    model, _, _ = _gpt()
    checkpoint_modules(model, ["h.0"])
    with pytest.raises(InvalidInputError, match="one of the three"):
        offload_modules(model, ["h.0"])
    with pytest.raises(PlanMismatchError, match="no module named"):
        offload_modules(model, ["h.9"])


def test_a_second_backward_through_an_offloaded_unit_is_refused_with_what_to_do():
    model, idx, targets = _gpt()
    offload_modules(model, ["h.0"])
    loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    loss.backward(retain_graph=True)
    with pytest.raises(UnsupportedError, match="retain_graph"):
        loss.backward()


def test_views_small_tensors_parameters_and_the_units_inputs_stay_where_they_are():
    big = torch.randn(256, 256, requires_grad=True) * 2
    assert offloadable(big)
    assert not offloadable(big[:10])  # a view
    assert not offloadable(torch.randn(8, 8) * 2)  # small
    assert not offloadable(torch.nn.Parameter(torch.randn(256, 256)))
    assert not offloadable(big.t().contiguous().t())  # not contiguous
    assert not offloadable(big, keep=frozenset({big.untyped_storage().data_ptr()}))
