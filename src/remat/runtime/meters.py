"""The peak meters: peak memory of a piece of work on a device.

In: a device, the tensors alive all along (``state``: parameters, buffers, optimizer state, inputs) and those
alive at the start that may die during the work (``follow``). Out: the peak bytes between :meth:`StepMeter.start`
and :meth:`StepMeter.stop` (and, while it runs, the bytes alive now): on CUDA from the allocator's statistics, on
CPU from a :class:`~remat.runtime.tracker.StorageTracker` (:class:`StepMeter`) or from the profiler's
allocator events for compiled code (:class:`AllocatorMeter`); :func:`measure_peak` wraps one piece of work.

Note [The meter's own time]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
A checked step on a CPU runs under the StorageTracker, a dispatch mode: every operator leaves C++ for a Python
handler that follows its storages. Its time is the meter's, not the model's, yet the checked step's forward and
backward are what the model's error is read from (Note [The model's measured error] in remat.api.margins), and a
wider error times more hand rules beside the plan. Measured with the meter's own time kept in (2-core CPU,
benchmarks/accuracy/meter_own_time.py, two runs), a 6-layer Hugging Face Llama's checked step (width 256, 4 x 256
tokens) read 1.19x and 1.21x the unmetered one in the median of the rounds, the built-in GPT's 1.53x and 1.89x; an
empty dispatch mode cost 8.1 us an operator of a small training step there. So with ``time_own`` the meter counts both: the handler's bookkeeping, timed around each operator, and each call's
entry into a dispatch mode, measured once per process (:func:`dispatch_mode_entry_s`: an empty mode's cost per
operator of a small training step, the least of interleaved readings). :meth:`StepMeter.own_seconds` is their
sum, which the checked step's time leaves out (remat.api.checking), never below the seconds its operators ran
(:meth:`StepMeter.ran_seconds`: an entry cost read high on a busy moment takes out no more than the meter
added). Left out, the same script read 1.11x and 1.07x, 1.15x and 1.33x: what remains is the meter's effect on the
rest of the step (caches, the allocator), not counted. On CUDA the allocator meters the step and nothing is left out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import torch

from remat._compat import TorchDispatchMode, clear_blas_workspaces, local_tensor, outside_dispatch_modes, \
    storage_key
from remat.costs.allocator_reading import AllocatorReading, active_blocks, live_bytes as reading_live_bytes, \
    step_peak_bytes
from remat.runtime.tracker import StorageTracker, allocated_bytes, tensor_bytes


class CudaAllocator:
    """The CUDA caching allocator of one device, as :class:`StepMeter` reads it (Note [The budget on CUDA is
    absolute] in remat.costs.allocator_reading). Tests on a CPU stand a replay of a recorded history in its place."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        if self.device.index is None and torch.cuda.is_available():  # the blocks are listed by device index
            self.device = torch.device("cuda", torch.cuda.current_device())

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocated_bytes(self) -> int:
        """``allocated_bytes.all.current``: every block handed out, whole."""
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated_bytes(self) -> int:
        """``allocated_bytes.all.peak`` since :meth:`reset_peak`."""
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def state_bytes(self, tensors: Sequence[torch.Tensor]) -> int:
        """The blocks behind ``tensors``' distinct storages on this device as the allocator counts them (a large
        block it did not split is up to 1 MiB over its storage: Note [The budget on CUDA is absolute]); a storage
        whose block is not found (not the caching allocator's) at its size rounded to 512 bytes."""
        blocks = active_blocks(torch.cuda.memory_snapshot(), self.device.index)
        seen, total = set(), 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or t.device.index != self.device.index:
                continue
            st = local_tensor(t).untyped_storage()
            key = storage_key(t)
            if key in seen:
                continue
            seen.add(key)
            total += blocks.get(st.data_ptr(), allocated_bytes(st.nbytes(), self.device))
        return total

    def workspace_bytes(self) -> int:
        """The BLAS workspaces a training step holds (bytes), measured once per device and process (Note [Workspaces
        measured once]): the cached ones freed and made again by one small product on this thread and one in a
        backward (autograd's thread), the allocator's growth between the two; 0 where this torch cannot free them
        (:func:`remat._compat.clear_blas_workspaces`), the ones already there then left out as before."""
        if self.device.index in _WORKSPACES:
            return _WORKSPACES[self.device.index]
        self.synchronize()
        if not clear_blas_workspaces():
            _WORKSPACES[self.device.index] = 0
            return 0
        self.synchronize()
        before = self.allocated_bytes()
        with outside_dispatch_modes(), torch.enable_grad():
            a = torch.ones(8, 8, device=self.device, requires_grad=True)
            (a @ a).sum().backward()
            del a
        self.synchronize()
        _WORKSPACES[self.device.index] = self.allocated_bytes() - before
        return _WORKSPACES[self.device.index]


