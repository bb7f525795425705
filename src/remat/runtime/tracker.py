"""Storage tracking on CPU: which tensor storages the dispatched operators create, and when each dies.

In: work run inside a :class:`StorageTracker` (a dispatch mode), on a device, with the storages alive before it
(``ignore``). Out: every storage created while tracking as a :class:`StorageRecord` (the operator that made it,
the first one after it died), the live bytes after each operator (``timeline``) and their peak
(``peak_bytes``, :meth:`~StorageBook.peak_with_held`); also :func:`tensor_bytes`, the bytes of tensors' distinct
storages as their allocator counts them. :class:`StorageBook` keeps the records; :class:`StorageTracker` feeds
it from the dispatch-mode hooks. Used by :mod:`remat.runtime.meters` and by the recording stages.

Note [Dispatch-level accounting]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The tracker sees the outputs of every ATen operator, after autograd, on the thread
that runs it. It does not see scratch memory that a kernel allocates and frees
internally (e.g. inside a fused CPU kernel) nor allocator fragmentation, so on CPU
"measured peak" means: bytes of live tensor storages, at operator granularity.
Memory that existed before tracking started (parameters, buffers, optimizer state,
inputs) is counted separately by :func:`tensor_bytes`.

Note [Storages without memory]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Two kinds of tensors have a storage of their own that holds none of the step's memory, and count as aliases of the
storage whose memory they stand for (:meth:`StorageBook.alias`: that memory lives until every one of them dies):
the ``AsyncCollectiveTensor`` a functional collective returns (and every view of it), a wrapper whose storage
reports its full size but holds no data (the data is its ``elem``); and, on fake tensors, the output of
``_c10d_functional.wait_tensor``, a new storage where a real wait returns its input. Counted as memory, they put
the predicted peak of a plan for the tests' sequence-parallel decoder (2 ranks, gloo) 2.7% above the profiler's
allocator events from its real recording (three 16 KiB wrappers held for backward) and 3.5% above from its
recording on the fake process group (65,528 bytes); as aliases, 1,024 bytes (0.05%) and 0 bytes above. Functional
collectives on real CPU tensors are also settled (Note [Collectives settled] in remat.runtime.distributed): a
recorded real step reads no late frees.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol

import torch

from remat._compat import (
    FakeTensor,
    TorchDispatchMode,
    active_fake_mode,
    is_dtensor_class,
    local_tensor,
    storage_key,
    untyped_storage_key,
    rng_states_reported,
    storage_resizes_reported,
    in_sharding_propagation,
    sharding_propagation_marked,
    tree_flatten,
)
from remat._compat.distributed import collective_elem
from remat.runtime.distributed import settled_collective

if TYPE_CHECKING:  # the clock is measure's, which imports this module
    from remat.runtime.measure import Clock


#: Note [CUDA block size]: the CUDA caching allocator hands out blocks in multiples of 512 bytes, and
#: torch.cuda.max_memory_allocated counts blocks; storages on CUDA are counted the same way.
CUDA_BLOCK_BYTES = 512


def allocated_bytes(nbytes: int, device: torch.device) -> int:
    """What a storage of ``nbytes`` occupies on ``device`` as its allocator counts it."""
    if device.type == "cuda" and nbytes > 0:
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


def tensor_bytes(tensors: Iterable[torch.Tensor], device: torch.device | None = None, *,
                 counted_as: torch.device | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied tensors count once), those on ``device``
    only when given; each as its own device's allocator counts it, or ``counted_as``'s (fake CPU tensors standing for
    a GPU's: remat.target)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or (device is not None and t.device.type != device.type):
            continue
        t = local_tensor(t)  # a DTensor's memory on this rank is its local shard
        seen[storage_key(t)] = allocated_bytes(t.untyped_storage().nbytes(), counted_as or t.device)
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
    #: first seen as an alias of an operator's input, not allocated by one (Note [Memory found])
    found: bool = False
    #: the shape and dtype of the tensor first seen on it ("" when made by a resize)
    shape: tuple[int, ...] = ()
    dtype: str = ""
    #: the stream it was allocated on, numbered in order of first use (0: the one current when tracking started),
    #: when the tracker follows streams (Note [Target kernels] in remat.target.source)
    stream: int = 0


_FOUND_HELD: contextvars.ContextVar[bool] = contextvars.ContextVar("remat_found_held", default=True)


@contextlib.contextmanager
def found_storages_are_fresh(fresh: bool = True) -> Iterator[None]:
    """Within the block, storages first seen as aliases count from when they are seen, even if they outlive
    the tracked work (Note [Memory found]; for models wrapped by FSDP2)."""
    token = _FOUND_HELD.set(not fresh)
    try:
        yield
    finally:
        _FOUND_HELD.reset(token)


#: operators that hand back a tensor just made outside the dispatcher (``torch.tensor(data)``): a new
#: allocation, although the output aliases the input
_FRESH = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift.default})
_WAIT = torch.ops._c10d_functional.wait_tensor.default


class StorageBook:
    """The bookkeeping of :class:`StorageTracker`: the storages followed (``records``, ``by_key``), the live
    bytes, their peak and their ``timeline``, counted per operator (``index``). Storages are started with
    :meth:`track` (or by a reported resize) and end when Python frees them; what feeds it is the tracker's."""

    def __init__(
        self, device: torch.device | str | None = None, *, ignore: Iterable[torch.Tensor] = (),
        count_fake: bool = False, follow_streams: bool = False,
    ) -> None:
        super().__init__()
        self._lock = threading.RLock()
        #: whether FakeTensors (which hold no memory) count; only for recording under FakeTensorMode
        self.count_fake = count_fake
        #: storages alive before tracking (parameters, optimizer state...): never counted, even when an
        #: in-place operator returns them
        self.ignored: set[int] = {storage_key(local_tensor(t)) for t in ignore if isinstance(t, torch.Tensor)}
        self.device_type = None if device is None else torch.device(device).type
        self.index = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self.records: list[StorageRecord] = []
        #: live bytes after each operator
        self.timeline: list[int] = []
        self.by_key: dict[int, StorageRecord] = {}
        self._refs: dict[int, weakref.ref] = {}
        #: per record (by id), the keys of the storages alive that hold its memory (Note [Storages without memory])
        self._holders: dict[int, set[int]] = {}
        #: streams seen, by identity, numbered from 0 (the current stream when tracking starts); None: streams are
        #: not followed (``follow_streams``)
        self.streams: dict[int, int] | None = {id(torch.cpu.current_stream()): 0} if follow_streams else None

    def _resized(self, st: torch.UntypedStorage, nbytes: int) -> None:
        key = untyped_storage_key(st)
        rec = self.by_key.get(key)
        if rec is not None:
            self._freed(rec)
        if nbytes > 0 and key not in self.ignored and (self.device_type is None or st.device.type == self.device_type):
            self._new_record(st, key, allocated_bytes(nbytes, st.device))

    def _freed(self, rec: StorageRecord) -> None:
        # Note [Frees on other threads]: a storage dies where its last reference goes, which may be a
        # collective's worker thread (gloo, nccl) finishing asynchronously: the counters are shared
        with self._lock:
            if rec.free_index is not None:  # ended by a resize already
                return
            rec.free_index = self.index
            self.live_bytes -= rec.nbytes
            for key in self._holders.pop(id(rec), set()) | {rec.key}:
                if self.by_key.get(key) is rec:
                    del self.by_key[key]
                    self._refs.pop(key, None)

    def _dropped(self, rec: StorageRecord, key: int) -> None:
        """The storage of ``key`` died: ``rec`` is freed once no storage holding its memory is left."""
        with self._lock:
            if self.by_key.get(key) is rec:
                del self.by_key[key]
                self._refs.pop(key, None)
            keys = self._holders.get(id(rec), set())
            keys.discard(key)
            if not keys:
                self._freed(rec)

    def alias(self, t: torch.Tensor, rec: StorageRecord) -> None:
        """Count the storage behind ``t``, which holds no memory, as holding ``rec``'s (Note [Storages without
        memory])."""
        key = storage_key(t)
        if key in self.by_key or key in self.ignored or rec.free_index is not None:
            return
        with self._lock:
            self._holders.setdefault(id(rec), {rec.key}).add(key)
            self.by_key[key] = rec
            self._refs[key] = weakref.ref(local_tensor(t).untyped_storage(),
                                          lambda _, rec=rec, key=key: self._dropped(rec, key))

    def track(self, t: torch.Tensor) -> StorageRecord | None:
        """Start following the storage behind ``t`` if it is new and on the tracked device."""
        if self.device_type is not None and t.device.type != self.device_type:
            return None
        if not self.count_fake and isinstance(t, FakeTensor):
            return None
        t = local_tensor(t)
        key = storage_key(t)
        if key in self.ignored:
            return None
        rec = self.by_key.get(key)
        if rec is not None:
            return rec
        elem = collective_elem(t)
        if elem is not None:  # Note [Storages without memory]
            rec = self.track(elem)
            if rec is not None:
                self.alias(t, rec)
            return rec
        st = t.untyped_storage()
        rec = self._new_record(st, key, allocated_bytes(st.nbytes(), t.device))
        if rec is not None:
            rec.shape, rec.dtype = tuple(t.shape), str(t.dtype).removeprefix("torch.")
        return rec

    def held_before(self) -> list[StorageRecord]:
        """Note [Memory found]: an operator may return, as an alias of one of its inputs (an in-place write,
        a view), a storage the tracker never saw allocated. If it is still alive when tracking ends, it was
        allocated before tracking began and lives on: DDP's gradient buckets, a tensor a module keeps as a
        plain attribute; it was alive all along. (One that dies during the work was made during it where no
        dispatch mode sees, as inside gloo's collectives: it counts from when it was first seen.) Not under
        FSDP2 (:func:`found_storages_are_fresh`): its own buffers persist by resizing, which the tracker
        follows, and what its collectives still hold when a step ends (the last reduce-scatter's input)
        was made during the step."""
        if not _FOUND_HELD.get():
            return []
        return [r for r in self.records if r.found and r.free_index is None]

    def peak_with_held(self) -> int:
        """``peak_bytes`` with the storages of :meth:`held_before` counted from the start."""
        held = sorted((r.alloc_index, r.nbytes) for r in self.held_before())
        if not held:
            return self.peak_bytes
        late = sum(b for _, b in held)  # bytes of held storages not yet seen after operator i
        peak, k = 0, 0
        for i, live in enumerate(self.timeline):
            while k < len(held) and held[k][0] <= i:
                late -= held[k][1]
                k += 1
            peak = max(peak, live + late)
        return peak

    def _new_record(self, st: torch.UntypedStorage, key: int, nbytes: int) -> StorageRecord:
        with self._lock:  # Note [Frees on other threads]
            rec = StorageRecord(key, nbytes, self.index)
            if self.streams is not None:
                rec.stream = self.streams.setdefault(id(torch.cpu.current_stream()), len(self.streams))
            self.records.append(rec)
            self.by_key[key] = rec
            self._holders[id(rec)] = {key}
            self._refs[key] = weakref.ref(st, lambda _, rec=rec, key=key: self._dropped(rec, key))
            self.live_bytes += rec.nbytes
            return rec


