"""Fake tensors against the real forward: the same operators, the same sizes?

Note [Fake sizes]
~~~~~~~~~~~~~~~~~
A few kernels allocate differently from their fake implementation (CPU ``mse_loss`` returns a 0-d
view of an input-sized buffer). The recording takes the real storage sizes of the operators matched
between the recorded and one real plain forward.

Note [Fake paths]
~~~~~~~~~~~~~~~~~
Code that branches on data takes another path on fake tensors, where the value is unknown: Hugging
Face builds an explicit attention mask when it cannot see that the mask is all ones, and then repeats
grouped keys/values instead of SDPA's enable_gqa (Qwen3: 61 more operators, +3% memory). The real
forward is the truth: when the two differ, the step is recorded again for real, if the plain step fits
the device (on CPU, always; on CUDA, by the fake recording's peak).
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from remat._compat import outside_dispatch_modes
from remat.runtime.measure import Clock, LossFn, StorageTracker, input_tensors, new_step
from remat.profile.recorder import new_records
from remat.costs.recording import Recording
from remat.runtime.state import preserved


@dataclass(frozen=True)
class LoggedOp:
    """One operator of a real forward."""

    name: str
    #: bytes of the storage each tensor output created (None: a view or an existing storage)
    sizes: tuple[int | None, ...]
    #: wall time of the operator itself (seconds)
    seconds: float


class ForwardLog(StorageTracker):
    """Logs each operator run while active as a :class:`LoggedOp` (``ops``, after exit)."""

    def __init__(self, device: torch.device, ignore: Sequence[torch.Tensor]) -> None:
        super().__init__(device, ignore=ignore)
        self.clock = Clock(device)
        self._ops: list[tuple[str, tuple[int | None, ...]]] = []

    def on_op(self, func, args, kwargs, out) -> None:
        self._ops.append((str(func), tuple(r.nbytes if r is not None else None for r in new_records(self, out))))

    @property
    def ops(self) -> tuple[LoggedOp, ...]:
        clock = self.clock
        return tuple(LoggedOp(name, sizes, clock.seconds(a, b))
                     for (name, sizes), (a, b) in zip(self._ops, self.op_marks))


def log_forward(run: Callable[[], Any], device: torch.device, ignore: Sequence[torch.Tensor]) -> tuple[LoggedOp, ...]:
    """The operators ``run()`` dispatches (its result is dropped)."""
    log = ForwardLog(device, ignore)
    with log:
        run()
    return log.ops


def plain_forward_ops(model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn,
                      device: torch.device) -> tuple[tuple[LoggedOp, ...], frozenset[str]]:
    """The operators of one real plain forward and loss (no hooks, no checkpointing: checkpointed forwards
    run plainly without grad), and the buffers (qualified names) it changed, in place or by kernels that do
    not say so in their schema (``native_batch_norm``'s running statistics); model, buffers and RNG
    restored."""
    pre = [*model.parameters(), *model.buffers(), *input_tensors(args, kwargs)]
    with preserved(model), torch.no_grad():
        with outside_dispatch_modes():
            before = [(n, b.detach().clone()) for n, b in model.named_buffers() if b is not None]
        new_step()
        ops = log_forward(lambda: loss_fn(model(*args, **kwargs)), device, pre)
        now = dict(model.named_buffers())
        with outside_dispatch_modes():
            changed = frozenset(n for n, old in before if not torch.equal(old, now[n]))
    return ops, changed


def align_forward(rec: Recording, real: Sequence[LoggedOp]) -> dict[int, int]:
    """Recorded forward operator index -> index of the same operator in the real forward."""
    matcher = difflib.SequenceMatcher(None, [op.name for op in rec.forward_ops], [o.name for o in real],
                                      autojunk=False)
    return {block.a + k: block.b + k for block in matcher.get_matching_blocks() for k in range(block.size)}


def diverged(rec: Recording, real: Sequence[LoggedOp]) -> list[str]:
    """Note [Fake paths]: the allocating operators of the real forward that the fake recording does not
    have, or the other way round (a data-dependent branch taken differently), by name; empty when the two
    forwards allocate through the same operators in the same order."""
    fake_ops = [op.name for op in rec.forward_ops if any(s is not None for s in op.created)]
    real_ops = [o.name for o in real if any(b is not None for b in o.sizes)]
    if fake_ops == real_ops:
        return []
    sm = difflib.SequenceMatcher(None, fake_ops, real_ops, autojunk=False)
    return [op for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal"
            for op in fake_ops[i1:i2] + real_ops[j1:j2]]


def calibrate_sizes(rec: Recording, real: Sequence[LoggedOp]) -> tuple[Recording, int]:
    """Note [Fake sizes]: ``rec`` with the storage sizes of the real plain forward ``real`` (matched one
    for one when the two have the same operators, else aligned), and how many sizes changed."""
    same = [op.name for op in rec.forward_ops] == [o.name for o in real]
    match = {i: i for i in range(len(real))} if same else align_forward(rec, real)
    sizes: dict[int, int] = {}
    for i, j in match.items():
        for s, nbytes in zip(rec.forward_ops[i].created, real[j].sizes):
            if s is not None and nbytes is not None and rec.storages[s].nbytes != nbytes:
                sizes[s] = nbytes
    return rec.with_sizes(sizes), len(sizes)


def plain_step_fits(rec: Recording, device: torch.device) -> bool:
    """Whether a real plain step fits the device, by the fake recording's peak plus 10% (always on CPU)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return 1.1 * max(rec.timeline(), default=0) <= free


def ops_summary(ops: list[str]) -> str:
    """``["aten.mm.default", "aten.mm.default", "aten.add.Tensor"]`` -> ``"mm x2, add x1"``."""
    counts: dict[str, int] = defaultdict(int)
    for op in ops:
        counts[op.split(".")[1] if op.count(".") >= 2 else op] += 1
    return ", ".join(f"{n} x{c}" for n, c in sorted(counts.items(), key=lambda kv: -kv[1])[:4])