# Note [Workspaces measured once]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The BLAS workspaces are freed and made again to be measured, once per device and process, at remat's first meter
# or profile on it (before it compiles anything), not at every meter: CUDA graphs captured later (compile's
# "reduce-overhead") may hold the workspace they were captured with, which freeing would hand to other tensors.
# Later readings take the figure as held: a workspace freed since (torch frees them around a CUDA graph's capture) and
# made again inside the step is then counted twice, over the step's true reading by at most that figure (the safe
# side of the budget).
_WORKSPACES: dict[int | None, int] = {}


class InOperatorPeak:
    """The :class:`~remat.runtime.tracker.OperatorProbe` of a real CUDA recording (Note [In-operator transients] in
    remat.costs.recording): the allocator's peak statistic reset before each operator and read after it, less what
    is allocated then. Host-side counters, updated as the allocator hands out blocks: no synchronisation. It resets
    the device's peak statistics: not for use while a :class:`StepMeter` reads them."""

    def __init__(self, allocator: CudaAllocator) -> None:
        self.allocator = allocator

    def before(self) -> None:
        self.allocator.reset_peak()

    def after(self) -> int:
        return max(self.allocator.peak_allocated_bytes() - self.allocator.allocated_bytes(), 0)


class StepMeter:
    """Peak memory on ``device`` between :meth:`start` and :meth:`stop` (one thread): ``state`` (alive all
    along: parameters, buffers, optimizer state, inputs), all allocated after ``start``, and ``follow`` (alive
    at ``start``, maybe freed during the step: the gradients Lightning frees after the forward) until it dies.
    On CUDA, the allocator's own statistics, absolute (Note [The budget on CUDA is absolute] in
    remat.costs.allocator_reading): its peak less only the scratch on the device at the start, the state counted
    as the allocator counts its blocks and the BLAS workspaces counted as the step's. ``allocator``: what is read
    on CUDA (default: the device's :class:`CudaAllocator`). For :func:`measure_peak` and across two callbacks of a
    framework's loop (Note [The first step measured] in remat.integrations.first_step)."""

    def __init__(self, device: torch.device, allocator: CudaAllocator | None = None, *, time_own: bool = False) -> None:
        self.device = torch.device(device)
        self._tracker: StorageTracker | None = None
        self._time_own, self._entry_s = time_own, 0.0  # Note [The meter's own time]
        self._base = 0
        self._allocator = allocator if allocator is not None or self.device.type != "cuda" else \
            CudaAllocator(self.device)
        self._reading: AllocatorReading | None = None

    def start(self, state: Sequence[torch.Tensor], follow: Sequence[torch.Tensor] = ()) -> None:
        if self._allocator is not None:
            alloc = self._allocator
            workspaces = alloc.workspace_bytes()
            alloc.synchronize()
            self._reading = AllocatorReading(alloc.allocated_bytes(), 0, alloc.state_bytes([*state, *follow]),
                                             workspaces)
            alloc.reset_peak()
            return
        self._base = tensor_bytes(state, self.device)
        self._tracker = StorageTracker(self.device, ignore=state)
        if self._time_own:
            self._entry_s = dispatch_mode_entry_s()  # (measured outside any mode)
            self._tracker.own_s = 0.0
        self._tracker.__enter__()
        for t in follow:
            self._tracker.track(t)

    def live_bytes(self) -> int:
        """Bytes alive now, on the same count."""
        if self._allocator is not None:
            return reading_live_bytes(self._reading, self._allocator.allocated_bytes())
        return self._base + self._tracker.live_bytes

    def own_seconds(self) -> float:
        """Seconds the meter has spent on itself so far, where ``time_own`` counts them (Note [The meter's own
        time]); 0 otherwise, and on CUDA."""
        tracker = self._tracker
        if tracker is None or tracker.own_s is None:
            return 0.0
        return tracker.own_s + tracker.own_calls * self._entry_s

    def ran_seconds(self) -> float:
        """Seconds the operators themselves ran so far, where ``time_own`` counts them; 0 otherwise."""
        return 0.0 if self._tracker is None or self._tracker.own_s is None else self._tracker.ran_s

    def stop(self) -> int:
        if self._allocator is not None:
            self._allocator.synchronize()
            reading, self._reading = self._reading, None
            return step_peak_bytes(dataclasses.replace(reading,
                                                       peak_allocated_bytes=self._allocator.peak_allocated_bytes()))
        tracker, self._tracker = self._tracker, None
        tracker.__exit__(None, None, None)
        return self._base + tracker.peak_with_held()


