"""The CUDA meter's reading of the allocator (Note [The budget on CUDA is absolute] in remat.costs.allocator_reading),
on a CPU: the allocator's history of the plain U-Net's ``measure_step`` recorded on the H200
(benchmarks/h200/data/unet_plain.snapshot.pickle.gz, from ../shared/gpu/h200-2026-12-04/) replayed into the meter, and
readings written by hand."""

from __future__ import annotations

import gzip
import pathlib
import pickle

import pytest
import torch

from remat.costs.allocator_reading import (
    AllocatorEvent, AllocatorReading, active_blocks, block_bytes, blocks_alive_outside, events_from_snapshot,
    events_peak_bytes,
    step_peak_bytes)
from remat.runtime.meters import StepMeter, measure_peak

DATA = pathlib.Path(__file__).parents[2] / "benchmarks" / "h200" / "data" / "unet_plain.snapshot.pickle.gz"
MiB = 2**20
#: cuDNN's convolution workspace at the plain U-Net's peak (allocated on autograd's thread, no Python frame)
CUDNN_BLOCK = 7_059_355
#: what remat's measure_step read on the H200 for this step (../shared/gpu/README.md), before this change
MEASURED_THEN = 32_480_768


@pytest.fixture(scope="module")
def snapshot() -> dict:
    with gzip.open(DATA, "rb") as f:
        return pickle.load(f)


def _measured_step(snapshot: dict) -> tuple[int, int]:
    """The trace's first and last index of the step measure_step metered (its frames pass through measure_peak)."""
    idx = [i for i, e in enumerate(snapshot["device_traces"][0])
           if any(f["name"] == "measure_peak" for f in e["frames"])]
    return idx[0], idx[-1]


class ReplayedAllocator:
    """The CUDA allocator of :class:`remat.runtime.meters.CudaAllocator`'s interface, replaying a history: the
    blocks alive before it (``outside``: bytes per block) and its events; :meth:`run` plays the events up to an
    index. ``state``: the state's blocks as the allocator counts them; ``workspaces``: what the BLAS libraries
    hold."""

    def __init__(self, events: list[tuple[str, int, int]], outside: int, state: int, workspaces: int) -> None:
        self.events, self.state, self.workspaces = events, state, workspaces
        self.live: dict[int, int] = {}
        self.now = outside
        self.peak = self.now
        self.at = 0

    def run(self, until: int) -> None:
        for action, addr, nbytes in self.events[self.at:until]:
            if action == "alloc":
                self.live[addr] = nbytes
                self.now += nbytes
                self.peak = max(self.peak, self.now)
            elif action == "free":
                self.now -= self.live.pop(addr, 0)
        self.at = until

    def synchronize(self) -> None:
        pass

    def allocated_bytes(self) -> int:
        return self.now

    def peak_allocated_bytes(self) -> int:
        return self.peak

    def reset_peak(self) -> None:
        self.peak = self.now

    def state_bytes(self, tensors) -> int:
        return self.state

    def workspace_bytes(self) -> int:
        return self.workspaces


def _replay(snapshot: dict) -> tuple[ReplayedAllocator, int, int]:
    trace = snapshot["device_traces"][0]
    events = [("alloc" if e["action"] == "alloc" else "free", int(e["addr"]), block_bytes(int(e["size"])))
              for e in trace if e["action"] in ("alloc", "free_requested")]
    index = [i for i, e in enumerate(trace) if e["action"] in ("alloc", "free_requested")]
    first, last = _measured_step(snapshot)
    start = index.index(first)
    end = max(k for k, i in enumerate(index) if i <= last) + 1
    outside = blocks_alive_outside(snapshot)
    # the step's state: the trainee's parameters, buffers and AdamW state (alive in the history when it started)
    # and the batch (made before the history, the 196,608-byte block)
    alive: dict[int, int] = {}
    for action, addr, nbytes in events[:start]:
        if action == "alloc":
            alive[addr] = nbytes
        else:
            alive.pop(addr, None)
    state = sum(alive.values()) + 196_608
    workspaces = sum(b for b in outside if b == 32 * MiB)
    return ReplayedAllocator(events, sum(outside), state, workspaces), start, end


def test_the_shared_history_holds_two_cublas_workspaces_and_the_cudnn_block(snapshot):
    """What the tests below rest on: two 32 MiB blocks on the device from before the history to its end (cuBLAS's,
    made by the Llama run before in the same process), and the cuDNN block allocated in every step's backward."""
    outside = blocks_alive_outside(snapshot)
    assert sorted(outside)[-2:] == [32 * MiB, 32 * MiB]
    first, last = _measured_step(snapshot)
    sizes = [e["size"] for e in snapshot["device_traces"][0][first:last + 1] if e["action"] == "alloc"]
    assert CUDNN_BLOCK in sizes


def test_a_block_allocated_inside_an_operator_is_counted(snapshot):
    """The history's measured step, replayed as allocator events: its peak is reached at the allocation of cuDNN's
    7,059,355-byte workspace (inside convolution_backward, where no dispatch-level meter sees it), and is the
    reading measure_step gave on the H200; without that block the step peaks 1,585,664 bytes lower, elsewhere."""
    events = events_from_snapshot(snapshot)
    replay, start, end = _replay(snapshot)
    step = events[start:end]
    held = replay.state
    peak = events_peak_bytes(step, held)
    at = next(k for k, e in enumerate(step) if e.action == "alloc" and e.nbytes == block_bytes(CUDNN_BLOCK))
    assert peak == MEASURED_THEN
    assert events_peak_bytes(step[:at + 1], held) == peak > events_peak_bytes(step[:at], held)
    without = events_peak_bytes([e for e in step if e.addr != step[at].addr], held)
    assert peak - without == 1_585_664


