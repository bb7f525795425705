"""Distributed training: one plan for every rank, under FSDP2 (``fully_shard``) or DDP.

Note [One plan for every rank]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under FSDP2 every recomputation of a unit re-runs its forward where parameters are gathered; ranks
that checkpoint different units run different collectives in different orders (a hang), and under any
data parallelism the slowest rank sets the pace. So remat is called on every rank, on the model as it
will train (after ``fully_shard`` or inside ``DistributedDataParallel``), and:

* each rank profiles its own step (its shard, its batch) for real: the per-rank memory of sharded
  parameters, all-gathered (unsharded) parameters, gradients and reduce-scatter buffers is what its
  recording sees (Note [Sharded tensors] in remat.runtime.tracker);
* the profiles are gathered; every rank's memory rows constrain one ILP (the per-rank budget holds on
  the worst rank), a unit's cost is its largest over ranks (``remat.costs.simulate.WorstRankModel``);
* every plan is rank 0's, broadcast; a checked step's peak is the largest over ranks; so every decision
  is taken on numbers all ranks share, and all ranks run the same steps in the same order.

Note [Collectives with a deadline]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Before its first collective, remat meets every rank on the process group's store with a deadline
(``timeout_s``) and compares how each rank's model is wrapped: a rank that does not call remat, or
calls it on a model wrapped differently, is a clear error on every rank that can see it, not a hang.
Each meeting ends in one verdict on the store ("met" or "failed", set once with ``compare_set``), so a
rank whose calls have fallen out of step with another's (it skipped a call the other gave up on) stops
with an error at its next call instead of meeting the abandoned one and waiting in a collective.

Note [Steps under gloo]
~~~~~~~~~~~~~~~~~~~~~~~
On CPU a tensor-parallel model (alone, or with FSDP2 on a 2-D mesh) runs its collectives through gloo, and
one step's peak is not the next one's: a collective's work object keeps
references to its input and output buffers, and whichever thread drops the last one frees them, the
caller's or one of gloo's own, sometimes many operators after the caller has moved on (seen in the
allocator's events: in a step that read 24% above another, a matmul output and an all_gather buffer were
freed by a gloo thread after the peak, where the caller freed them long before it in the other), so
buffers the caller no longer uses are allocated at its peak in some steps and not in others. Gloo also
allocates on its own threads (an all_gather's output-sized buffer), which no dispatch mode sees. Measured on
the tests' Llama-style decoder under sequence parallelism (2 ranks on 2 cores, 8 x 128 tokens, both layers
checkpointed): 16 identical steps read 5.67-8.55 MB by the profiler's allocator-level events, and 5.93 MB in
13 of them (up to 6.33 MB) at dispatch level; without sequence parallelism 6.29-6.82 MB against 6.30 MB
every time. So such a check reads CHECKED_STEPS steps by the allocator's events and keeps the largest, as the
user's steps will reach it; it is not a bound on every step (docs/limits.md gives the spread). On CUDA the
allocator meters every check already. FSDP2 alone and DDP keep one dispatch-level step: DDP's gradient
buckets, made before the step, are found there (Note [Memory found] in remat.runtime.tracker), and FSDP2's steps,
whose collectives' buffers the dispatch-level meter follows (its storage resizes), read alike by the
allocator in benchmarks/distributed/distributed.py for three rules of four (the least within 0.02 MiB of torch's
FSDPMemTracker; every block 27.53-28.29 MiB), while three of its
allocator-level steps read up to 3.4% apart on the tests' GPT when the machine was busy (a CI run with a
second test process), above the 2% a test budget leaves over its least peak. A compiled step in a process group,
which only the allocator's events see, is read on CHECKED_STEPS steps too (gloo's scratch, on its threads and its
copies of a reduce-scatter's input on the step's, is not counted: Note [The step's threads] in
remat._compat.profiler; counted, the tests' compiled FSDP2 GPT read the root's 82,432-byte copy more in some steps).

Note [Collectives settled]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Where a dispatch mode sees a functional collective (``_c10d_functional``: tensor parallelism's redistributions) on
CPU tensors, it can take those late frees out of the step: :func:`settled_collective` waits for the collective
where it is issued, then until gloo's worker thread has dropped the work (the use counts of the collective's
tensors back to what they were), so a tensor the caller drops is freed where it drops it, on its thread, every
step alike. remat's dispatch-level tracker does so when it meters memory, not time (its recorded real step, its
dispatch-level checks: Note [Storages without memory] in remat.runtime.tracker), and so do the tests' meters. On
the tests' sequence-parallel decoder (2 ranks on 2 cores) waiting for gloo's thread took 12-18 ms in all over
168-210 collectives, at most 2.2 ms for one; settled, eight steps by MemTracker read one peak, where unsettled one
reading in sixteen was 180,224 bytes above the others. A settled collective is no longer overlapped with the
operators that follow it: tracked steps took 0.18-0.24 s settled, 0.13-0.22 s not, which is why timed steps are
not settled. Not settled: ``torch.distributed``'s own collectives (FSDP2's), and the allocator-level checks of a
tensor-parallel model (no dispatch mode), whose events also miss the frees gloo's thread makes when it drops a
work (the profiler reports a free only on a thread it profiles): on that decoder they kept 1,902,556-1,968,092
bytes, the largest of three steps, for a plan whose settled steps read 1,869,788.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from remat._compat.distributed import use_counts
from remat._compat import default_store, fsdp_modules, tree_flatten
from remat.errors import InternalError, InvalidInputError

T = TypeVar("T")
log = logging.getLogger(__name__)

#: seconds remat waits for every rank at its first collective (Note [Collectives with a deadline])
DEFAULT_TIMEOUT_S = 300.0
#: steps a check of a tensor-parallel model on CPU reads, keeping the largest (Note [Steps under gloo])
CHECKED_STEPS = 3
#: seconds a settled collective waits for gloo's thread to drop its work; past that, collectives are no longer
#: settled in this process (Note [Collectives settled])
SETTLE_TIMEOUT_S = 5.0
_settling = True

_calls = itertools.count()


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


@dataclass(frozen=True)
class Wrapping:
    """How a model is wrapped for distributed training, as remat plans for it."""

    #: processes in the default group (1 without torch.distributed)
    world_size: int = 1
    #: "none", "ddp", "fsdp2" or "tp" (parameters are DTensors: tensor parallel, ``parallelize_module``)
    kind: str = "none"
    #: for FSDP2: every module ``fully_shard`` manages (qualified name) and whether it reshards after forward
    fsdp: tuple[tuple[str, bool], ...] = ()
    #: the device mesh of the parameters' DTensors, as "tp=2" or "dp=2 x tp=2" ("" when none are DTensors)
    mesh: str = ""

    def __str__(self) -> str:
        two_d = f", on a {self.mesh} mesh" if "x" in self.mesh else ""
        if self.kind == "fsdp2":
            reshard = sorted({r for _, r in self.fsdp})
            how = "/".join("reshard_after_forward=" + str(r) for r in reshard)
            return f"FSDP2 over {self.world_size} ranks ({len(self.fsdp)} sharded modules, {how}{two_d})"
        if self.kind == "ddp":
            return f"DDP over {self.world_size} ranks"
        if self.kind == "tp":
            return f"tensor parallel over {self.world_size} ranks (mesh {self.mesh})"
        return "one process" if self.world_size == 1 else f"not wrapped, {self.world_size} ranks"


def wrapping_of(model: nn.Module) -> Wrapping:
    """How ``model`` is wrapped: DistributedDataParallel, FSDP2 (``fully_shard``), or neither."""
    dist = _dist()
    world = dist.get_world_size() if dist is not None else 1
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return Wrapping(world, "ddp")
    mesh = _mesh_of(model)
    fsdp = tuple(fsdp_modules(model))
    if fsdp:
        return Wrapping(world, "fsdp2", fsdp, mesh)
    if mesh:
        return Wrapping(world, "tp", mesh=mesh)
    return Wrapping(world)


def steps_checked(model: nn.Module, device: torch.device, *, compiled: bool = False) -> int:
    """How many steps a check of ``model`` on ``device`` reads by the allocator's events, keeping the largest
    (Note [Steps under gloo]): CHECKED_STEPS for a tensor-parallel model on CPU (alone or on a 2-D mesh with
    FSDP2), or a ``compiled`` step (read by the allocator's events anyway), in a process group; 0 where one
    dispatch-level reading serves (FSDP2 alone, DDP; CUDA checks are the allocator's anyway)."""
    if torch.device(device).type != "cpu" or _dist() is None:
        return 0
    wrapping = wrapping_of(model)
    return CHECKED_STEPS if compiled or wrapping.kind == "tp" or " x " in wrapping.mesh else 0


def is_functional_collective(func: Any) -> bool:
    """Whether ``func`` (an operator) is a functional collective, not its wait or its wrapper."""
    return getattr(func, "namespace", None) == "_c10d_functional" and \
        func.__name__.split(".")[0] not in ("wait_tensor", "_wrap_tensor_autograd")


def settled_collective(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)``, a functional collective (:func:`is_functional_collective`) on real CPU tensors,
    waited for, and returned once gloo's worker thread has dropped its work (Note [Collectives settled]). Any other
    call, or any call once a wait timed out (SETTLE_TIMEOUT_S), runs as it is."""
    global _settling
    if not (_settling and is_functional_collective(func)):
        return func(*args, **kwargs)
    tensors = _tensor_leaves((args, kwargs))
    if not (tensors and all(type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" for t in tensors)):
        return func(*args, **kwargs)
    before = [(t, use_counts(t)) for t in tensors]
    out = func(*args, **kwargs)
    made = _tensor_leaves(out)
    for t in made:
        torch.ops._c10d_functional.wait_tensor.default(t)
    inputs = {id(t) for t in tensors}
    one = _one_holder()
    waiting = before + [(t, one) for t in made if id(t) not in inputs]
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while any(h > b for t, held in waiting for h, b in zip(use_counts(t), held)):
        if time.monotonic() > deadline:
            _settling = False
            log.warning(
                "a collective's work was still held %.0f s after it finished (%s): collectives are no longer "
                "settled in this process (Note [Collectives settled] in remat.runtime.distributed)",
                SETTLE_TIMEOUT_S, func)
            break
        time.sleep(1e-4)
    return out


def _tensor_leaves(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


_ONE: tuple[int, int] | None = None


def _one_holder() -> tuple[int, int]:
    """``use_counts`` of a tensor held once, with no view of its storage: what a collective's fresh output reads
    once the work is gone."""
    global _ONE
    if _ONE is None:
        _ONE = use_counts(torch.empty(0))
    return _ONE


def _mesh_of(model: nn.Module) -> str:
    """The largest device mesh among the parameters' DTensors, as "tp=2" or "dp=2 x tp=2"."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return ""
    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    if not meshes:
        return ""
    mesh = max(meshes, key=lambda m: m.ndim)
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return " x ".join(f"{n}={k}" for n, k in zip(names, mesh.shape))


class Ranks:
    """remat's collectives over the default process group, on a rank that called remat (Note [One plan for
    every rank]). ``None`` stands for one process: :func:`ranks_for` returns None outside torch.distributed."""

    def __init__(self, wrapping: Wrapping, timeout_s: float, same: dict[str, Any] | None = None) -> None:
        dist = _dist()
        if dist is None:
            raise InternalError("Ranks made outside torch.distributed (ranks_for returns None there)", stage="check")
        self.dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout_s = timeout_s
        self.tag = f"remat/{next(_calls)}"
        self._meet(wrapping, same or {})

    def _meet(self, wrapping: Wrapping, same: dict[str, Any]) -> None:
        """Note [Collectives with a deadline]. ``same``: arguments every rank must pass alike (the budget...)."""
        store = default_store()
        store.set(f"{self.tag}/rank{self.rank}", "1")
        count = store.add(f"{self.tag}/arrived", 1)
        deadline = time.monotonic() + self.timeout_s
        state_key, waited_out = f"{self.tag}/state", False
        # one verdict per call, set once for every rank (compare_set): "met" when all arrived, "failed" when a
        # rank's deadline passed first. A rank arriving after another gave up finds "failed" and stops too: the
        # per-process call counter of a rank that gave up is one ahead, and without the verdict a later call of
        # the other rank would have met that stale arrival and waited in a collective for ever
        while True:
            if count >= self.world_size:
                state = store.compare_set(state_key, "", "met")
                break
            if store.check([state_key]):
                state = store.get(state_key)
                break
            if time.monotonic() > deadline:
                state = store.compare_set(state_key, "", "failed")
                waited_out = True
                break
            time.sleep(0.01)
            count = store.add(f"{self.tag}/arrived", 0)
        if state == b"failed" and waited_out:
            missing = [r for r in range(self.world_size) if not store.check([f"{self.tag}/rank{r}"])]
            raise InvalidInputError(
                f"remat was called on rank {self.rank} but rank(s) {missing} of {self.world_size} did not call "
                f"it within {self.timeout_s:g} s (call {self.tag}): call optimize_checkpointing (or apply_plan) "
                "on every rank, with the same arguments, in the same order (or raise timeout_s)"
            )
        if state == b"failed":
            raise InvalidInputError(
                f"another rank gave up waiting for this rank at remat's call {self.tag} (its timeout_s passed): "
                "the ranks' calls of remat are out of step; call optimize_checkpointing (or apply_plan) on every "
                "rank, with the same arguments, in the same order"
            )
        seen = self.gather((wrapping, same))
        if any(w != seen[0][0] for w, _ in seen):
            lines = "; ".join(f"rank {r}: {w}" for r, (w, _) in enumerate(seen))
            raise InvalidInputError(
                f"the model is wrapped differently on different ranks ({lines}): remat makes one plan for every "
                "rank, so wrap the model the same way everywhere (the same fully_shard calls and "
                "reshard_after_forward, or DDP on every rank)"
            )
        for key in same:
            values = [s.get(key) for _, s in seen]
            if any(v != values[0] for v in values):
                raise InvalidInputError(
                    f"{key} differs between ranks ({', '.join(f'rank {r}: {v!r}' for r, v in enumerate(values))}): "
                    f"remat makes one plan for every rank; pass the same {key} on every rank"
                )

    def gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order."""
        out: list[Any] = [None] * self.world_size
        self.dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def max(self, n: int) -> int:
        """The largest ``n`` over ranks."""
        return max(self.gather(n))


def ranks_for(model: nn.Module, timeout_s: float | None = None,
              same: dict[str, Any] | None = None) -> tuple[Wrapping, Ranks | None]:
    """The model's wrapping and, when several processes train it, the collectives remat uses (meeting
    every rank first: Note [Collectives with a deadline]; ``same``: arguments that must agree across ranks)."""
    wrapping = wrapping_of(model)
    if wrapping.world_size == 1:
        return wrapping, None
    return wrapping, Ranks(wrapping, DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s, same)
