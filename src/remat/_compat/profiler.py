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
    (``torch.profiler.profile(profile_memory=True)``, read from ``prof.profiler.kineto_results``; checked on
    2.8, 2.11, 2.13, 2.15): ``peak_bytes``, the most allocated above what was allocated when it began, and ``marked``,
    the bytes allocated above that when each :meth:`mark` was made. It sees what compiled kernels and code
    outside the dispatcher allocate, which a dispatch-level tracker cannot. Frees of memory allocated before
    it started are not reported: allocate what the work frees inside it, or :meth:`follow` it (its free is
    then marked where it happens)."""

    def __init__(self, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.device = torch.device(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof = profile(activities=activities, profile_memory=True)
        self.peak_bytes = 0
        self.marked: dict[str, int] = {}
        self._followed: list[weakref.ref] = []

    def __enter__(self) -> "ProfilerSession":
        with _stderr_silenced():  # kineto logs "profiler_start"/"profiler_stop" lines to fd 2 (torch 2.13)
            self._prof.__enter__()
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
        with _stderr_silenced():
            self._prof.__exit__(*exc)
        self._followed.clear()  # frees after the session are not its
        events = []
        labels: dict[int, str] = {}
        for e in self._prof.profiler.kineto_results.events():
            if e.name() == "[memory]" and e.device_type().name.lower() == self.device.type:
                events.append((e.start_ns(), 0, e.nbytes()))
            elif e.name().startswith("remat::mark::"):
                labels[len(events)] = e.name().removeprefix("remat::mark::")
                events.append((e.start_ns(), 1, 0))
            elif e.name().startswith("remat::freed::"):
                events.append((e.start_ns(), 0, -int(e.name().removeprefix("remat::freed::"))))
        run = 0
        for i in sorted(range(len(events)), key=lambda i: events[i][:2]):
            run += events[i][2]
            self.peak_bytes = max(self.peak_bytes, run)
            if i in labels:
                self.marked[labels[i]] = run


def profiler_memory_trace(work: Callable[[Callable[[str], None]], object] | Callable[[], object],
                          device: torch.device, *, marks: bool = False) -> tuple[int, dict[str, int]]:
    """The most bytes allocated on ``device`` while ``work()`` runs, above what was allocated when it began
    (:class:`ProfilerSession`). With ``marks``, ``work(mark)`` is given a function ``mark(label)``; the
    second result maps each label to the bytes allocated (above the start) when it was marked."""
    with ProfilerSession(device) as session:
        work(session.mark) if marks else work()
    return session.peak_bytes, session.marked


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
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