def test_the_cuda_meter_counts_workspaces_held_for_the_process_life(snapshot):
    """The CUDA meter fed the replayed allocator: the step's reading is what measure_step read on the H200 plus the
    two cuBLAS workspaces that were on the device before it and stay for every later step (64 MiB); the U-Net
    model measure_step copied from (on the device, not the step's) is left out. The meter before this change read
    32,480,768 (the workspaces in its ``_base``)."""
    replay, start, end = _replay(snapshot)
    replay.run(start)
    peak = measure_peak(lambda live_now: replay.run(end), torch.device("cuda"), [], allocator=replay)
    assert peak == MEASURED_THEN + 2 * 32 * MiB


def test_live_bytes_on_the_same_count(snapshot):
    replay, start, end = _replay(snapshot)
    replay.run(start)
    meter = StepMeter(torch.device("cuda"), replay)
    meter.start([])
    assert meter.live_bytes() == replay.state + replay.workspaces
    replay.run(end)
    assert meter.stop() == MEASURED_THEN + 2 * 32 * MiB


def test_the_state_counted_as_the_allocator_counts_its_blocks():
    """Written by hand, the 1B Llama's case: a tied embedding of 525,336,576 bytes in a block of 526,385,152 (its
    segment rounded to 2 MiB, the 1 MiB left unsplit), 100 MiB of scratch remat holds, a step that allocates 1 GiB
    at its peak. The step's reading holds the embedding's whole block (the user's steps do), not the scratch."""
    embedding, block = 525_336_576, 526_385_152
    reading = AllocatorReading(allocated_at_start_bytes=block + 100 * MiB + 64 * MiB,
                               peak_allocated_bytes=block + 100 * MiB + 64 * MiB + 2**30,
                               state_bytes=block, workspace_bytes=64 * MiB)
    assert step_peak_bytes(reading) == block + 64 * MiB + 2**30
    assert step_peak_bytes(reading) - (embedding + 2**30) == 65 * MiB  # the H200's 68,157,440 bytes


def test_events_free_only_what_they_allocated():
    events = [AllocatorEvent("alloc", 1, 512), AllocatorEvent("free", 7, 4096), AllocatorEvent("alloc", 2, 1024),
              AllocatorEvent("free", 1, 512), AllocatorEvent("alloc", 3, 2048)]
    assert events_peak_bytes(events, held_bytes=10_000) == 10_000 + 1024 + 2048
    with pytest.raises(ValueError):
        events_peak_bytes([AllocatorEvent("resize", 1, 1)])


def test_the_blocks_handed_out_are_found_by_address(snapshot):
    """How the meter counts the state at its blocks' sizes: the blocks handed out, by address, from the snapshot's
    segments: each inside its segment, their bytes the segments' own ``allocated_size``, the two cuBLAS workspaces
    among them (everything the history allocated was freed by its end)."""
    blocks = active_blocks(snapshot["segments"])
    segments = [(int(g["address"]), int(g["total_size"])) for g in snapshot["segments"]]
    assert all(any(a <= addr and addr + size <= a + n for a, n in segments) for addr, size in blocks.items())
    assert sum(blocks.values()) == sum(int(g["allocated_size"]) for g in snapshot["segments"])
    assert sorted(blocks.values())[-2:] == [32 * MiB, 32 * MiB]
    assert sorted(blocks.values()) == sorted(blocks_alive_outside(snapshot))


def test_the_h200_llama_65_mib_are_two_cublas_workspaces_and_an_unsplit_mebibyte():
    """The 1B Llama's training steps after optimize_checkpointing on the H200 peaked 68,157,440 bytes (65 MiB) over
    the checked peak (25,796,031,488 against 25,727,874,048: ../shared/gpu/h200-2026-12-04/
    optimize_checkpointing_llama1b_24gib.json), what the old meter's ``_base`` left out. The allocator's history of
    the same model's plain steps (benchmarks/h200/data/llama1b_none.snapshot.pickle.gz) holds what: exactly two blocks alive
    from their first product to the end, 32 MiB each (cuBLAS's workspaces: the forward's on the step's thread, the
    backward's on autograd's, no Python frame), and the tied embedding (525,336,576 bytes) alone in a segment of
    526,385,152, whose 1 MiB is not split off (the allocator splits a large block only when more than 1 MiB
    remains), so the allocator counts its block 1 MiB over its storage, all along."""
    with gzip.open(DATA.parent / "llama1b_none.snapshot.pickle.gz", "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    alive: dict[int, dict] = {}
    for e in trace:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_requested":
            alive.pop(e["addr"], None)
    kept = sorted(alive.values(), key=lambda e: trace.index(e))
    assert [e["size"] for e in kept] == [32 * MiB, 32 * MiB]
    assert kept[0]["frames"] and not kept[1]["frames"]  # the step's thread, then autograd's
    embedding = 128_256 * 2_048 * 2
    made = [(trace[i - 1]["size"], e["size"]) for i, e in enumerate(trace)
            if e["action"] == "alloc" and e["size"] == embedding and trace[i - 1]["action"] == "segment_alloc"]
    assert made and made[0] == (embedding + MiB, embedding)
    assert 2 * 32 * MiB + MiB == 25_796_031_488 - 25_727_874_048
