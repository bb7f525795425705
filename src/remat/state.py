"""Snapshot and restore what remat may touch while it works, so a failure loses nothing."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, ParamSpec, TypeVar

import torch
from torch import nn

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class Snapshot:
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    grads: list[tuple[nn.Parameter, torch.Tensor | None]]
    forwards: list[tuple[nn.Module, object]]


def take_snapshot(model: nn.Module) -> Snapshot:
    """Copies of the RNG states and buffers, references to the gradients and forward overrides."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return Snapshot(
        cpu_rng=torch.get_rng_state(),
        cuda_rng=cuda,
        buffers=[(b, b.detach().clone()) for b in model.buffers()],
        grads=[(p, p.grad) for p in model.parameters()],
        forwards=[(m, m.__dict__.get("forward")) for m in model.modules()],
    )


def restore(snap: Snapshot) -> None:
    """Put the model's buffers (in place, same objects), gradients, forwards and the RNG back."""
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
