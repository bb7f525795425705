"""The Recording: one immutable record of a training step, as plain numbers (no torch).

``remat.profile`` runs forward, loss and backward once under a recorder and returns a
:class:`Recording`; ``remat.costs.effects`` derives from it what checkpointing each unit does to memory.
A *timeline index* is the position of an operator in the step's sequence of dispatched operators
(forward first, then backward; Note [Timeline] in ``remat.profile.recorder``). Storages are numbered by
their position in ``Recording.storages``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from remat.costs.unit_names import op_key


@dataclass(frozen=True)
class Storage:
    """One storage created during the step."""

    nbytes: int
    #: timeline index of the operator that created it
    alloc_index: int
    #: timeline index of the first operator that ran after it died; None: alive when recording ended
    free_index: int | None = None
    #: a parameter's gradient (alive once backward has run)
    is_grad: bool = False
    #: the shape and dtype of the first tensor seen on it (what holds the peak: Note [What holds the peak])
    shape: tuple[int, ...] = ()
    dtype: str = ""


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd saved for backward."""

    #: the storage behind it (index into ``Recording.storages``); None for one made before recording
    storage: int | None
    #: the units running when it was saved, outermost first
    stack: tuple[str, ...]
    #: per entry of ``stack``, which call of that unit was running (1 = the first)
    calls: tuple[int, ...]
    #: operators run when it was saved (the saving operator is the one before)
    at: int
    #: timeline index at which backward first read it back; None if never
    unpacked_at: int | None = None


@dataclass(frozen=True)
class Write:
    """An in-place write during forward, inside some unit."""

    #: the units running, outermost first
    stack: tuple[str, ...]
    #: the written storage, when it was created during the step
    storage: int | None
    #: for a storage that existed before the step: ("param" | "buffer" | "input", qualified name)
    preexisting: tuple[str, str] | None
    #: the operator, e.g. "aten.add_.Tensor"
    op: str
    #: the operator's timeline index
    at: int = -1


@dataclass(frozen=True)
class ForwardOp:
    """One operator of the forward (and loss), in order: its timeline index is its position."""

    #: the overload, e.g. "aten.addmm.default"
    name: str
    #: the storages it created, one entry per tensor output (None: an output that is a view or existed)
    created: tuple[int | None, ...]
    #: it draws random numbers (dropout)
    random: bool = False
    #: measured wall time on the real forward (seconds); 0 when unmeasured
    seconds: float = 0.0
    #: named in selective policies (False: the product of a random operator's output, which compile runs
    #: inside that operator: Note [Operators named alike under compile] in remat.rewrite); never kept
    named: bool = True
    #: floating-point operations (torch.utils.flop_counter; attention where it has no formula, causal halved:
    #: remat._compat.op_flops; 0 for operators without one)
    flops: int = 0
    #: bytes it reads and writes in device memory (its tensor arguments and outputs; 0 for views): what the
    #: device model's roofline reads (remat.costs.device_time)
    bytes_accessed: int = 0


# Note [In-operator transients]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An operator may allocate through the caching allocator inside itself, beyond its outputs, and free it before it
# returns: cuDNN's convolution workspaces (7,059,355 bytes at the plain U-Net's peak on the H200, inside
# ``convolution_backward`` on autograd's thread), cuBLASLt's where it does not share cuBLAS's. No dispatch-level
# recorder sees those blocks; the allocator does. On a real CUDA recording the recorder reads the allocator's peak
# inside each operator (its peak statistic reset before the operator, read after: host-side counters updated at
# malloc time, no synchronisation) and keeps, per timeline index, what the operator held above what it left
# allocated (``transient_bytes``). The memory model adds it at that operator's instant, in the timeline every row is
# read from: ``live_bytes[i] + transient_bytes[i]`` is the allocator's peak inside operator ``i`` on the recording's
# count, so a plan whose peak is such an instant is predicted with the workspace, and a recomputation that runs the
# operator again (its growth read from the same timeline) holds it again. ``before_bytes`` (what is alive before an
# operator) leaves it out. What a library keeps after the operator (cuBLAS's workspace, made at a thread's first
# product and held for the process's life) is not a transient: the profile counts it all step long
# (``Profile.workspace_bytes``, Note [The budget on CUDA is absolute] in remat.costs.allocator_reading).


