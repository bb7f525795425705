"""Snapshot and restore what remat may touch while it works, so a failure loses nothing."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, ParamSpec, TypeVar

import torch
from torch import nn

from remat._compat import compiled_call, set_compiled_call
from remat.runtime.compiled import restore_set_aside, set_aside

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class Snapshot:
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    grads: list[tuple[nn.Parameter, torch.Tensor | None]]
    forwards: list[tuple[nn.Module, object]]
    #: each module's compiled call (``Module.compile()``) and the one remat set aside for it, if any (Note
    #: [Blocks Module.compile() leaves eager] in remat.runtime.compiled)
    compiled_calls: list[tuple[nn.Module, object, object]]


def take_snapshot(model: nn.Module) -> Snapshot:
    """Copies of the RNG states and buffers, references to the gradients, forward overrides and compiled calls."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return Snapshot(
        cpu_rng=torch.get_rng_state(),
        cuda_rng=cuda,
        buffers=[(b, b.detach().clone()) for b in model.buffers()],
        grads=[(p, p.grad) for p in model.parameters()],
        forwards=[(m, m.__dict__.get("forward")) for m in model.modules()],
        compiled_calls=[(m, compiled_call(m), set_aside(m)) for m in model.modules()],
    )


def restore(snap: Snapshot) -> None:
    """Put the model's buffers (in place, same objects), gradients, forwards, compiled calls and the RNG back."""
    with torch.no_grad():
        for b, v in snap.buffers:
            b.copy_(v)
    for p, g in snap.grads:
        p.grad = g
    for m, f in snap.forwards:
        if f is None:
            m.__dict__.pop("forward", None)
        else:
            m.forward = f
    for m, impl, aside in snap.compiled_calls:
        set_compiled_call(m, impl, absent=impl is None)
        restore_set_aside(m, aside)
    torch.set_rng_state(snap.cpu_rng)
    if snap.cuda_rng is not None:
        torch.cuda.set_rng_state_all(snap.cuda_rng)


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() and torch.cuda.is_initialized() else []


def keeps_rng(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a function that runs the model for real (dropout draws from the global generators) so
    that the CPU and CUDA RNG states are as they were when it returns or raises."""
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with torch.random.fork_rng(devices=_cuda_devices()):
            return fn(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def preserved(model: nn.Module, *, on_success: bool = True) -> Iterator[Snapshot]:
    """Restore the model and RNG when the block raises; also when it succeeds if ``on_success``."""
    snap = take_snapshot(model)
    try:
        yield snap
    except BaseException:
        restore(snap)
        raise
    if on_success:
        restore(snap)


@contextlib.contextmanager
def fresh_grads(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Run a real ``backward()`` without touching the ``.grad`` of ``tensors``: they start as None (as
    after ``zero_grad(set_to_none=True)``, so nothing accumulates in place into the user's gradients)
    and get their previous gradient objects back afterwards."""
    tensors = list(dict.fromkeys(tensors))
    saved = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    try:
        yield
    finally:
        for t, g in zip(tensors, saved):
            t.grad = g


# Note [Attributes kept]
# ~~~~~~~~~~~~~~~~~~~~~~
# Planning runs the user's code (a LightningModule's training_step, 11 times on the first batch in
# issue #24.1): what it does to the module's own attributes -- a step counter, a list of losses, a tensor
# of examples seen, a torchmetrics Metric's states and update count -- must not outlive planning, or the
# epoch's metrics count the first batch a dozen times. `kept_attributes` snapshots the plain data in
# every submodule's __dict__ (not nn.Module's own fields, not submodules, parameters or buffers, which
# `preserved` handles) and puts it back in place: tensors copied into the same objects, lists, dicts and
# sets refilled (their identity kept), numbers, strings and tuples rebound; attributes added meanwhile are
# deleted. Other objects (a logger, a file, a user's own class) are left as they are: their side effects,
# like a print, remain, and are said in the plan's notes with the number of calls.

_MODULE_FIELDS = frozenset(vars(nn.Module()))
_IMMUTABLE = (int, float, complex, bool, str, bytes, tuple, frozenset, type(None))


@contextlib.contextmanager
def kept_attributes(module: nn.Module) -> Iterator[None]:
    """Put the plain data in ``module``'s and its submodules' attributes back as it was when the block
    ends, however it ends (Note [Attributes kept])."""
    saved: list[tuple[nn.Module, dict[str, tuple[object, object]]]] = []
    for m in module.modules():
        own = {}
        for k, v in m.__dict__.items():
            if k in _MODULE_FIELDS or k == "forward" or isinstance(v, nn.Module):
                continue
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                own[k] = (v, v.detach().clone())
            elif isinstance(v, (list, dict, set)):
                own[k] = (v, v.copy())
            elif isinstance(v, _IMMUTABLE):
                own[k] = (v, None)
            else:
                own[k] = (v, _OTHER)
        saved.append((m, own))
    try:
        yield
    finally:
        for m, own in saved:
            for k in [k for k in m.__dict__ if k not in own and k not in _MODULE_FIELDS and k != "forward"
                      and not isinstance(m.__dict__[k], nn.Module)]:
                del m.__dict__[k]
            for k, (v, copy) in own.items():
                if copy is _OTHER:
                    continue
                m.__dict__[k] = v
                if isinstance(v, torch.Tensor):
                    with torch.no_grad():
                        if v.shape == copy.shape:  # type: ignore[union-attr]
                            v.copy_(copy)  # type: ignore[arg-type]
                        else:
                            m.__dict__[k] = copy
                elif isinstance(v, list):
                    v[:] = copy  # type: ignore[index]
                elif isinstance(v, (dict, set)):
                    v.clear()
                    v.update(copy)  # type: ignore[arg-type]


_OTHER = object()
