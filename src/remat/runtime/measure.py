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

In: the user's model (or any callable), its inputs, loss and optimizer, a device. Out: the step run
(:class:`StepResult`), times, and peaks. The peak meters live in :mod:`remat.runtime.meters` and the
storage tracker, with Note [Dispatch-level accounting], in :mod:`remat.runtime.tracker`; both are
re-exported here, so every name of this layer is still importable from ``remat.runtime.measure``.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from remat._compat import is_dtensor_class, leaves_with_paths, tree_flatten
from remat.errors import InvalidInputError
# re-exported: the peak meters and the storage tracker moved out of this module
from remat.runtime.meters import AllocatorMeter, StepMeter, measure_peak  # noqa: F401
from remat.runtime.tracker import (  # noqa: F401
    StorageRecord,
    StorageTracker,
    allocated_bytes,
    found_storages_are_fresh,
    tensor_bytes,
)

LossFn = Callable[[Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


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


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one CPU thread within the block (the number set before, after): for timing tiny operators, whose
    cost is the host's and not the arithmetic's; on a shared machine a busy core stalls every multithreaded kernel
    (a checkpointed 8 x 8 function read 150 ms on two threads of two loaded cores, 0.4 ms on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
# StepMeter, AllocatorMeter and measure_peak: remat.runtime.meters (imported above).
