"""The profiler's allocator-level memory events (part of remat._compat: see its docstring)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator

import torch


def profiler_memory_peak(work: Callable[[], object], device: torch.device) -> int:
    """The most bytes allocated on ``device`` while ``work()`` runs, above what was allocated when it began
    (:func:`profiler_memory_trace`)."""
    return profiler_memory_trace(work, device)[0]


class ProfilerSession:
    """The profiler's allocator-level memory events on ``device`` between ``__enter__`` and ``__exit__``
    (``torch.profiler.profile(profile_memory=True)``, read from the event tree of ``prof.profiler.kineto_results``:
    ``experimental_event_tree()``, its allocations' ``extra_fields.ptr`` and each event's ``start_tid``; checked on
    2.8, 2.13, 2.15): ``peak_bytes``, the most allocated above what was allocated when it began, and ``marked``,
    the bytes allocated above that when each :meth:`mark` was made. It sees what compiled kernels and code
    outside the dispatcher allocate, which a dispatch-level tracker cannot. Frees of memory allocated before
    it started are not reported: allocate what the work frees inside it, or :meth:`follow` it (its free is
    then marked where it happens).

    Note [The step's threads]
    ~~~~~~~~~~~~~~~~~~~~~~~~~
    Only what the thread that entered the session allocates is counted (its frees wherever they happen): memory
    a communication library allocates on its own worker threads is its scratch, not the step's tensors. Gloo
    allocates such a buffer per collective on its threads (an all-gather's output-sized one: on the tests' FSDP2
    GPT 199,936 bytes per block and 82,432 for the root, each group's unsharded bytes), and when it is alive
    against the step's own peak depends on how the threads are scheduled (``benchmarks/distributed/gloo_threads.py``), and a
    check that read a step without it accepted a plan that the next steps read 3,264 bytes over its budget
    (issue #46). Gloo also copies a reduce-scatter's input on the caller's thread, inside its ``c10d::`` operator
    (FSDP2's gradients: 199,936 bytes per block, 82,432 for the root), and its work holds the copy: where gloo's
    thread drops the work last, the copy's free is never reported (the profiler reports a free only on a thread
    it profiles), and the meter counted it to the end of the step. It is gloo's scratch too and counted as such
    (on the CPU, every allocation with a ``c10d::`` operator among its callers): counted, a compiled FSDP2 plan
    read 82,432 bytes more in some steps than in others, in all three steps of a test's reading on a new CI
    machine, 3,264 bytes over its budget. The dispatch-level meter of eager steps never saw those buffers either
    (a dispatch mode is thread-local and does not see inside an operator it hands on), and on a GPU NCCL's
    buffers are outside the caching allocator's counts. ``foreign_peak_bytes``: the most such scratch alive at
    once, for the record. A block of the step that gloo's thread frees, unreported, ends where its address is
    handed out again (:func:`_step_events`)."""

    def __init__(self, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.device = torch.device(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof = profile(activities=activities, profile_memory=True)
        self.peak_bytes = 0
        self.foreign_peak_bytes = 0
        self.marked: dict[str, int] = {}
        self._followed: list[weakref.ref] = []

    def __enter__(self) -> "ProfilerSession":
        from torch.profiler import record_function

        with stderr_silenced():  # kineto logs "profiler_start"/"profiler_stop" lines to fd 2 (torch 2.13)
            self._prof.__enter__()
        with record_function("remat::owner"):  # names the thread that runs the work (Note [The step's threads])
            pass
        return self

    @staticmethod
    def mark(label: str) -> None:
        from torch.profiler import record_function

        with record_function(f"remat::mark::{label}"):
            pass

    def follow(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Count ``nbytes`` (a storage alive before the session began, e.g. the previous step's gradients
        a framework frees during its step) as freed where ``storage`` dies: a mark in the profiler's own
        timeline, made by a weak reference's callback where the last reference goes (the profiler reports
        no free of memory it did not see allocated)."""
        from torch.profiler import record_function

        def freed(_ref) -> None:
            with record_function(f"remat::freed::{nbytes}"):
                pass

        self._followed.append(weakref.ref(storage, freed))

    def __exit__(self, *exc) -> None:
        with stderr_silenced():
            self._prof.__exit__(*exc)
        self._followed.clear()  # frees after the session are not its
        tree, todo = [], list(self._prof.profiler.kineto_results.experimental_event_tree())
        while todo:
            e = todo.pop()
            tree.append(e)
            todo += e.children
        owner = next(e.start_tid for e in tree if e.name == "remat::owner")
        events = _step_events(tree, owner, self.device.type)
        run = scratch = 0
        for _, _, nbytes, foreign_bytes, label in events:
            run += nbytes
            scratch += foreign_bytes
            self.peak_bytes = max(self.peak_bytes, run)
            self.foreign_peak_bytes = max(self.foreign_peak_bytes, scratch)
            if label is not None:
                self.marked[label] = run


def _step_events(tree: list, owner: int, device_type: str) -> list[tuple[int, int, int, int, str | None]]:
    """The session's events in time order, as ``(time, order, bytes, scratch bytes, mark)`` (marks sort after the
    allocations of their instant; a free before an allocation at the same instant): what ``owner``'s thread
    allocates counts as the step's (its frees wherever they are reported), the rest as scratch (Note [The step's
    threads]). An address handed out again was freed before, reported or not: a free that gloo's thread made,
    which the profiler does not report, ends the block there instead of never (on the tests' 2 x 2 mesh,
    unsettled, the steps reading above the least fell from 2-6 of 10 per rank to 1-4)."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, int, int, str | None]] = []
    foreign: dict[int, int] = {}  # address -> bytes of live scratch (other threads', collectives' copies)
    mine: dict[int, int] = {}  # address -> bytes of the step's live blocks
    cpu = device_type == "cpu"  # gloo's copies; on a GPU what a collective allocates is the allocator's
    allocations = [e for e in tree if e.tag == _EventType.Allocation and e.extra_fields.device.type == device_type]
    for e in sorted(allocations, key=lambda e: (e.start_time_ns, e.extra_fields.alloc_size > 0)):
        f = e.extra_fields
        if f.alloc_size > 0:
            if f.ptr in foreign:  # handed out again: freed, reported or not
                events.append((e.start_time_ns, 0, 0, -foreign.pop(f.ptr), None))
            if f.ptr in mine:
                events.append((e.start_time_ns, 0, -mine.pop(f.ptr), 0, None))
            if e.start_tid != owner or cpu and _in_collective(e):
                foreign[f.ptr] = f.alloc_size
                events.append((e.start_time_ns, 0, 0, f.alloc_size, None))
            else:
                mine[f.ptr] = f.alloc_size
                events.append((e.start_time_ns, 0, f.alloc_size, 0, None))
        elif f.ptr in foreign:
            events.append((e.start_time_ns, 0, 0, -foreign.pop(f.ptr), None))
        else:
            mine.pop(f.ptr, None)
            events.append((e.start_time_ns, 0, f.alloc_size, 0, None))
    for e in tree:
        if e.name.startswith("remat::mark::"):
            events.append((e.start_time_ns, 1, 0, 0, e.name.removeprefix("remat::mark::")))
        elif e.name.startswith("remat::freed::"):
            events.append((e.start_time_ns, 0, -int(e.name.removeprefix("remat::freed::")), 0, None))
    return sorted(events, key=lambda x: x[:2])


def _in_collective(event) -> bool:
    """Whether ``event`` happened inside a ``c10d::`` operator (a process group's collective; not a functional
    collective's ``_c10d_functional::`` wrapper, whose output is the step's)."""
    while (event := event.parent) is not None:
        if event.name.startswith("c10d::"):
            return True
    return False


def profiler_memory_trace(work: Callable[[Callable[[str], None]], object] | Callable[[], object],
                          device: torch.device, *, marks: bool = False) -> tuple[int, dict[str, int]]:
    """The most bytes allocated on ``device`` while ``work()`` runs, above what was allocated when it began
    (:class:`ProfilerSession`). With ``marks``, ``work(mark)`` is given a function ``mark(label)``; the
    second result maps each label to the bytes allocated (above the start) when it was marked."""
    with ProfilerSession(device) as session:
        work(session.mark) if marks else work()
    return session.peak_bytes, session.marked


@contextlib.contextmanager
def stderr_silenced() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null within the block (C++ logging that Python cannot turn off)."""
    import os
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (an embedded interpreter): nothing to silence
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
