"""How remat's allocator-level meter reads the profiler's events (Note [The step's threads] in
remat._compat.profiler), on events written by hand: which allocations are the step's, which are gloo's scratch, and
where a block whose free was never reported ends."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from remat._compat.profiler import _step_events

OWNER, GLOO = 1, 2
ALLOCATION = torch._C._profiler._EventType.Allocation


@dataclass
class Event:
    """The fields of a profiler event the meter reads."""

    start_time_ns: int
    start_tid: int
    name: str = "[memory]"
    ptr: int = 0
    alloc_size: int = 0
    parent: "Event | None" = None
    tag: object = None
    device: str = "cpu"

    @property
    def extra_fields(self):
        return SimpleNamespace(ptr=self.ptr, alloc_size=self.alloc_size, device=torch.device(self.device))


def alloc(t: int, ptr: int, nbytes: int, tid: int = OWNER, parent: Event | None = None, device: str = "cpu") -> Event:
    return Event(t, tid, ptr=ptr, alloc_size=nbytes, parent=parent, tag=ALLOCATION, device=device)


def free(t: int, ptr: int, nbytes: int, tid: int = OWNER) -> Event:
    return Event(t, tid, ptr=ptr, alloc_size=-nbytes, tag=ALLOCATION)


def peaks(events: list[Event]) -> tuple[int, int]:
    """(the step's peak, gloo's scratch peak) as ProfilerSession sums them."""
    run = scratch = step_peak = scratch_peak = 0
    for _, _, nbytes, scratch_bytes, _ in _step_events(events, OWNER, "cpu"):
        run, scratch = run + nbytes, scratch + scratch_bytes
        step_peak, scratch_peak = max(step_peak, run), max(scratch_peak, scratch)
    return step_peak, scratch_peak


def test_a_block_whose_free_was_not_reported_ends_where_its_address_is_handed_out_again():
    """A tensor of the step that gloo's thread frees is never reported freed; the next allocation at its address
    proves it was freed before. Counted to the end of the step instead, the peak read 1,600 bytes, not 1,100."""
    events = [alloc(1, 0xA, 1000), alloc(2, 0xB, 100), alloc(3, 0xA, 500), free(4, 0xA, 500), free(5, 0xB, 100)]
    assert peaks(events) == (1100, 0)


def test_a_free_and_an_allocation_at_one_address_in_one_instant_read_as_the_free_first():
    """Events in the same nanosecond: a free, then the allocation that reuses its address (listed the other way
    round here). Read allocation first, the free would end the new block: 401 bytes alive at the end where 701
    are, and a peak of 700."""
    events = [alloc(1, 0xA, 300), alloc(2, 0xA, 700), free(2, 0xA, 300), alloc(3, 0xC, 1)]
    step_peak = peaks(events)[0]
    assert step_peak == 701
    run = sum(e[2] for e in _step_events(events, OWNER, "cpu"))
    assert run == 701  # alive at the end: the 700-byte block and the 1-byte one


def test_gloos_copy_inside_a_collective_and_its_threads_buffers_are_scratch_not_the_steps():
    """On the CPU, what the step's thread allocates inside a ``c10d::`` operator (gloo's copy of a reduce-scatter's
    input) and what gloo's threads allocate are scratch; a functional collective's output is the step's."""
    collective = Event(1, OWNER, name="c10d::_reduce_scatter_base_")
    functional = Event(1, OWNER, name="_c10d_functional::all_reduce")
    events = [alloc(2, 0xA, 200, parent=Event(2, OWNER, name="aten::clone", parent=collective)),
              alloc(3, 0xB, 400, tid=GLOO),
              alloc(4, 0xC, 32, parent=Event(4, OWNER, name="aten::clone", parent=functional)),
              alloc(5, 0xD, 64)]
    assert peaks(events) == (96, 600)
    # on a GPU what a collective allocates is the caching allocator's: the step's
    (gpu,) = _step_events([alloc(2, 0xA, 200, parent=collective, device="cuda")], OWNER, "cuda")
    assert gpu[2:4] == (200, 0)
