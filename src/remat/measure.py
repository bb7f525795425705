"""Measuring memory and time on the model's device.

On CUDA the allocator's statistics see every byte. On CPU there is no such counter
(``torch.cuda.max_memory_allocated()`` is 0), so :class:`StorageTracker` follows every
tensor storage created by a dispatched operator and frees it when the storage dies.

Note [Dispatch-level accounting]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The tracker sees the outputs of every ATen operator, after autograd, on the thread
that runs it. It does not see scratch memory that a kernel allocates and frees
internally (e.g. inside a fused CPU kernel) nor allocator fragmentation, so on CPU
"measured peak" means: bytes of live tensor storages, at operator granularity.
Memory that existed before tracking started (parameters, buffers, optimizer state,
inputs) is counted separately by :func:`tensor_bytes`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


#: Note [CUDA block size]: the CUDA caching allocator hands out blocks in multiples of 512 bytes, and
#: torch.cuda.max_memory_allocated counts blocks; storages on CUDA are counted the same way.
CUDA_BLOCK_BYTES = 512


def allocated_bytes(nbytes: int, device: torch.device) -> int:
    """What a storage of ``nbytes`` occupies on ``device`` as its allocator counts it."""
    if device.type == "cuda" and nbytes > 0:
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def tensor_bytes(tensors: Iterable[torch.Tensor], device: torch.device | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied tensors count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or (device is not None and t.device.type != device.type):
            continue
        st = t.untyped_storage()
        seen[st._cdata] = allocated_bytes(st.nbytes(), t.device)
    return sum(seen.values())


@dataclass
class StorageRecord:
    """One storage created while tracking."""

    key: int
    nbytes: int
    #: index of the operator that created it
    alloc_index: int
    #: index of the first operator that ran after it died; None while alive
    free_index: int | None = None


class StorageTracker(TorchDispatchMode):
    """Follows the storages created by operators while active; ``peak_bytes`` is their highest total.

    Subclasses override :meth:`on_op` to see each operator with its inputs and outputs."""

    def __init__(
        self, device: torch.device | str | None = None, *, ignore: Iterable[torch.Tensor] = (),
        count_fake: bool = False,
    ) -> None:
        super().__init__()
        #: whether FakeTensors (which hold no memory) count; only for recording under FakeTensorMode
        self.count_fake = count_fake
        #: storages alive before tracking (parameters, optimizer state...): never counted, even when an
        #: in-place operator returns them
        self.ignored: set[int] = {storage_key(t) for t in ignore if isinstance(t, torch.Tensor)}
        self.device_type = None if device is None else torch.device(device).type
        self.index = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self.records: list[StorageRecord] = []
        self.by_key: dict[int, StorageRecord] = {}
        self._refs: dict[int, weakref.ref] = {}
        #: live bytes after each operator (only kept when ``keep_timeline``)
        self.timeline: list[int] = []
        self.keep_timeline = False
        #: synchronise CUDA around each operator so that ``last_op_s`` is its kernel time, not its launch
        self.sync_cuda = False

    def _freed(self, rec: StorageRecord) -> None:
        rec.free_index = self.index
        self.live_bytes -= rec.nbytes
        if self.by_key.get(rec.key) is rec:
            del self.by_key[rec.key]
            self._refs.pop(rec.key, None)

    def track(self, t: torch.Tensor) -> StorageRecord | None:
        """Start following the storage behind ``t`` if it is new and on the tracked device."""
        if self.device_type is not None and t.device.type != self.device_type:
            return None
        if not self.count_fake and isinstance(t, FakeTensor):
            return None
        st = t.untyped_storage()
        key = st._cdata
        if key in self.ignored:
            return None
        rec = self.by_key.get(key)
        if rec is not None:
            return rec
        rec = StorageRecord(key, allocated_bytes(st.nbytes(), t.device), self.index)
        self.records.append(rec)
        self.by_key[key] = rec
        self._refs[key] = weakref.ref(st, lambda _, rec=rec: self._freed(rec))
        self.live_bytes += rec.nbytes
        return rec

    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:  # pragma: no cover - hook
        pass

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.sync_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if self.sync_cuda:
            torch.cuda.synchronize()
        #: wall time of the operator itself, without the tracker's bookkeeping (seconds)
        self.last_op_s = time.perf_counter() - t0
        if func.namespace == "prim":  # metadata queries (prim.device) under FakeTensorMode
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.on_op(func, args, kwargs, out)
        if self.keep_timeline:
            self.timeline.append(self.live_bytes)
        self.index += 1
        return out


@contextlib.contextmanager
def outside_autocast():
    """Note [Autocast]: remat runs forward and loss under the caller's autocast state and backward
    outside it, as PyTorch's AMP recipe does (checkpoint recomputes under the forward's state). The
    recipe's backward comes after the ``with torch.autocast(...)`` block has exited, which clears the
    autocast cache of low-precision weight copies; remat is called inside that block, so it clears the
    cache itself before backward (only the cache: later casts are made again, with the same values).
    A backward with the cache alive measured ~5% more than the AMP loop on a bf16 Llama config."""
    new_step()  # the same clearing: what the AMP loop's exit from its autocast block does
    with torch.autocast("cpu", enabled=False), (
        torch.autocast("cuda", enabled=False) if torch.cuda.is_available() else contextlib.nullcontext()
    ):
        yield


def new_step() -> None:
    """Start a training step as the AMP loop does: its ``with torch.autocast(...)`` block is entered
    afresh each step, so the autocast cache starts empty. remat runs several steps (and forward-only
    passes) inside the caller's one block; without this, a step's forward would reuse weight casts
    made by an earlier pass while its recomputation makes them again, and a selective checkpoint,
    which names operators by position, would see a different operator sequence (Note [Autocast])."""
    if torch.is_autocast_cache_enabled() and _autocast_on():
        torch.clear_autocast_cache()


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class StepMeasurement:
    """Measured peak memory and step time of real training steps."""

    #: highest memory during one step, all of it: parameters, gradients, optimizer state, activations (bytes)
    peak_bytes: int
    #: median wall time of the timed steps (seconds)
    step_time_s: float
    step_times_s: tuple[float, ...]
    #: how the peak was measured: "cuda allocator" or "live tensor storages (CPU)"
    method: str


def measure_training_step(
    model: torch.nn.Module,
    run_step: Callable[[], Any],
    *,
    device: torch.device,
    state_tensors: Callable[[], Iterable[torch.Tensor]],
    warmup: int = 1,
    repeats: int = 3,
    measure_memory: bool = True,
) -> StepMeasurement:
    """Measure real training steps: ``run_step()`` does forward, backward and optimizer step.

    ``state_tensors()`` lists what is alive before a step (parameters, buffers, optimizer state,
    inputs): on CPU their bytes are added to the tracked peak. Runs ``warmup`` untimed steps
    (which create optimizer state), ``repeats`` timed steps, then one step under memory tracking
    (CPU) or with the allocator's peak reset (CUDA; memory allocated on the device that is not in
    ``state_tensors()`` is left out). The model and optimizer are trained by these steps: pass copies.
    """
    for _ in range(warmup):
        run_step()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        run_step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    if not measure_memory:
        return StepMeasurement(0, statistics.median(times) if times else 0.0, tuple(times), "not measured")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # whatever else lives on the device (the original model, other tensors) is not this step's
        other = torch.cuda.memory_allocated(device) - tensor_bytes(state_tensors(), device)
        torch.cuda.reset_peak_memory_stats(device)
        run_step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - other
        method = "cuda allocator"
    else:
        state = list(state_tensors())
        before = tensor_bytes(state, device)
        with StorageTracker(device, ignore=state) as tracker:
            run_step()
        peak = before + tracker.peak_bytes
        method = "live tensor storages (CPU)"
    return StepMeasurement(peak, statistics.median(times) if times else 0.0, tuple(times), method)
