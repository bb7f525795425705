"""Offloaded units: a module's saved activations moved to host memory during its forward and brought back for
its backward (issue #50; part of :mod:`remat.rewrite`).

Note [Offloaded units]
~~~~~~~~~~~~~~~~~~~~~~
An offloaded unit runs its forward under :class:`torch.autograd.graph.saved_tensors_hooks` (the mechanism of
torch's ``save_on_cpu``, torchtune's and TRL's ``OffloadActivations``): every tensor an operator inside it saves
for backward passes through :meth:`Offloader.pack`, which copies it into a host buffer and lets the device's copy
go, and comes back through :meth:`Offloader.unpack` when backward needs it. Nothing is recomputed, so no random
number is drawn again: the gradients are the plain step's, bitwise (the same bytes come back, with the same
shape, dtype and strides).

What moves is a saved tensor's whole **storage**, once however many saved tensors view it (attention's q, k
and v are views of one projection's output: moving the views alone would leave that output on the device), and
each saved tensor comes back as the same view of the storage brought back (same shape, strides and offset).
What stays where it is (returned by ``pack`` as it is): storages under ``MIN_OFFLOAD_BYTES`` (64 KiB: their copy
costs more than they free), parameters and tensor subclasses, and the storages of the unit's inputs,
parameters and buffers (alive anyway); a storage its outputs turn out to hold is read where it is in backward
(:meth:`Offloader.keep_outputs`: it lives on after the unit, so bringing a copy back would hold it twice).

Host buffers come from a :class:`~remat.runtime.host_copies.HostPool` that keeps them across steps, by size class (a
power of two of at least 64 KiB): after the first step no host memory is allocated (one fresh pinned allocation per
tensor costs milliseconds on a GPU host, the complaint offloaders' users make). On a GPU the buffers are pinned and
the copies run on a side stream (:class:`remat.runtime.host_copies.CudaCopies`: what is CUDA-specific is there); on
this machine's CPU the copies are plain ``copy_`` calls: the device *is* host memory, so offloading frees nothing
here, and the pool is what tests count (docs/offload.md says what is measured then and what is not).

Note [Pinned at first run]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Pinned buffers and a side stream are a property of where a unit *runs*, not of where the plan was applied.
torchtitan (and docs/targets.md's first flow) applies a plan to the model on the meta device, then FSDP2, then
materializes it on the GPU: an offloader that decided from the first parameter's device when the plan was applied
saw ``meta``, took pageable buffers and no side stream, and on an H200 every copy was synchronous and pageable
(``Memcpy DtoH (Device -> Pageable)`` 14.0 GB/s, ``HtoD (Pageable -> Device)`` 6.95 GB/s: 1,118-1,190 ms a step
against 447-451 with the plan applied after materializing; shared/gpu/README.md). So nothing is decided when the
plan is applied: at each unit's first pack, :func:`copy_path` decides from the device of the tensor it saves
(pinned buffers and a side stream on CUDA, plain copies on the CPU, nothing moved from ``meta``), and the model's
:class:`Offloader` builds that path once per device (``Offloader.decided`` records each unit's). A GPU's copies
never come from pageable memory. A model moved to another device between steps gets a new path; moved in the
middle of a step (buffers still lent) it is refused.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from remat._compat import storage_key, storage_ref
from remat.costs.offload import MIN_OFFLOAD_BYTES
from remat.errors import InternalError
from remat.rewrite.forwards import _RematForward
from remat.runtime.host_copies import CopyPath, HostPool, copy_path, side_stream

def _device_of(t: torch.Tensor) -> torch.device:
    """The device a saved tensor is on, as :func:`copy_path` decides from it (the seam tests replace to decide
    for a CUDA tensor on a CPU build)."""
    return t.device


class _Parked:
    """A saved tensor's storage in host memory, parked once however many saved tensors view it: the host buffer,
    the storage's bytes and device; ``uses``: the saves of it not yet unpacked."""

    __slots__ = ("buf", "nbytes", "device", "ready", "uses", "live", "pool", "key", "storage", "__weakref__")

    def __init__(self, buf: torch.Tensor | None, nbytes: int, device: torch.device, pool: HostPool) -> None:
        self.buf, self.nbytes, self.device, self.pool = buf, nbytes, device, pool
        #: the device storage's key and a weak reference to it (dead once the device copy is gone)
        self.key: int | None = None
        self.storage: weakref.ref | None = None
        #: the storage brought back (uint8, ahead of its use or at it), or None
        self.ready: torch.Tensor | None = None
        self.uses = 0
        #: False once its last save was unpacked (a later unpack is a second backward)
        self.live = True

    def __del__(self) -> None:  # a forward whose backward never ran: its buffers go back to the pool
        if self.buf is not None:
            self.pool.give(self.buf)
            self.buf = None