def _frozen(d: Mapping) -> Mapping:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class Recording:
    """Everything one recorded step tells about memory, by timeline index."""

    #: operators recorded (forward, loss, backward): the timeline's length
    n_ops: int
    #: timeline index of the first backward operator
    backward_start: int
    #: bytes allocated during the step still alive once backward returned (Note [Loop style])
    after_backward_bytes: int
    storages: tuple[Storage, ...]
    saved: tuple[SavedTensor, ...]
    forward_ops: tuple[ForwardOp, ...]
    writes: tuple[Write, ...]
    #: per unit, the forward span (first, last timeline index) of each of its calls, in call order
    spans: Mapping[str, tuple[tuple[int, int], ...]]
    #: per unit, how many times its forward ran during the whole step (backward included)
    calls: Mapping[str, int]
    #: per unit and forward call, the storages it took as inputs
    inputs: Mapping[str, tuple[tuple[int, ...], ...]]
    #: per storage, the last forward operator that read it
    last_use: Mapping[int, int]
    #: per unit, floating-point operations of its forward (torch.utils.flop_counter)
    flops: Mapping[str, int]
    #: the backward's operators, in order (name, FLOPs and bytes; ``created`` empty): what a device model times
    backward_ops: tuple[ForwardOp, ...] = ()
    #: per timeline index, the bytes the operator held inside itself above what it left allocated (a library's
    #: workspace: Note [In-operator transients]); empty where not read (CPU, fake tensors)
    transient_bytes: Mapping[int, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("spans", "calls", "inputs", "last_use", "flops", "transient_bytes"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    # -- derived timelines -----------------------------------------------------------------
    def timeline(self, only: Collection[int] | None = None) -> tuple[int, ...]:
        """Bytes alive after each operator, of the storages in ``only``; by default all of them, each operator's
        in-operator transient added at its own index (Note [In-operator transients])."""
        out = self._storage_timeline(only)
        if only is not None or not self.transient_bytes:
            return out
        return tuple(v + self.transient_bytes.get(i, 0) for i, v in enumerate(out))

    def _storage_timeline(self, only: Collection[int] | None = None) -> tuple[int, ...]:
        n = self.n_ops
        diff = [0] * (n + 1)
        for i, s in enumerate(self.storages):
            if (only is not None and i not in only) or s.alloc_index >= n:
                continue
            diff[s.alloc_index] += s.nbytes
            diff[min(s.free_index if s.free_index is not None else n, n)] -= s.nbytes
        out, acc = [], 0
        for i in range(n):
            acc += diff[i]
            out.append(acc)
        return tuple(out)

    def before_bytes(self) -> tuple[int, ...]:
        """Note [Between operators]: what is alive just before each operator runs: the live bytes after
        it, less what it allocated (frees between two operators count against the earlier one)."""
        made = [0] * self.n_ops
        for s in self.storages:
            if s.alloc_index < self.n_ops:
                made[s.alloc_index] += s.nbytes
        return tuple(max(v - a, 0) for v, a in zip(self._storage_timeline(), made))

    def saved_timeline(self) -> tuple[int, ...]:
        """Bytes alive after each operator of storages autograd saved for backward."""
        return self.timeline({t.storage for t in self.saved if t.storage is not None})

    def grad_timeline(self) -> tuple[int, ...]:
        """Bytes alive after each operator of parameter gradients."""
        return self.timeline({i for i, s in enumerate(self.storages) if s.is_grad})

    def first_span(self, unit: str) -> tuple[int, int]:
        return self.spans[unit][0]

    def created_by(self) -> dict[int, int]:
        """Storage -> the forward operator (timeline index) that created it."""
        return {s: i for i, op in enumerate(self.forward_ops) for s in op.created if s is not None}

    def op_names(self, start: int, end: int) -> dict[int, str]:
        """The forward operators ``start..end`` of a unit's call by timeline index, named as a selective policy
        names them: the overload and its count among the call's named operators (``aten.addmm.default#1``;
        Note [Operators named alike under compile] in remat.rewrite.policy)."""
        seen: dict[str, int] = {}
        out = {}
        for i in range(start, min(end, len(self.forward_ops) - 1) + 1):
            op = self.forward_ops[i]
            if op.named:
                out[i] = op_key(op.name, seen.get(op.name, 0))
                seen[op.name] = seen.get(op.name, 0) + 1
        return out

    # -- corrections (new Recordings; this one is unchanged) ---------------------------------
    def with_sizes(self, nbytes: Mapping[int, int]) -> "Recording":
        """The same recording with the sizes of some storages replaced (Note [Fake sizes])."""
        storages = tuple(dataclasses.replace(s, nbytes=nbytes[i]) if i in nbytes else s
                         for i, s in enumerate(self.storages))
        return dataclasses.replace(self, storages=storages)

    def with_op_seconds(self, seconds: Mapping[int, float]) -> "Recording":
        """The same recording with measured times for some forward operators."""
        ops = tuple(dataclasses.replace(op, seconds=seconds[i]) if i in seconds else op
                    for i, op in enumerate(self.forward_ops))
        return dataclasses.replace(self, forward_ops=ops)


@dataclass(frozen=True)
class UnitTimes:
    """What real, timed steps measured per module (``remat.profile.timing``), in seconds."""

    #: per module, its forward time (summed over its forward calls)
    forward_s: Mapping[str, float]
    #: per module checkpointed while timing, its recomputation time in backward
    recompute_s: Mapping[str, float]
    #: per module, time from the gradient reaching its output to reaching its input (CPU only)
    backward_s: Mapping[str, float]
    #: per module, the buffers (names relative to it) whose values its first forward changed
    mutated_buffers: Mapping[str, tuple[str, ...]]
    #: the whole step's forward and backward, timed without hooks
    step_forward_s: float
    step_backward_s: float

    def __post_init__(self) -> None:
        for name in ("forward_s", "recompute_s", "backward_s", "mutated_buffers"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))


@dataclass(frozen=True)
class CheckpointOverhead:
    """torch.utils.checkpoint's own bookkeeping, measured on this machine (Note [Checkpoint overhead]
    in ``remat.profile.timing``), in seconds."""

    per_call_s: float
    per_saved_tensor_s: float
    #: what a selective policy adds per operator of the unit
    per_selective_op_s: float
    #: bytes on the device each checkpointed call holds outside the dispatcher until its recomputation: the
    #: CPU RNG state (5 KB) when the device is the CPU (on CUDA the saved RNG states live in host memory)
    held_bytes: int = 0


# Note [Twins share their times]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Identical blocks (a transformer's layers) measure a few percent apart from run to run, so a solver
# reading raw times picks `layers.6` in one run and `layers.1` in the next for the same budget, and the
# same model, batch and budget did not give the same plan (seen under the Hugging Face Trainer). Modules
# whose forwards run the same operators creating the same bytes, call for call, are twins: each gets the
# median of its twins' measured times, per module and per operator at the same position, so twins cost
# exactly alike and the solver's choice among them does not depend on noise. What differs between
# twins (nothing, by construction) is not averaged away.


def twin_groups(rec: Recording, modules: Sequence[str]) -> list[list[str]]:
    """Groups of two or more of ``modules`` whose recorded forwards are the same operators creating the
    same bytes, call for call (Note [Twins share their times])."""
    groups: dict[tuple, list[str]] = {}
    seen: set[tuple] = set()
    for m in modules:
        spans = rec.spans.get(m, ())
        if not spans or spans in seen:  # a wrapper and its only child run the same operators: not twins
            continue
        seen.add(spans)
        sig = tuple(tuple((rec.forward_ops[i].name, tuple(-1 if s is None else rec.storages[s].nbytes
                                                           for s in rec.forward_ops[i].created))
                          for i in range(a, b + 1) if i < len(rec.forward_ops)) for a, b in spans)
        groups.setdefault(sig, []).append(m)
    return [g for g in groups.values() if len(g) > 1]


def shared_by_twins(rec: Recording, times: UnitTimes, modules: Sequence[str]) -> tuple[Recording, UnitTimes]:
    """``rec``'s operator seconds and ``times``' per-module times with every group of twins among
    ``modules`` given its median (Note [Twins share their times])."""
    seconds: dict[int, float] = {}
    per = {k: dict(getattr(times, k)) for k in ("forward_s", "recompute_s", "backward_s")}
    for group in twin_groups(rec, modules):
        starts = [[a for a, _ in rec.spans[m]] for m in group]
        length = [b - a + 1 for a, b in rec.spans[group[0]]]
        for call, n in enumerate(length):
            for k in range(n):
                idx = [s[call] + k for s in starts]
                mid = statistics.median(rec.forward_ops[i].seconds for i in idx)
                seconds.update({i: mid for i in idx})
        for table in per.values():
            have = [table[m] for m in group if m in table]
            if len(have) == len(group):
                table.update(dict.fromkeys(group, statistics.median(have)))
    return rec.with_op_seconds(seconds), dataclasses.replace(times, **per)


def recompute_growth(live: Sequence[int], start: int, end: int,
                     freed_outside: Sequence[tuple[int, int]]) -> list[int]:
    """Bytes a recomputation of forward operators ``start..end`` holds after each of them, over what was alive
    before it: the plain forward's growth ``live[t] - live[start - 1]``, with the older storages that forward
    freed meanwhile (``freed_outside``: (index, bytes)) added back, since a recomputation frees none of them
    (Note [Growth of a recomputation] in remat.costs.effects)."""
    base = live[start - 1] if start > 0 else 0
    back = [0] * (end - start + 1)
    for f, b in freed_outside:
        back[f - start] += b
    out, acc = [], 0
    for t in range(start, end + 1):
        acc += back[t - start]
        out.append(live[t] - base + acc)
    return out
