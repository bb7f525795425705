"""Pinned buffers and a side stream are decided when an offloaded unit first runs, from the device of what it
saves, not when the plan is applied (issue #56; Note [Pinned at first run] in remat.rewrite.offload): on an H200
a plan applied on the meta model, as torchtitan does before materializing, copied every tensor from pageable
memory, synchronously (1,118-1,190 ms a step against 447-451). A CPU build cannot pin or make a CUDA stream, so
the CUDA case is faked at the decision's seams: the saved tensor's device, the host buffer and the side stream."""

import copy

import pytest
import torch

import remat.rewrite.offload as offload
import remat.runtime.host_copies as host_copies
from remat.errors import UnsupportedError
from remat.examples import make_gpt
from remat.rewrite.offload import offload_modules, offloader_for
from remat.runtime.host_copies import CopyPath, copy_path

BLOCKS = ["h.0", "h.1", "h.2", "h.3"]


def _materialized(model, weights):
    """``model`` (on meta) materialized on this CPU with ``weights``' values, as torchtitan's ``to_empty`` and
    init do (``to_empty`` unties tied weights: the reference is materialized the same way)."""
    model.to_empty(device="cpu")
    model.load_state_dict(weights.state_dict())
    for name, buf in weights.named_buffers():
        model.get_buffer(name).copy_(buf)
    return model


def _materialized_after_applying_on_meta():
    """The GPT built on meta, its blocks offloaded there, then materialized on this CPU (the flow of
    docs/targets.md: plan, then FSDP2, then materialize); and the same without the plan."""
    weights, (idx, targets), _ = make_gpt()
    model, _, _ = make_gpt(device="meta")
    offload_modules(model, BLOCKS)
    undecided = offloader_for(model)
    reference = _materialized(make_gpt(device="meta")[0], weights)
    return _materialized(model, weights), reference, idx, targets, undecided


def _grads(model, idx, targets, steps=2):
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3 + i)
        logits = model(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return [p.grad for p in model.parameters()]


def test_the_decision_from_the_saved_tensors_device():
    assert copy_path(torch.device("cuda", 0)) == CopyPath("cuda:0", pinned=True, side_stream=True)
    assert copy_path(torch.device("cpu")) == CopyPath("cpu", pinned=False, side_stream=False)
    with pytest.raises(UnsupportedError, match="from CUDA GPUs"):
        copy_path(torch.device("mps"))


def test_applied_on_meta_nothing_is_decided_until_the_first_run_which_on_the_cpu_copies_plainly():
    model, reference, idx, targets, off = _materialized_after_applying_on_meta()
    assert off.path is None and off.decided == {}  # applied on meta: nothing decided
    got, expected = _grads(model, idx, targets), _grads(reference, idx, targets)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    plain = CopyPath("cpu", pinned=False, side_stream=False)
    assert off.path == plain and off.decided == {b: plain for b in BLOCKS}
    assert off.copies is None and not off.pool.pin_memory and off.offloaded_tensors > 0


class _SideStream:
    """What :class:`remat.runtime.host_copies.CudaCopies` is asked, done synchronously on this CPU."""

    made: list = []

    def __init__(self, device):
        self.device, self.out, self.back = device, 0, 0
        _SideStream.made.append(self)

    def to_host(self, host, t):
        self.out += 1
        host.copy_(t)

    def to_device(self, out, host):
        self.back += 1
        out.copy_(host)

    def wait(self, out):
        pass

    def after(self, out, then):
        then()


def test_applied_on_meta_a_unit_first_run_on_cuda_copies_from_pinned_buffers_on_a_side_stream(monkeypatch):
    """Faked at the seams (the saved tensors read as on cuda:0, the pinned allocation and the stream recorded):
    every host buffer the step takes is pinned and every copy, out and back, goes through the side stream; the
    gradients are still the plain model's. Today's code decided when the plan was applied, on meta: pageable
    buffers and synchronous copies (fails here: no pinned buffer, no side stream)."""
    model, reference, idx, targets, off = _materialized_after_applying_on_meta()
    pinned = []

    def host_buffer(nbytes, pin):
        pinned.append(pin)
        return torch.empty(nbytes, dtype=torch.uint8)

    _SideStream.made = []
    monkeypatch.setattr(offload, "_device_of", lambda t: torch.device("cuda", 0), raising=False)
    monkeypatch.setattr(host_copies, "_host_buffer", host_buffer, raising=False)
    monkeypatch.setattr(host_copies, "CudaCopies", _SideStream)
    got, expected = _grads(model, idx, targets), _grads(reference, idx, targets)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert pinned and all(pinned), "a host buffer from pageable memory for a tensor on a GPU"
    (stream,) = _SideStream.made
    assert stream.device == torch.device("cuda", 0) and off.copies is stream
    assert stream.out == stream.back == off.offloaded_tensors > 0  # every copy on the side stream
    cuda = CopyPath("cuda:0", pinned=True, side_stream=True)
    assert off.path == cuda and off.decided == {b: cuda for b in BLOCKS}


def test_a_model_moved_between_steps_gets_a_new_path():
    """Run on the CPU, the pool holds unpinned buffers; the model 'moved' (its tensors read as on cuda:0 from the
    next step) takes a pinned pool and a side stream."""
    model, _, idx, targets, off = _materialized_after_applying_on_meta()
    _grads(model, idx, targets, steps=1)
    assert off.path.device == "cpu" and off.pool.held_bytes > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offload, "_device_of", lambda t: torch.device("cuda", 0))
        mp.setattr(host_copies, "_host_buffer", lambda n, pin: torch.empty(n, dtype=torch.uint8))
        mp.setattr(host_copies, "CudaCopies", _SideStream)
        _grads(model, idx, targets, steps=1)
    assert off.path.pinned and off.pool.pin_memory and isinstance(off.copies, _SideStream)
    assert off.decided["h.0"].device == "cpu"  # each unit's first path stays recorded