class AllocatorMeter(StepMeter):
    """:class:`StepMeter` for compiled code, which allocates outside the dispatcher: on CPU the profiler's
    allocator-level memory events (``remat._compat.profiler_memory_trace``) between :meth:`start` and
    :meth:`stop`; on CUDA the allocator, as StepMeter. The profiler does not report frees of memory allocated
    before it started: on CPU each ``follow`` storage's free is marked in its timeline where it dies
    (``ProfilerSession.follow``). Counted all along instead, the previous step's gradients Lightning frees
    after the forward read a compiled step 257,788 bytes (13%) above its own peak on a 1-block GPT."""

    def start(self, state: Sequence[torch.Tensor], follow: Sequence[torch.Tensor] = ()) -> None:
        if self._allocator is not None:
            super().start(state, follow)
            return
        from remat._compat import ProfilerSession

        self._base = tensor_bytes([*state, *follow], self.device)
        self._session = ProfilerSession(self.device)
        self._session.__enter__()
        kept = {storage_key(t) for t in state if isinstance(t, torch.Tensor)}
        seen: set[int] = set()
        for t in follow:  # (a storage the state holds too stays alive)
            key = storage_key(t)
            if key in kept or key in seen or t.device.type != self.device.type:
                continue
            seen.add(key)
            st = local_tensor(t).untyped_storage()
            self._session.follow(st, allocated_bytes(st.nbytes(), self.device))

    def live_bytes(self) -> int:  # pragma: no cover - the callbacks do not ask
        raise NotImplementedError("AllocatorMeter reads the profiler's events only when it stops")

    def stop(self) -> int:
        if self._allocator is not None:
            return super().stop()
        session, self._session = self._session, None
        session.__exit__(None, None, None)
        return self._base + session.peak_bytes


def measure_peak(work: Callable[[Callable[[], int]], Any], device: torch.device,
                 state: Sequence[torch.Tensor], *, allocator: CudaAllocator | None = None,
                 meter: StepMeter | None = None) -> int:
    """Peak bytes on ``device`` while ``work(live_now)`` runs (:class:`StepMeter`); ``live_now()`` gives the
    bytes alive at the moment it is called, on the same count. ``allocator``: :class:`StepMeter`'s; ``meter``: the
    meter to run (one the caller reads its own time from, Note [The meter's own time]; default a new one)."""
    meter = StepMeter(device, allocator) if meter is None else meter
    meter.start(state)
    try:
        work(meter.live_bytes)
    finally:
        peak = meter.stop()
    return peak


class CountingMode(TorchDispatchMode):
    """A dispatch mode that only counts the operators it sees (``calls``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def small_training_step() -> Callable[[], None]:
    """Forward and backward of 16 x (Linear, LayerNorm, GELU) on 4 x 8 tensors: a training step with nothing to
    compute, whose time is the host's per operator (modules, autograd's records and its engine included)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                                                           torch.nn.GELU()) for _ in range(16)))
        x = torch.randn(4, 8)
    return lambda: layers(x).sum().backward()


@functools.cache
def dispatch_mode_entry_s(reps: int = 10) -> float:
    """Seconds an empty dispatch mode adds to one operator of a training step on this machine (Note [The meter's own
    time]): :func:`small_training_step` with and without one, interleaved ``reps`` times, the least of each, over the
    operators the mode saw."""
    step = small_training_step()

    def run(mode: CountingMode | None) -> float:
        started = time.perf_counter()
        with mode if mode is not None else contextlib.nullcontext():
            step()
        return time.perf_counter() - started

    plain, moded, counted = [], [], CountingMode()
    with outside_dispatch_modes(), torch.enable_grad():
        run(counted)
        for _ in range(reps):
            plain.append(run(None))
            moded.append(run(CountingMode()))
    return max(0.0, (min(moded) - min(plain)) / counted.calls) if counted.calls else 0.0
