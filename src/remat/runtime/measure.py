"""The one measurement layer: one training step, one clock, one peak meter; every stage that runs
the model for real uses them.

* :func:`run_step` is a training step as the loop runs it (Note [Loop style] in ``remat.profile``):
  forward and loss under the caller's autocast, backward outside it (Note [Autocast]), optionally
  the optimizer step.
* :class:`Clock` times on the model's device: CUDA events on a GPU, ``perf_counter`` on CPU.
* :func:`measure_peak` is the peak memory of a piece of work. On CUDA the allocator's statistics
  see every byte. On CPU there is no such counter (``torch.cuda.max_memory_allocated()`` is 0), so
  :class:`StorageTracker` follows every tensor storage created by a dispatched operator and frees
  it when the storage dies.

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
import gc
import contextvars
import statistics
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

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
    leaves_with_paths,
    tree_flatten,
)
from remat.errors import InvalidInputError

LossFn = Callable[[Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


#: Note [CUDA block size]: the CUDA caching allocator hands out blocks in multiples of 512 bytes, and
#: torch.cuda.max_memory_allocated counts blocks; storages on CUDA are counted the same way.
CUDA_BLOCK_BYTES = 512


def allocated_bytes(nbytes: int, device: torch.device) -> int:
    """What a storage of ``nbytes`` occupies on ``device`` as its allocator counts it."""
    if device.type == "cuda" and nbytes > 0:
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


def tensor_bytes(tensors: Iterable[torch.Tensor], device: torch.device | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied tensors count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or (device is not None and t.device.type != device.type):
            continue
        t = local_tensor(t)  # a DTensor's memory on this rank is its local shard
        seen[storage_key(t)] = allocated_bytes(t.untyped_storage().nbytes(), t.device)
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


class StorageTracker(TorchDispatchMode):
    """Follows the storages created by operators while active; ``peak_bytes`` is their highest total.

    Subclasses override :meth:`on_op` to see each operator with its inputs and outputs.

    Note [Sharded tensors]: operators on DTensors are let through (``NotImplemented``) so that DTensor
    runs them as operators on its local shards, which the tracker then sees; DTensor's sharding
    propagation on fake tensors of its own allocates nothing and is skipped. With ``follow_resizes``
    a storage resized in place (FSDP2 frees and re-allocates its all-gather buffers with
    ``UntypedStorage.resize_``, which no dispatch mode sees) ends when it shrinks and starts again, as a
    new storage, when it grows."""

    def __init__(
        self, device: torch.device | str | None = None, *, ignore: Iterable[torch.Tensor] = (),
        count_fake: bool = False, follow_resizes: bool = True,
    ) -> None:
        super().__init__()
        self.follow_resizes = follow_resizes
        self._lock = threading.RLock()
        self._patches = contextlib.ExitStack()
        self._fake_on_entry: Any = None
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
        #: time each operator on this clock (``op_marks``); None: do not time
        self.clock: Clock | None = None
        #: (start, end) clock marks of each operator, when timed
        self.op_marks: list[tuple[Any, Any]] = []

    def __enter__(self):
        self._fake_on_entry = active_fake_mode()
        self._patches = contextlib.ExitStack()
        if self.follow_resizes:
            self._patches.enter_context(storage_resizes_reported(self._resized))
        # the CPU RNG state torch.utils.checkpoint saves per call is made where no dispatch mode sees it
        self._patches.enter_context(rng_states_reported(self.track))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.__exit__(*exc)

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
            if self.by_key.get(rec.key) is rec:
                del self.by_key[rec.key]
                self._refs.pop(rec.key, None)

    def track(self, t: torch.Tensor) -> StorageRecord | None:
        """Start following the storage behind ``t`` if it is new and on the tracked device."""
        if self.device_type is not None and t.device.type != self.device_type:
            return None
        if not self.count_fake and isinstance(t, FakeTensor):
            return None
        t = local_tensor(t)
        st = t.untyped_storage()
        key = storage_key(t)
        if key in self.ignored:
            return None
        rec = self.by_key.get(key)
        if rec is not None:
            return rec
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
            self.records.append(rec)
            self.by_key[key] = rec
            self._refs[key] = weakref.ref(st, lambda _, rec=rec: self._freed(rec))
            self.live_bytes += rec.nbytes
            return rec

    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:  # pragma: no cover - hook
        pass

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_dtensor_class(t) for t in types):
            return NotImplemented  # Note [Sharded tensors]: DTensor runs it on its local shards
        if not self.count_fake and active_fake_mode() is not self._fake_on_entry:
            return func(*args, **kwargs)  # DTensor's sharding propagation: allocates nothing
        if self.clock is not None:
            t0 = self.clock.mark()
            out = func(*args, **kwargs)
            self.op_marks.append((t0, self.clock.mark()))  # the operator itself, not the bookkeeping
        else:
            out = func(*args, **kwargs)
        if func.namespace == "prim":  # metadata queries (prim.device) under FakeTensorMode
            return out
        inputs: set[int] | None = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
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


def parallel_loss(loss: torch.Tensor) -> contextlib.AbstractContextManager:
    """Note [Loss parallel]: with tensor parallelism's ``loss_parallel()`` the loss is a DTensor, computed from
    logits sharded on the class dimension, and its backward must run inside the same context, as the user's
    loop runs it (``with loss_parallel(): loss = ...; loss.backward()``). remat runs the backward itself, so
    for a DTensor loss it enters ``loss_parallel()`` around it; the context changes only how DTensor loss
    operators dispatch, so a DTensor loss computed without it (from gathered logits) backpropagates as
    before. Without this, remat's step failed and blamed the user's inputs."""
    from remat._compat import is_dtensor_class

    if not is_dtensor_class(type(loss)):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


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


# -- time ------------------------------------------------------------------------------------------
class Clock:
    """The one timer. On CUDA a mark is an event recorded on the current stream, so an interval is the
    device's time between two points of the work, without a host synchronisation per mark; on CPU a
    mark is ``time.perf_counter()``."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from mark ``start`` to mark ``end`` (waits for ``end`` on CUDA)."""
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def time(self, fn: Callable[[], Any]) -> float:
        """Seconds that ``fn()`` takes on the device."""
        start = self.mark()
        fn()
        return self.seconds(start, self.mark())


