"""Dispatch modes, fake tensors, operator schemas, storages and pytrees: the private torch APIs remat's
dispatch-level recorders rely on (part of remat._compat: see its docstring)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: F401 - checked on 2.8, 2.11, 2.13, 2.15
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 - checked on 2.8, 2.11, 2.13, 2.15
from torch.utils._pytree import tree_flatten, tree_map  # noqa: F401 - checked on 2.8, 2.11, 2.13, 2.15
from torch.utils._pytree import keystr as _keystr, tree_flatten_with_path as _tree_flatten_with_path

from remat._compat.distributed import local_tensor


@contextlib.contextmanager
def outside_dispatch_modes() -> Iterator[None]:
    """Run a few operators unseen by the active ``TorchDispatchMode``s, e.g. selective checkpointing's
    caching mode during a recomputation, which refuses operators the forward did not run.
    ``torch.utils._python_dispatch._disable_current_modes`` (checked on 2.8, 2.11, 2.13, 2.15)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def storage_key(t: torch.Tensor) -> int:
    """An identity for the storage behind ``t``, equal for views and aliases and stable while it lives:
    ``UntypedStorage._cdata`` (checked on 2.8, 2.11, 2.13, 2.15)."""
    return local_tensor(t).untyped_storage()._cdata


def storage_ref(t: torch.Tensor) -> "weakref.ref":
    """A weak reference to the storage behind ``t``, dead once the storage is freed; while it is alive the
    storage holds its address (:func:`storage_key`), which a key alone does not tell apart from a later
    storage's. A Python weak reference to the ``UntypedStorage``, which torch keeps as long as its storage
    lives (as :class:`remat.runtime.tracker.StorageBook` relies on; checked on 2.8, 2.13, 2.15). Not
    ``torch.multiprocessing.reductions.StorageWeakRef``: on 2.8 it kept the Python storage, and the
    tracker's record of it, alive after the last tensor went."""
    return weakref.ref(local_tensor(t).untyped_storage())


def untyped_storage_key(st: torch.UntypedStorage) -> int:
    """The identity :func:`storage_key` gives a tensor, for the storage itself: ``UntypedStorage._cdata``
    (checked on 2.8, 2.11, 2.13, 2.15)."""
    return st._cdata


def fake_mode() -> FakeTensorMode:
    """A FakeTensorMode that lets real tensors (constants a model creates) mix with fake ones
    (``torch._subclasses.fake_tensor``, checked on 2.8, 2.11, 2.13, 2.15)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def flop_count(func, args: tuple, kwargs: dict, out) -> int:
    """Floating-point operations of one operator call by ``torch.utils.flop_counter``'s formulas; 0 for
    operators without one (``flop_registry`` keyed by ``OpOverload._overloadpacket``, checked on 2.8, 2.11, 2.13,
    2.15)."""
    from torch.utils.flop_counter import flop_registry

    count = flop_registry.get(func._overloadpacket)
    if count is None:
        return 0
    try:
        return int(count(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a FLOP formula that does not fit these arguments
        return 0


def op_flops(func, args: tuple, kwargs: dict, out) -> int:
    """Floating-point operations of one operator call as a device runs it: :func:`flop_count`, with attention
    counted where torch's formulas count nothing (CPU's flash kernel, the one fake CPU tensors pick: Note [Target
    kernels] in remat.target.source) and halved for causal attention, whose kernels skip the masked half (torch's
    formulas count the whole square)."""
    name = str(func)
    if "attention" not in name:
        return flop_count(func, args, kwargs, out)
    n = flop_count(func, args, kwargs, out)
    q, k = argument(func, args, kwargs, "query"), argument(func, args, kwargs, "key")
    if not n and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4:
        b, h, sq, d = q.shape
        sk = k.shape[-2]
        # forward: scores (q @ k^T) and output (p @ v), 2 FLOPs a multiply-add; backward: the scores again and
        # four products (dV, dP, dQ, dK): 2.5 times the forward, as FlashAttention-2's paper counts it
        n = 4 * b * h * sq * sk * d * (5 if name.split(".")[1].endswith("backward") else 2) // 2
    if argument(func, args, kwargs, "is_causal") is True:
        n //= 2
    return int(n)


#: operators that launch no kernel and move no data (views, metadata, allocation without a fill)
_NO_KERNEL = frozenset({"aten.empty", "aten.empty_strided", "aten.empty_like", "aten.detach", "aten.alias",
                        "aten.lift_fresh", "aten.set_", "aten.resize_", "aten._local_scalar_dense",
                        # a view that autograd does not track as one (its schema says no alias): no copy either
                        "aten._unsafe_view", "aten._reshape_alias"})


#: operators whose first argument is a table they read only some rows of (an embedding's weight)
_GATHERS = frozenset({"aten.embedding", "aten.index_select", "aten.gather"})


def op_bytes(func, args: tuple, kwargs: dict, out) -> int:
    """Bytes an operator call reads and writes in device memory: its tensor arguments' and outputs' elements
    (a DTensor's local shard), 0 for views and operators that launch no kernel (``OpOverload.is_view``, checked
    on 2.8, 2.13, 2.15); a gather (an embedding) its rows, not its table. A model for the roofline
    (remat.costs.device_time), not a measurement: a broadcast argument counts once, an in-place output again."""
    name = str(func).rsplit(".", 1)[0]
    if getattr(func, "is_view", False) or name in _NO_KERNEL or func.namespace == "prim":
        return 0
    total = 0
    if name in _GATHERS:  # reads the rows it gathers, not the whole table: the output's bytes twice, the indices
        args, out = args[1:], (out, out)
    for t in tree_flatten((args, kwargs, out))[0]:
        if isinstance(t, torch.Tensor):
            t = local_tensor(t)
            total += t.numel() * t.element_size()
    return total


def written_arguments(func, args: tuple, kwargs: dict) -> list:
    """The arguments operator ``func`` writes to in place, by its schema (``OpOverload._schema``'s
    ``alias_info.is_write``, checked on 2.8, 2.11, 2.13, 2.15)."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(args[i] if i < len(args) else kwargs.get(a.name))
    return out


