"""What an operator allocates inside itself (Note [In-operator transients] in remat.costs.recording): carried by the
recording, added by the memory model at that operator's instant, read by the recorder from the allocator."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from recordings import A, chain
from remat.costs.effects import unit_costs
from remat.costs.recording import Recording
from remat.costs.simulate import MemoryModel
from remat.costs.unit_costs import Profile
from remat.profile.recorder import record_step
from remat.runtime.meters import InOperatorPeak

#: cuDNN's convolution workspace at the plain U-Net's peak on the H200
CUDNN = 7_059_355


def _profile(rec: Recording, fixed: int = 0, workspace: int = 0) -> Profile:
    """The Profile the profiler assembles from ``rec`` (its timelines and unit ``a``), with ``fixed`` bytes of
    parameters."""
    return Profile(units=unit_costs(rec, [A]), live_bytes=rec.timeline(), before_bytes=rec.before_bytes(),
                   after_backward_bytes=rec.after_backward_bytes, grad_bytes=rec.grad_timeline(),
                   saved_bytes=rec.saved_timeline(), backward_start=rec.backward_start, params_bytes=fixed,
                   grads_bytes=0, buffers_bytes=0, inputs_bytes=0, optimizer_state_bytes=0, optimizer_step_bytes=0,
                   forward_s=0.0, backward_s=0.0, optimizer_s=0.0, device="cuda", capture_path="hooks",
                   memory_recorded_with="real", optimizer="none", workspace_bytes=workspace)


def test_a_transient_moves_the_timeline_at_its_operator_only():
    rec = chain(transient_bytes={7: CUDNN})
    plain = chain()
    assert rec.timeline() == tuple(v + (CUDNN if i == 7 else 0) for i, v in enumerate(plain.timeline()))
    assert rec.before_bytes() == plain.before_bytes()  # what is alive before an operator: not its own workspace
    assert rec.saved_timeline() == plain.saved_timeline() and rec.grad_timeline() == plain.grad_timeline()


def test_a_transient_moves_the_predicted_peak_by_its_bytes_where_it_is_the_peak():
    """chain's live bytes: 100, 150, 160, 160, 160, 160, 160, 110, 10, 0 (peak 160). A workspace of 30 bytes in
    operator 2 (160 alive) puts the peak at 190; one of 7,059,355 in backward operator 7 (110 alive) at 7,059,465;
    one of 40 in operator 8 (10 alive) moves nothing."""
    base = MemoryModel(_profile(chain(), fixed=1000)).peak_bytes([])
    assert base == 1000 + 160
    assert MemoryModel(_profile(chain(transient_bytes={2: 30}), fixed=1000)).peak_bytes([]) == base + 30
    assert MemoryModel(_profile(chain(transient_bytes={7: CUDNN}), fixed=1000)).peak_bytes([]) == 1000 + 110 + CUDNN
    assert MemoryModel(_profile(chain(transient_bytes={8: 40}), fixed=1000)).peak_bytes([]) == base


def test_a_recomputed_operator_holds_its_transient_again():
    """Unit ``a`` (operators 0-1) checkpointed: its recomputation runs operator 0 again, workspace included. The
    recomputation grows memory by 100 then 150 bytes (its peak 150, at operator 1); with a workspace of 1,000 bytes
    in operator 0, by 1,100 then 150: its row is 950 higher, and it is the plan's peak (1,110; 160 without)."""
    plain, held = MemoryModel(_profile(chain())), MemoryModel(_profile(chain(transient_bytes={0: 1000})))
    chosen = plain.assignment(["a"])
    row = {r.name: r for r in plain.rows}["recompute_a"]
    row_held = {r.name: r for r in held.rows}["recompute_a"]
    assert held.row_bytes(row_held, chosen) - plain.row_bytes(row, chosen) == 1100 - 150
    assert plain.peak_bytes(["a"]) == 160
    assert held.peak_bytes(["a"]) == held.row_bytes(row_held, chosen) == 1110


def test_the_workspaces_are_fixed_memory():
    """The BLAS workspaces the step holds all along (measured on CUDA) are in every plan's peak."""
    assert MemoryModel(_profile(chain(), workspace=64 * 2**20)).peak_bytes([]) == 160 + 64 * 2**20
    assert MemoryModel(_profile(chain(), workspace=64 * 2**20)).breakdown([]).workspace_bytes == 64 * 2**20


class _Allocator:
    """An allocator's statistics, as :class:`remat.runtime.meters.CudaAllocator` gives them: on its ``k``-th
    operator (counted by peak resets) a block of ``nbytes`` is allocated and freed inside the operator."""

    def __init__(self, k: int, nbytes: int) -> None:
        self.k, self.nbytes, self.ops = k, nbytes, 0
        self.now = self.peak = 10_000

    def reset_peak(self) -> None:
        self.peak = self.now
        if self.ops == self.k:
            self.peak = self.now + self.nbytes  # the workspace, freed before the operator returns
        self.ops += 1

    def peak_allocated_bytes(self) -> int:
        return self.peak

    def allocated_bytes(self) -> int:
        return self.now


def test_the_recorder_reads_each_operators_transient_from_the_allocator():
    """A real recording fed the allocator's readings: the operator inside which the allocator peaked above what it
    left allocated carries that many bytes, at its timeline index, and no other does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(4, 8)
    plain = record_step(model, (x,), {}, lambda y: y.sum(), torch.device("cpu"), ["0", "1", "2"], fake=False)
    k = plain.backward_start + 2  # an operator of the backward (autograd's thread on CUDA)
    rec = record_step(model, (x,), {}, lambda y: y.sum(), torch.device("cpu"), ["0", "1", "2"], fake=False,
                      probe=InOperatorPeak(_Allocator(k, CUDNN)))
    assert dict(rec.transient_bytes) == {k: CUDNN}
    assert plain.transient_bytes == {}  # on CPU no probe reads anything
    bare = dataclasses.replace(rec, transient_bytes={}).timeline()
    assert [a - b for a, b in zip(rec.timeline(), bare)] == [CUDNN if i == k else 0 for i in range(rec.n_ops)]
