"""Private torch APIs remat relies on, in one place.

Each entry names the torch versions it was checked on. When a new torch moves one of them, it
breaks here with a message that says which, instead of deep inside a stage.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: F401 - checked on 2.11, 2.13
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 - checked on 2.11, 2.13
from torch.utils._pytree import tree_flatten, tree_map  # noqa: F401 - checked on 2.11, 2.13

#: torch versions the entries below were run on
CHECKED_ON = ("2.11", "2.13")


def default_foreach(params: list[torch.Tensor], differentiable: bool) -> bool:
    """Whether ``torch.optim`` picks its foreach (multi-tensor) implementation for ``params`` when a
    group leaves ``foreach`` and ``fused`` unset. ``torch.optim.optimizer._default_to_fused_or_foreach``
    (checked on 2.11, 2.13)."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # a torch that moved it: assume the per-tensor loop (its temporaries are the smaller)
        return False
    return bool(_default_to_fused_or_foreach(params, differentiable, False)[1])


@contextlib.contextmanager
def global_optimizer_hooks_paused() -> Iterator[None]:
    """Run ``torch.optim`` steps without the hooks registered for *every* optimizer
    (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook``): remat's own
    steps on shadow copies must not reach the user's hooks. ``_global_optimizer_pre_hooks`` and
    ``_global_optimizer_post_hooks`` (checked on 2.11, 2.13)."""
    import torch.optim.optimizer as optim_module

    tables = [getattr(optim_module, n, None) for n in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")]
    saved = [dict(t) if t is not None else None for t in tables]
    for t in tables:
        if t is not None:
            t.clear()
    try:
        yield
    finally:
        for t, s in zip(tables, saved):
            if t is not None:
                t.clear()
                t.update(s)


@contextlib.contextmanager
def outside_dispatch_modes() -> Iterator[None]:
    """Run a few operators unseen by the active ``TorchDispatchMode``s, e.g. selective checkpointing's
    caching mode during a recomputation, which refuses operators the forward did not run.
    ``torch.utils._python_dispatch._disable_current_modes`` (checked on 2.11, 2.13)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield




def storage_key(t: torch.Tensor) -> int:
    """An identity for the storage behind ``t``, equal for views and aliases and stable while it lives:
    ``UntypedStorage._cdata`` (checked on 2.11, 2.13)."""
    return t.untyped_storage()._cdata


def fake_mode() -> FakeTensorMode:
    """A FakeTensorMode that lets real tensors (constants a model creates) mix with fake ones
    (``torch._subclasses.fake_tensor``, checked on 2.11, 2.13)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def flop_count(func, args: tuple, kwargs: dict, out) -> int:
    """Floating-point operations of one operator call by ``torch.utils.flop_counter``'s formulas; 0 for
    operators without one (``flop_registry`` keyed by ``OpOverload._overloadpacket``, checked on 2.11,
    2.13)."""
    from torch.utils.flop_counter import flop_registry

    count = flop_registry.get(func._overloadpacket)
    if count is None:
        return 0
    try:
        return int(count(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a FLOP formula that does not fit these arguments
        return 0


def written_arguments(func, args: tuple, kwargs: dict) -> list:
    """The arguments operator ``func`` writes to in place, by its schema (``OpOverload._schema``'s
    ``alias_info.is_write``, checked on 2.11, 2.13)."""
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
    or ``missing`` when it has no such argument (``OpOverload._schema``, checked on 2.11, 2.13)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return kwargs.get(name, args[i] if i < len(args) else a.default_value)
    return missing


def module_stack(node: torch.fx.Node) -> list[str]:
    """Qualified names of the modules an fx/export graph node ran inside, outermost first: the
    ``nn_module_stack`` node metadata that fx tracing and torch.export write (checked on 2.11, 2.13)."""
    stack = node.meta.get("nn_module_stack") or {}
    names = [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]
    if node.op == "call_module":
        names.append(str(node.target))
    return names