class _Saved:
    """What ``pack`` returns for an offloaded tensor: its parked storage and where in it the tensor lies."""

    __slots__ = ("parked", "dtype", "size", "stride", "offset")

    def __init__(self, parked: _Parked, t: torch.Tensor) -> None:
        self.parked, self.dtype, self.size, self.stride, self.offset = (
            parked, t.dtype, t.shape, t.stride(), t.storage_offset())


def offloadable(t: torch.Tensor, keep: frozenset[int] = frozenset(), min_bytes: int = MIN_OFFLOAD_BYTES,
                plain: tuple[type, ...] = (torch.Tensor,)) -> bool:
    """Whether ``pack`` moves ``t``'s storage to host memory (Note [Offloaded units]): a strided tensor (of a type
    in ``plain``: not a subclass, not a parameter) whose storage holds at least ``min_bytes`` and is not in
    ``keep`` (the unit's inputs, parameters and buffers: alive anyway). A view is parked with its storage and comes
    back as the same view of it."""
    return (type(t) in plain and t.layout == torch.strided and t.untyped_storage().nbytes() >= min_bytes
            and t.untyped_storage().nbytes() % t.element_size() == 0 and storage_key(t) not in keep)


class Offloader:
    """The pack and unpack hooks of offloaded units, one per model, shared by its units (so that a unit's
    backward can bring the next unit's tensors back ahead of their use: :meth:`prefetch`)."""

    def __init__(self, pool: HostPool | None = None, *, min_bytes: int = MIN_OFFLOAD_BYTES,
                 copies: Any = None, modelled: bool = False) -> None:
        self.pool = pool or HostPool()
        self.min_bytes = min_bytes
        #: on fake tensors (a modelled target's recorded step): nothing is copied, the device tensor goes and an
        #: empty one of its shape comes back, so the recording sees the device memory offloading frees
        self.modelled = modelled
        self._plain: tuple[type, ...] = (torch.Tensor,)
        if modelled:
            from remat._compat import FakeTensor

            self._plain = (torch.Tensor, FakeTensor)
        #: the device-specific copies (remat.runtime.host_copies.CudaCopies); None: synchronous copy_ (a CPU)
        self.copies = copies
        #: how copies run now (Note [Pinned at first run]): None until a unit first saves a tensor, unless the
        #: caller fixed it by giving ``pool`` or ``copies``
        self.path: CopyPath | None = None
        self._path_device: torch.device | None = None
        if pool is not None or copies is not None:
            self.path = CopyPath("given", pinned=self.pool.pin_memory, side_stream=copies is not None)
        self._fixed = self.path is not None
        #: per unit, the path its first saved tensor was copied by (Note [Pinned at first run])
        self.decided: dict[str, CopyPath] = {}
        self._seen: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        #: per unit, in forward order, the tensors it parked this step (for prefetching)
        self.parked: dict[str, list[weakref.ref]] = {}
        #: per offloaded unit, the offloaded unit run right before it at its level, whose storages its backward
        #: starts bringing back (Note [Exposed copies] in remat.costs.offload: the plan's ``offload_ahead``); set by
        #: :func:`offload_modules`
        self.ahead: dict[str, str] = {}
        #: bytes copied out, in all, and tensors parked
        self.offloaded_bytes = 0
        self.offloaded_tensors = 0

    def hooks(self, unit: str, keep: frozenset[int], only: Any = None) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks to run ``unit``'s forward under; ``keep``: storages (``storage_key``) not to move; ``only``:
        for a part (Note [Offloaded parts] in remat.costs.offload), a pair of the operators whose outputs move and
        the :class:`~remat.rewrite.policy.OutputNames` naming the call's storages."""
        if unit in self.parked and not any(r() is not None for r in self.parked[unit]):
            del self.parked[unit]  # a new step: the unit takes its place in this step's forward order
        self.parked.setdefault(unit, [])
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(unit, t, keep, only),
                                                        lambda p: self.unpack(unit, p))

    def pack(self, unit: str, t: torch.Tensor, keep: frozenset[int] = frozenset(), only: Any = None) -> Any:
        if not offloadable(t, keep, self.min_bytes, self._plain):
            return t
        if only is not None and only[1].name_of(t) not in only[0]:
            return t  # a part: another operator's output stays on the device
        if t.device.type == "meta" and not self.modelled:
            return t  # a forward on the meta device (before materializing): no data to move
        if not self.modelled:
            self._path_for(unit, _device_of(t))
        key = storage_key(t)
        seen = self._seen.get(key)
        parked = seen[1]() if seen is not None and seen[0]() is not None else None
        if parked is not None and parked.live and parked.ready is None:
            parked.uses += 1
            return _Saved(parked, t)
        nbytes = t.untyped_storage().nbytes()
        if self.modelled:  # nothing is copied: the device storage goes, an empty one comes back
            parked = _Parked(None, nbytes, t.device, self.pool)
        else:
            buf = self.pool.take(nbytes)
            source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            if self.copies is not None:
                self.copies.to_host(buf[:nbytes], source)
            else:
                buf[:nbytes].copy_(source)
            parked = _Parked(buf, nbytes, t.device, self.pool)
        parked.uses, parked.key, parked.storage = 1, key, storage_ref(t)
        self._seen[key] = (parked.storage, weakref.ref(parked))
        self.parked.setdefault(unit, []).append(weakref.ref(parked))
        self.offloaded_bytes += nbytes
        self.offloaded_tensors += 1
        return _Saved(parked, t)

    def _path_for(self, unit: str, device: torch.device) -> CopyPath:
        """The copy path for a tensor ``unit`` saves on ``device``, decided at the first one and again when the
        model has moved (Note [Pinned at first run]); records ``unit``'s first."""
        if not self._fixed and device != self._path_device:
            path = copy_path(device)
            if self._path_device is not None and self.pool.in_use_bytes:
                from remat.errors import UnsupportedError

                raise UnsupportedError(
                    f"offloaded unit {unit!r} saved a tensor on {device} while {self.pool.in_use_bytes:,} bytes "
                    f"offloaded from {self._path_device} in this step had not come back: move the model between "
                    "steps, not during one")
            if path.pinned != self.pool.pin_memory:
                self.pool.release()  # the free buffers of the other kind go; the next ones are of this kind
                self.pool.pin_memory = path.pinned
            self.copies = side_stream(device) if path.side_stream else None
            self.path, self._path_device = path, device
        if self.path is None:
            raise InternalError("the offloader's copy path is undecided after deciding it")
        self.decided.setdefault(unit, self.path)
        return self.path

    def unpack(self, unit: str, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        packed = saved.parked
        if packed.ready is None:
            if not packed.live:
                from remat.errors import UnsupportedError

                raise UnsupportedError(
                    f"an activation of offloaded unit {unit!r} was unpacked after its backward had used it (a "
                    "second backward through the same graph, retain_graph=True, or a saved tensor read by hand): "
                    "offloaded units bring each saved tensor back once. Checkpoint that unit instead of "
                    "offloading it, or run one backward per forward")
            self.prefetch(unit)
        storage = packed.ready
        if self.copies is not None:
            self.copies.wait(storage)
        out = storage.view(saved.dtype).as_strided(saved.size, saved.stride, saved.offset)
        packed.uses -= 1
        if packed.uses == 0:  # its last use: the device copy goes with autograd's, the buffer back to the pool
            packed.ready, packed.live = None, False
            buf, packed.buf = packed.buf, None
            if buf is not None and self.copies is not None:
                self.copies.after(storage, lambda: self.pool.give(buf))
            elif buf is not None:
                self.pool.give(buf)
        return out

    def keep_outputs(self, unit: str, first: int, outputs: Any) -> None:
        """Storages ``unit`` parked (from its ``first``-th on) that its outputs hold: the device keeps them anyway
        (they live on after the unit, as the memory model's drops leave them), so backward reads them there and
        their host buffers go back to the pool."""
        held: dict[int, torch.Tensor] = {}
        for t in _tensors(outputs):
            if t.layout == torch.strided and type(t) in self._plain:
                held[storage_key(t)] = t
        if not held:
            return
        for ref in self.parked.get(unit, [])[first:]:
            p = ref()
            # its storage's key, while that storage lives (a dead one's address may be an output's now)
            key = p.key if p is not None and p.storage is not None and p.storage() is not None else None
            if key in held and p.ready is None and p.live:
                p.ready = torch.empty(0, dtype=torch.uint8, device=p.device).set_(held[key].untyped_storage())
                buf, p.buf = p.buf, None
                if buf is not None and self.copies is not None:  # once its copy out, still running, is done
                    self.copies.after(p.ready, lambda buf=buf: self.pool.give(buf))
                elif buf is not None:
                    self.pool.give(buf)

    def prefetch(self, unit: str) -> None:
        """Bring ``unit``'s parked storages back to the device, and start bringing back those of the offloaded
        unit run right before it (``ahead``, as the plan paired them: its backward runs next; one unit ahead). Only that one: a unit kept or
        recomputed in between would have them back while its own backward runs, which the memory model does not
        count (Note [Offload in the memory model]). ``unit``'s own first: its backward waits for
        them, and the side stream runs copies in the order they are issued."""
        for name in (unit, self.ahead.get(unit)):
            if name is None or name not in self.parked:
                continue
            for ref in self.parked[name]:
                p = ref()
                if p is not None and p.ready is None and p.live:
                    p.ready = torch.empty(p.nbytes, dtype=torch.uint8, device=p.device)
                    if self.modelled:
                        continue
                    if self.copies is not None:
                        self.copies.to_device(p.ready, p.buf[:p.nbytes])
                    else:
                        p.ready.copy_(p.buf[:p.nbytes])


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


def _storages(obj: Any, out: set[int]) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided:
            out.add(storage_key(obj))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _storages(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _storages(x, out)


class OffloadedForward(_RematForward):
    """The ``forward`` remat installs on an offloaded module (Note [Offloaded units]; installed and undone like a
    checkpointed one: Note [Checkpoint the forward, not the module] in remat.rewrite.forwards)."""

    def __init__(self, module: nn.Module, name: str, offloader: Offloader, ops: tuple[str, ...] = ()) -> None:
        self.module, self.name, self.offloader = module, name, offloader
        #: a part's operators (Note [Offloaded parts] in remat.costs.offload); empty: every saved storage moves
        self.ops = frozenset(ops)
        self.previous = module.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self._original()
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        keep: set[int] = set()
        _storages((args, kwargs), keep)
        _storages(list(self.module.parameters()) + list(self.module.buffers()), keep)
        before = len(self.offloader.parked.get(self.name, ()))
        if self.ops:
            from remat.rewrite.policy import OutputNames

            with OutputNames() as names, self.offloader.hooks(self.name, frozenset(keep), (self.ops, names)):
                out = forward(*args, **kwargs)
        else:
            with self.offloader.hooks(self.name, frozenset(keep)):
                out = forward(*args, **kwargs)
        self.offloader.keep_outputs(self.name, before, out)
        return out

    def unit_names(self, name: str) -> list[str]:
        return [name]


def offloader_for(model: nn.Module) -> Offloader:
    """The model's :class:`Offloader` (one per model, so its units prefetch each other's tensors). Pinned buffers
    and a side stream are decided when a unit first runs, from the device of what it saves, not here (Note
    [Pinned at first run]: the model may be on meta now); nothing copied for a model on fake tensors
    (``Offloader(modelled=True)``)."""
    for m in model.modules():
        f = m.__dict__.get("forward")
        if isinstance(f, OffloadedForward):
            return f.offloader
    from remat._compat import FakeTensor

    first = next(model.parameters(), None)
    if isinstance(first, FakeTensor) or (first is not None and isinstance(getattr(first, "_local_tensor", None),
                                                                           FakeTensor)):
        return Offloader(modelled=True)  # a modelled target's fake model (remat.target)
    return Offloader()  # Note [Pinned at first run]: its copy path is decided at its units' first saved tensor


def offload_modules(model: nn.Module, names: Any, ops: dict[str, tuple[str, ...]] | None = None,
                    ahead: dict[str, str] | None = None) -> None:
    """Offload the named modules' saved activations to host memory (Note [Offloaded units]; mutates ``model``).
    Modules only (not segments, regions or selective units); one already checkpointed or offloaded is refused. A
    part (``h.3~1``) moves only what the operators ``ops[part]`` made (Note [Offloaded parts] in
    remat.costs.offload). ``ahead``: per offloaded module, the offloaded module whose storages its backward starts
    bringing back (``Plan.offload_ahead``, decided from the recorded order: Note [Exposed copies] in
    remat.costs.offload); none given, each unit's come back at its own backward."""
    from remat.costs.offload import PART, offloaded_module
    from remat.errors import InvalidInputError, PlanMismatchError

    ops = dict(ops or {})
    parts = {offloaded_module(n): ops.get(n, ()) for n in names}
    missing = [n for n in names if PART in n and not ops.get(n)]
    if missing:
        raise PlanMismatchError(f"the plan offloads parts {missing} without naming their operators (a plan's "
                                "offloaded_ops); make the plan again with this remat")
    names = list(parts)
    mods = dict(model.named_modules())
    bad = [n for n in names if n not in mods or n == ""]
    if bad:
        raise PlanMismatchError(f"{type(model).__name__} has no module named {bad} to offload: name submodules by "
                                "their qualified names (model.named_modules()); segments, regions and selective "
                                "units are checkpointed, not offloaded")
    taken = [n for n in names if isinstance(mods[n].__dict__.get("forward"), _RematForward)]
    if taken:
        raise InvalidInputError(f"{taken} already checkpointed or offloaded by remat: a unit is kept, recomputed "
                                "or offloaded, one of the three; call remove_checkpointing first")
    offloader = offloader_for(model)
    for n in names:
        mods[n].forward = OffloadedForward(mods[n], n, offloader, parts[n])
    # Note [Exposed copies] in remat.costs.offload: a unit's storages start coming back at the next unit's backward
    # where that unit is offloaded too, as the plan that priced it pairs them, never at another unit's
    offloaded = {n for n, m in mods.items() if isinstance(m.__dict__.get("forward"), OffloadedForward)}
    offloader.ahead.update({n: u for n, u in (ahead or {}).items() if n in offloaded and u in offloaded})