class OperatorProbe(Protocol):
    """Reads, around one operator, the bytes it held inside itself above what it left allocated (Note [In-operator
    transients] in remat.costs.recording): :meth:`before` just before it runs, :meth:`after` just after."""

    def before(self) -> None: ...

    def after(self) -> int: ...


class StorageTracker(StorageBook, TorchDispatchMode):
    """Follows the storages created by operators while active; ``peak_bytes`` is their highest total.

    Subclasses override :meth:`on_op` to see each operator with its inputs and outputs. The records, live
    bytes and peak are kept by :class:`StorageBook`; this class is the dispatch-mode hooks that feed it.

    Note [Sharded tensors]: operators on DTensors are let through (``NotImplemented``) so that DTensor
    runs them as operators on its local shards, which the tracker then sees; DTensor's sharding
    propagation on fake tensors of its own allocates nothing and is skipped. With ``follow_resizes``
    a storage resized in place (FSDP2 frees and re-allocates its all-gather buffers with
    ``UntypedStorage.resize_``, which no dispatch mode sees) ends when it shrinks and starts again, as a
    new storage, when it grows."""

    def __init__(
        self, device: torch.device | str | None = None, *, ignore: Iterable[torch.Tensor] = (),
        count_fake: bool = False, follow_resizes: bool = True, follow_streams: bool = False,
    ) -> None:
        super().__init__(device, ignore=ignore, count_fake=count_fake, follow_streams=follow_streams)
        self.follow_resizes = follow_resizes
        self._patches = contextlib.ExitStack()
        self._fake_on_entry: Any = None
        #: time each operator on this clock (``op_marks``); None: do not time
        self.clock: Clock | None = None
        #: (start, end) clock marks of each operator, when timed
        self.op_marks: list[tuple[Any, Any]] = []
        #: reads what each operator holds inside itself above what it leaves allocated (Note [In-operator
        #: transients] in remat.costs.recording); None: not read
        self.probe: OperatorProbe | None = None
        #: per operator index, what ``probe`` read where it was above 0 (bytes)
        self.transients: dict[int, int] = {}
        #: seconds of this mode's own bookkeeping (its handler less the operators it ran), its calls and the operators'
        #: seconds, when counted (Note [The meter's own time] in remat.runtime.meters; not with ``clock``); None: not
        self.own_s: float | None = None
        self.own_calls, self.ran_s = 0, 0.0

    def __enter__(self):
        self._fake_on_entry = active_fake_mode()
        self._patches = contextlib.ExitStack()
        if self.follow_resizes:
            self._patches.enter_context(storage_resizes_reported(self._resized))
        if self.count_fake:  # Note [Sharded tensors]: DTensor's propagation may run in the recording's own mode
            self._patches.enter_context(sharding_propagation_marked())
        # the CPU RNG state torch.utils.checkpoint saves per call is made where no dispatch mode sees it
        self._patches.enter_context(rng_states_reported(self.track))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.__exit__(*exc)

    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:  # pragma: no cover - hook
        pass

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.own_s is None:
            return self._handle(func, types, args, kwargs)
        entered, ran = time.perf_counter(), self.ran_s
        try:
            return self._handle(func, types, args, kwargs)
        finally:
            self.own_s += time.perf_counter() - entered - (self.ran_s - ran)
            self.own_calls += 1

    def _run(self, func, args, kwargs):
        """The operator itself (its time kept apart from the bookkeeping's where that is counted)."""
        if self.own_s is None:
            return settled_collective(func, args, kwargs)
        started = time.perf_counter()
        out = settled_collective(func, args, kwargs)  # (an operator that raises ends the step)
        self.ran_s += time.perf_counter() - started
        return out

    def _handle(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_dtensor_class(t) for t in types):
            return NotImplemented  # Note [Sharded tensors]: DTensor runs it on its local shards
        # DTensor's sharding propagation allocates nothing: on fake tensors of its own mode, or (when every tensor
        # is fake, counted) in the recording's own mode, marked (Note [Sharded tensors])
        if in_sharding_propagation() if self.count_fake else active_fake_mode() is not self._fake_on_entry:
            return func(*args, **kwargs)
        probe = self.probe
        if probe is not None:
            probe.before()
        if self.clock is not None:
            t0 = self.clock.mark()
            out = func(*args, **kwargs)
            self.op_marks.append((t0, self.clock.mark()))  # the operator itself, not the bookkeeping
        else:  # memory, not time: Note [Collectives settled] in remat.runtime.distributed
            out = self._run(func, args, kwargs)
        if probe is not None and (held := probe.after()) > 0:
            self.transients[self.index] = held
        if func.namespace == "prim":  # metadata queries (prim.device) under FakeTensorMode
            return out
        if func is _WAIT and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor) \
                and storage_key(out) != storage_key(args[0]) and (rec := self.by_key.get(storage_key(args[0]))):
            self.alias(out, rec)  # a fake wait's output: Note [Storages without memory]
        inputs: set[int] | None = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if collective_elem(local_tensor(t)) is not None:  # Note [Storages without memory]
                self.track(t)
                continue
            key = storage_key(t)
            if key not in self.by_key and key not in self.ignored:
                if inputs is None:
                    inputs = {storage_key(x) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
                if key in inputs and func not in _FRESH:  # Note [Memory found]: perhaps allocated before
                    rec = self.track(t)
                    if rec is not None:
                        rec.found = True
                    continue
            self.track(t)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.timeline.append(self.live_bytes)
        self.on_op(func, args, kwargs, out)
        self.index += 1
        return out