def median_time(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median of ``reps`` timings of ``fn()`` (seconds)."""
    clock = Clock(device)
    return statistics.median(clock.time(fn) for _ in range(reps))


# -- one training step ------------------------------------------------------------------------------
def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """One tensor, a tuple/list of positional arguments, or a dict of keyword arguments."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InvalidInputError(
        f"example_inputs must be a tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments, got {type(example_inputs).__name__}"
    )


def input_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The distinct parameters that require gradients."""
    return [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]


def default_loss(output: Any) -> torch.Tensor:
    """The loss remat uses when none is given (Note [The default loss]): the output itself if it is a
    scalar tensor; ``output.loss`` or ``output["loss"]`` if present; else the one scalar tensor with a
    gradient in the output (nanoGPT's ``(logits, loss)``); else, when the output holds no scalar, the sum
    of its floating-point tensors (a stand-in whose gradients exercise every output). An output with
    several scalar tensors is refused: pass ``loss_fn``."""
    return loss_from_output(output)[0]


# Note [The default loss]
# ~~~~~~~~~~~~~~~~~~~~~~~
# Without loss_fn, remat profiles, plans and checks the step on a loss read from the model's output, and
# it must not guess where the output is ambiguous: summing nanoGPT's (logits, loss) trains on
# sum(logits) + loss (414.7 against 6.95), with other gradients and another peak than the user's step.
# A scalar output, an output's `.loss`/`["loss"]`, or the one scalar tensor with a gradient among the
# output's tensors is the loss; an output with no scalar in it carries no loss, and the sum of its
# floating-point tensors stands in (the loop computes its loss from them outside the model); several
# scalars are refused. Which one was taken is said in the plan's notes (`loss_from_output`'s second value).


class DefaultLoss:
    """:func:`default_loss`, remembering what it took from the output (``note``, for the plan's notes)."""

    def __init__(self) -> None:
        self.note: str | None = None

    def __call__(self, output: Any) -> torch.Tensor:
        loss, self.note = loss_from_output(output)
        return loss


def loss_from_output(output: Any) -> tuple[torch.Tensor, str | None]:
    """``default_loss(output)`` and, where it is not plainly the output's loss, what it took (for the
    plan's notes)."""
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.reshape(()), None
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss, None
    tensors = [(path, t) for path, t in leaves_with_paths(output)
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    scalars = [(path, t) for path, t in tensors if t.numel() == 1 and t.requires_grad]
    if len(scalars) == 1:
        path, t = scalars[0]
        return (t if t.dim() == 0 else t.reshape(())), (f"the default loss is output{path}, the one scalar tensor with a gradient in the "
                               f"model's output of {len(tensors)} tensors; pass loss_fn= if the loop's loss is another")
    if len(scalars) > 1:
        raise InvalidInputError(
            f"cannot tell the loss in the model's output ({type(output).__name__}): it holds {len(scalars)} "
            f"scalar tensors with gradients ({', '.join('output' + p for p, _ in scalars)}); pass "
            "loss_fn=lambda out: ... giving the loss the loop calls backward on"
        )
    if not tensors:
        raise InvalidInputError(
            f"cannot derive a loss from the model's output ({type(output).__name__}: no floating-point "
            "tensor in it); pass loss_fn=lambda out: ..."
        )
    note = None if len(tensors) == 1 and isinstance(output, torch.Tensor) else (
        f"the default loss is the sum of the {len(tensors)} floating-point tensors of the model's output (it "
        "holds no loss); pass loss_fn= for the loop's loss")
    return sum(t.sum() for _, t in tensors), note  # type: ignore[return-value]


def checked_loss(loss_fn: LossFn, out: Any) -> torch.Tensor:
    """``loss_fn(out)``, refused unless it is a scalar tensor with a gradient."""
    loss = loss_fn(out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InvalidInputError(
            f"loss_fn must return a scalar tensor, got {shape}; reduce it (e.g. .mean()) or pass loss_fn="
        )
    if not loss.requires_grad:
        raise InvalidInputError(
            "the loss has no gradient (requires_grad=False): check that the model has trainable "
            "parameters that the loss depends on and that autograd is not disabled"
        )
    return loss


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor
    #: the model's output (None when the loop drops it after the loss)
    output: Any


def run_step(
    model: nn.Module | Callable[..., Any], args: tuple, kwargs: dict, loss_fn: LossFn, *,
    output_alive: bool = True, grad_of: Sequence[torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None, forward_context: Any = None,
    on: Callable[[str], None] | None = None,
) -> StepResult:
    """One training step as the loop runs it (Note [Loop style] in remat.profile): forward and loss under
    the caller's autocast state (inside ``forward_context`` when given), backward outside autocast (Note
    [Autocast]), then ``optimizer.step()`` and ``zero_grad(set_to_none=True)`` when an optimizer is given.
    With ``output_alive`` the output stays referenced until the step ends; without, it is dropped once
    the loss is computed. ``grad_of``: differentiate these tensors with ``torch.autograd.grad`` (their
    ``.grad`` untouched) instead of ``loss.backward()``. ``on("loss")`` and ``on("backward")`` are called
    once the loss exists and once backward has returned. The cyclic garbage collector does not run
    during it (Note [Cyclic garbage in a step])."""
    new_step()
    with cycles_uncollected():
        with forward_context if forward_context is not None else contextlib.nullcontext():
            out = model(*args, **kwargs)
            loss = checked_loss(loss_fn, out)
        if not output_alive:
            out = None
        if on is not None:
            on("loss")
        with outside_autocast(), parallel_loss(loss):
            if grad_of is None:
                loss.backward()
            else:
                torch.autograd.grad(loss, list(grad_of), allow_unused=True)
        if on is not None:
            on("backward")
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return StepResult(loss.detach(), out)


@contextlib.contextmanager
def cycles_uncollected() -> Iterator[None]:
    """Note [Cyclic garbage in a step]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Some tensors of a step are kept alive only by a reference cycle (seen with a selective checkpoint
    keeping every operator of a Hugging Face GPT-2 block: 128-256 KiB of a 5.2 MB peak), so they die
    whenever Python's cyclic collector happens to run, which depends on every allocation the process made
    before: the same plan measured 4.91, 5.04 or 5.17 MB by the history of the process. Every step remat
    records, times or measures runs with the collector paused (its state put back after), so the
    prediction and the check both see the step where no collection runs: the most it holds. A training
    step in which the collector runs can only hold less."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# -- peak memory ------------------------------------------------------------------------------------
class StepMeter:
    """Peak memory on ``device`` between :meth:`start` and :meth:`stop` (one thread): ``state`` (alive all
    along: parameters, buffers, optimizer state, inputs), all allocated after ``start``, and ``follow`` (alive
    at ``start``, maybe freed during the step: the gradients Lightning frees after the forward) until it dies.
    On CUDA, the allocator's peak less what else is on the device. For :func:`measure_peak` and across two
    callbacks of a framework's loop (Note [The first step measured] in remat.integrations.first_step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._tracker: StorageTracker | None = None
        self._base = 0

    def start(self, state: Sequence[torch.Tensor], follow: Sequence[torch.Tensor] = ()) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device) - tensor_bytes([*state, *follow], self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._base = tensor_bytes(state, self.device)
        self._tracker = StorageTracker(self.device, ignore=state)
        self._tracker.__enter__()
        for t in follow:
            self._tracker.track(t)

    def live_bytes(self) -> int:
        """Bytes alive now, on the same count."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) - self._base
        return self._base + self._tracker.live_bytes

    def stop(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._base
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
        if self.device.type == "cuda":
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
        if self.device.type == "cuda":
            return super().stop()
        session, self._session = self._session, None
        session.__exit__(None, None, None)
        return self._base + session.peak_bytes


def measure_peak(work: Callable[[Callable[[], int]], Any], device: torch.device,
                 state: Sequence[torch.Tensor]) -> int:
    """Peak bytes on ``device`` while ``work(live_now)`` runs (:class:`StepMeter`); ``live_now()`` gives the
    bytes alive at the moment it is called, on the same count."""
    meter = StepMeter(device)
    meter.start(state)
    try:
        work(meter.live_bytes)
    finally:
        peak = meter.stop()
    return peak