def argument(func, args: tuple, kwargs: dict, name: str, missing=None):
    """The value of operator ``func``'s argument ``name`` in this call (its default when not passed),
    or ``missing`` when it has no such argument (``OpOverload._schema``, checked on 2.8, 2.11, 2.13, 2.15)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return kwargs.get(name, args[i] if i < len(args) else a.default_value)
    return missing


def module_stack(node: torch.fx.Node) -> list[str]:
    """Qualified names of the modules an fx/export graph node ran inside, outermost first: the
    ``nn_module_stack`` node metadata that fx tracing and torch.export write (checked on 2.8, 2.11, 2.13, 2.15)."""
    stack = node.meta.get("nn_module_stack") or {}
    names = [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]
    if node.op == "call_module":
        names.append(str(node.target))
    return names


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    """The leaves of a pytree with their paths written as code (``[1]``, ``['logits']``); a tree whose
    node types have no keys (a container registered without them) gives ``<leaf i>``."""
    try:
        return [(_keystr(path), leaf) for path, leaf in _tree_flatten_with_path(tree)[0]]
    except Exception:  # noqa: BLE001 - a node type registered without flatten_with_keys
        return [(f" <leaf {i}>", leaf) for i, leaf in enumerate(tree_flatten(tree)[0])]


@contextlib.contextmanager
def checkpoint_policies_asked_for(stand_ins: dict[Any, tuple[Any, ...]]) -> Iterator[None]:
    """Within the block, every selective-checkpointing policy (``create_selective_checkpoint_contexts``, the user's
    list or ``policy_fn`` as written) that is asked about an operator in ``stand_ins`` and would not save its
    output is asked again about the operators it stands in for, in order, and the first answer that saves is
    taken (Note [Policies for the target's kernels] in remat.target.world). By wrapping the policy that
    torch.utils.checkpoint's ``_CachingTorchDispatchMode`` and ``_CachedTorchDispatchMode`` are made with (their
    ``__init__``'s first argument; checked on 2.8, 2.13, 2.15); restored after, also on error."""
    from torch.utils import checkpoint as cp

    def saves(decision: Any) -> bool:
        return decision is True or decision in (cp.CheckpointPolicy.MUST_SAVE, cp.CheckpointPolicy.PREFER_SAVE)

    def asking(policy_fn: Any) -> Any:
        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            decision = policy_fn(ctx, func, *args, **kwargs)
            if saves(decision) or func not in stand_ins:
                return decision
            for op in stand_ins[func]:
                if saves(again := policy_fn(ctx, op, *args, **kwargs)):
                    return again
            return decision
        return policy

    originals = {cls: cls.__init__ for cls in (cp._CachingTorchDispatchMode, cp._CachedTorchDispatchMode)}
    for cls, init in originals.items():
        def patched(self: Any, policy_fn: Any, *args: Any, _init: Any = init, **kwargs: Any) -> None:
            _init(self, asking(policy_fn), *args, **kwargs)
        cls.__init__ = patched
    try:
        yield
    finally:
        for cls, init in originals.items():
            cls.__init__ = init


def fake_tensor_exceptions() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """The exceptions fake tensors raise for (an operator that needs values, a tensor of another device or not fake),
    from ``torch._subclasses.fake_tensor`` and symbolic shapes (checked on 2.8, 2.13, 2.15)."""
    from torch._subclasses import fake_tensor as ft

    data = tuple(c for c in (getattr(ft, "DataDependentOutputException", None),
                             getattr(ft, "DynamicOutputShapeException", None)) if c is not None)
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
        data += (GuardOnDataDependentSymNode,)
    except ImportError:  # pragma: no cover - older layouts
        pass
    device = tuple(c for c in (getattr(ft, "FakeTensorDeviceMismatchError", None),) if c is not None)
    return data, device
