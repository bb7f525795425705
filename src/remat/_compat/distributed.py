"""torch.distributed's private APIs remat relies on: DTensor, FSDP2, the default store, and what happens
outside the dispatcher (storage resizes, RNG states) (part of remat._compat: see its docstring)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch import _guards  # checked on 2.8, 2.11, 2.13, 2.15
from torch._subclasses.fake_tensor import FakeTensor  # checked on 2.8, 2.11, 2.13, 2.15


# -- distributed ----------------------------------------------------------------------------------
#: whether each class seen is DTensor or a subclass (these run on every operator a tracker sees: no import,
#: no issubclass per call)
_IS_DTENSOR: dict[type, bool] = {torch.Tensor: False, torch.nn.Parameter: False, FakeTensor: False}


def is_dtensor_class(cls: type) -> bool:
    """Whether ``cls`` is ``torch.distributed.tensor.DTensor`` (or a subclass) (checked on 2.8, 2.11, 2.13, 2.15)."""
    known = _IS_DTENSOR.get(cls)
    if known is not None:
        return known
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    known = _IS_DTENSOR[cls] = isinstance(cls, type) and issubclass(cls, DTensor)
    return known


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's memory: a DTensor's local shard (``DTensor._local_tensor``, read
    without dispatching an operator; checked on 2.8, 2.11, 2.13, 2.15), any other tensor itself."""
    return t._local_tensor if is_dtensor_class(type(t)) else t


def active_fake_mode():
    """The FakeTensorMode in effect, or None. DTensor's sharding propagation runs operators on fake tensors
    of its own (they allocate nothing) (``torch._guards.active_fake_mode``, checked on 2.8, 2.11, 2.13, 2.15)."""
    return _guards.active_fake_mode()


@contextlib.contextmanager
def storage_resizes_reported(callback) -> Iterator[None]:
    """Call ``callback(storage, nbytes)`` after every ``UntypedStorage.resize_``: FSDP2 frees and re-allocates
    its all-gather buffers by resizing their storages (``free_storage``/``alloc_storage``), which no
    dispatch mode sees (the same patch as ``torch.distributed._tools.mem_tracker``; checked on 2.8, 2.11, 2.13, 2.15)."""
    original = torch.UntypedStorage.resize_

    def resize_(st, size):
        result = original(st, size)
        callback(st, int(size))
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


@contextlib.contextmanager
def rng_states_reported(callback) -> Iterator[None]:
    """Call ``callback(state)`` with every tensor ``torch.get_rng_state()`` returns: the CPU RNG state that
    ``torch.utils.checkpoint`` saves per checkpointed call (5 KB) is made outside the dispatcher, where no
    dispatch mode sees it (``torch.get_rng_state`` patched for the duration; checked on 2.8, 2.11, 2.13, 2.15)."""
    original = torch.get_rng_state

    def get_rng_state():
        state = original()
        callback(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def fsdp_modules(model: torch.nn.Module) -> list[tuple[str, bool]]:
    """The modules ``fully_shard`` manages, by qualified name, with whether each reshards its parameters
    after forward (``FSDPModule._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info``; checked on
    2.8, 2.11, 2.13, 2.15)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    out = []
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            out.append((name, group is not None and group.post_forward_mesh_info is not None))
    return out


def default_store():
    """The key-value store of the default process group (``distributed_c10d._get_default_store``, checked
    on 2.8, 2.11, 2.13, 2.15)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def fake_store():
    """A store for torch's fake process group (backend ``"fake"``: collectives return at once, their outputs
    allocated, no data moved), for planning a world that is not here (``torch.testing._internal.distributed.
    fake_pg.FakeStore``, importing that module registers the backend; checked on 2.8, 2.13, 2.15)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


_PROPAGATING = threading.local()


def in_sharding_propagation() -> bool:
    """Whether DTensor is computing an operator's output metadata right now (see
    :func:`sharding_propagation_marked`)."""
    return getattr(_PROPAGATING, "depth", 0) > 0


@contextlib.contextmanager
def sharding_propagation_marked() -> Iterator[None]:
    """Mark DTensor's tensor-metadata propagation (``ShardingPropagator._propagate_tensor_meta_non_cached``, or
    ``_propagate_tensor_meta`` where that is the uncached one; checked on 2.13, 2.15): it runs each operator on
    fake tensors of the *global* shapes under ``detect_fake_mode() or FakeTensorMode()``, which is the recording's
    own mode when every tensor is fake (a modelled target), so a tracker counting fake tensors must skip what runs
    inside it (:func:`in_sharding_propagation`): it allocates nothing on any rank."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # torch without distributed
        yield
        return
    name = next((n for n in ("_propagate_tensor_meta_non_cached", "_propagate_tensor_meta")
                 if hasattr(ShardingPropagator, n)), None)
    if name is None:
        yield
        return
    original = getattr(ShardingPropagator, name)

    def marked(self, *args, **kwargs):
        _PROPAGATING.depth = getattr(_PROPAGATING, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _PROPAGATING.depth -= 1

    setattr(ShardingPropagator, name, marked)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, original)


@contextlib.contextmanager
def meshes_built_for_real() -> Iterator[None]:
    """Build every ``DeviceMesh`` with the fake mode unset (``torch._subclasses.fake_tensor.unset_fake_temporarily``
    around ``DeviceMesh.__init__``; checked on 2.13): a mesh computes its coordinates with tensor operators
    (``nonzero``) that fake tensors cannot run, and FSDP2 over a tensor-parallel mesh concatenates meshes while a
    modelled target's parallelize runs under the fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    def init(self, *args, **kwargs):
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


def collective_elem(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor holding the memory of a functional collective's ``AsyncCollectiveTensor`` (its ``elem``), None
    for any other tensor (Note [Storages without memory] in remat.runtime.tracker;
    ``torch.distributed._functional_collectives``, checked on 2.8, 2.13, 2.15)."""
    if type(t).__name__ != "AsyncCollectiveTensor":
        return None
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.elem if isinstance(t, AsyncCollectiveTensor) else None


def use_counts(t: torch.Tensor) -> tuple[int, int]:
    """References to ``t`` (its TensorImpl's use count) and to its storage (the StorageImpl's, which views and the
    storage object asked for here count): a collective's work holds the one or the other (Note [Collectives
    settled] in remat.runtime.distributed; ``Tensor._use_count`` and ``torch._C._storage_Use_Count``, checked on
    2.8, 2.13, 2.15: a fresh tensor reads (1, 1) on 2.8, (1, 2) on 2.15, so callers compare with a reading of
    their own)."""
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)
