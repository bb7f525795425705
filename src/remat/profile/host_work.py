"""The model's own host work, measured on the model itself (Note [Host time decomposed] in
remat.costs.host_time): its step run under a dispatch mode that reads the clock as each operator enters and
leaves; what lies between operators is the model's Python, its modules' calls and hooks, and autograd's work.

Note [Time between operators]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The mode sees the operators below autograd (as a GPU's dispatcher runs them). It is the outermost mode, so what
runs inside an operator's call (fake tensors' meta kernels, a real kernel) is excluded; what lies between two
calls is the caller's. The mode itself adds a fixed cost to every call it sees (the call into Python, its own
bookkeeping): :func:`call_s` measures it on a loop of one bare operator per iteration (nothing of a model's
between them) and it is taken out of every call, metadata queries included (``prim`` operators: fake tensors
dispatch ``.device`` and ``.dim()``, real ones answer them in C++; they are not counted as operators). The first
pass is not read (lazy initialisation, caches); of the passes read, the least (a busy moment of the machine only
adds). Each pass runs on fresh gradients and leaves the model, its buffers and the random state as they were.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat.costs.device_time import HostCosts
from remat.costs.host_time import HostWork, phase_host_s
from remat.costs.recording import CheckpointOverhead
from remat.costs.step_time import with_host_times
from remat.costs.unit_costs import UnitCost
from remat.runtime.measure import LossFn, one_thread, run_step
from remat.runtime.state import fresh_grads, preserved

__all__ = ["measure_host_work", "call_s", "code_of", "step_host_work", "modelled_host"]

#: passes read after the unread first one (Note [Time between operators])
PASSES = 3


class _Between(TorchDispatchMode):
    """Seconds between consecutive operator calls and the calls seen, per phase (Note [Time between operators])."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.between_s = {"forward": 0.0, "backward": 0.0}
        self.ops = {"forward": 0, "backward": 0}
        self.calls = {"forward": 0, "backward": 0}
        self._left: float | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from remat._compat import is_dtensor_class

        kwargs = kwargs or {}
        if any(is_dtensor_class(t) for t in types):
            return NotImplemented  # DTensor runs it on its local shards, which this mode then sees
        entered = time.perf_counter()
        if self._left is not None:
            self.between_s[self.phase] += entered - self._left
        out = func(*args, **kwargs)
        self.calls[self.phase] += 1
        self.ops[self.phase] += func.namespace != "prim"
        self._left = time.perf_counter()
        return out

    def __enter__(self):
        self._left = time.perf_counter()  # the model's work before its first operator counts too
        return super().__enter__()

    def next_phase(self, event: str) -> None:
        if event == "loss":
            self.phase = "backward"


@functools.lru_cache(maxsize=None)
def call_s(fake: bool) -> float:
    """Seconds the mode adds to each call it sees, on fake tensors or real CPU ones (fake ones cost the call more:
    6.6 against 4.3 us here): the time between calls in a loop of one bare addition per iteration (the least of 5
    loops of 2,000), outside any other mode; a property of this machine and process."""
    from remat._compat import fake_mode, outside_dispatch_modes

    with one_thread(), outside_dispatch_modes():
        mode = fake_mode() if fake else contextlib.nullcontext()
        with mode:
            x = torch.zeros(8)
        best = float("inf")
        for _ in range(6):
            with mode, _Between() as between:
                for _ in range(2000):
                    torch.add(x, x)
            best = min(best, between.between_s["forward"] / max(between.calls["forward"], 1))
    return best


def measure_host_work(model: Any, args: tuple, kwargs: dict, loss_fn: LossFn, *, output_alive: bool,
                      targets: list[torch.Tensor], passes: int = PASSES) -> HostWork:
    """The model's own host seconds in the forward (with the loss) and backward of one step, and the operators
    each dispatches (Note [Time between operators]), on whatever tensors the model holds (fake ones: no kernel
    runs). ``targets``: the tensors the backward differentiates (their ``.grad`` untouched). The model, its
    buffers and the random state are as before."""
    with one_thread():  # the host's cost, not the arithmetic's: Note [Time between operators]
        return _measured(model, args, kwargs, loss_fn, output_alive, targets, passes)


def _measured(model: Any, args: tuple, kwargs: dict, loss_fn: LossFn, output_alive: bool,
              targets: list[torch.Tensor], passes: int) -> HostWork:
    from remat._compat import FakeTensor, tree_flatten

    per_call = call_s(any(isinstance(t, FakeTensor) for t in [*targets, *tree_flatten((args, kwargs))[0]]))
    readings = []
    for _ in range(passes + 1):
        mode = _Between()
        with preserved(model), fresh_grads(targets), mode:
            run_step(model, args, kwargs, loss_fn, output_alive=output_alive, on=mode.next_phase)
        readings.append({p: max(mode.between_s[p] - mode.calls[p] * per_call, 0.0) for p in ("forward", "backward")}
                        | {f"{p}_ops": mode.ops[p] for p in ("forward", "backward")})
    read = readings[1:]
    best = {p: min(r[p] for r in read) for p in ("forward", "backward")}
    return HostWork(forward_python_s=best["forward"], backward_python_s=best["backward"],
                    forward_ops=read[-1]["forward_ops"], backward_ops=read[-1]["backward_ops"],
                    source=f"the model's step on fake tensors here, the time between its operators less "
                           f"{per_call * 1e6:.2f} us a call of the measuring mode, the least of {len(read)} passes "
                           f"(Note [Time between operators]; spread {_spread(read):.0%})")


def _spread(readings: list[dict]) -> float:
    totals = [r["forward"] + r["backward"] for r in readings]
    return (max(totals) - min(totals)) / statistics.median(totals) if totals and statistics.median(totals) else 0.0


def code_of(model: torch.nn.Module) -> str:
    """What the model's own host work depends on besides its operators, for the timing cache: each class of its
    modules and the source of its ``forward`` where Python has it (two models of the same operators and other code
    are measured apart: Note [Time between operators])."""
    import hashlib
    import inspect

    parts = []
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: (c.__module__, c.__qualname__)):
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        parts.append(f"{cls.__module__}.{cls.__qualname__}:{hashlib.sha256(source.encode()).hexdigest()[:16]}")
    return ";".join(parts)


def step_host_work(step: Any) -> HostWork:
    """The own host work of ``step`` (a remat.profile.step.ProfiledStep) on the tensors its model holds."""
    from remat.profile.recorder import grad_targets

    trainable = [p for p in step.model.parameters() if p.requires_grad]
    return measure_host_work(step.model, step.args, step.kwargs, step.loss_fn, output_alive=step.output_alive,
                             targets=grad_targets(trainable, (step.args, step.kwargs)))


def modelled_host(units: list[UnitCost], work: HostWork, host: HostCosts,
                  bookkeeping: CheckpointOverhead) -> tuple[list[UnitCost], tuple[float, float], str]:
    """A modelled target's host (Note [Host time decomposed] in remat.costs.host_time) from the model's own work:
    ``units`` with their host seconds; the plain step's forward and backward host seconds; a note."""
    note = (f"host: the model's own work {work.forward_python_s * 1e3:.1f} ms forward, "
            f"{work.backward_python_s * 1e3:.1f} ms backward ({work.source}); the device's "
            f"{host.forward_op_s * 1e6:.2f} us a forward operator, {host.backward_op_s * 1e6:.2f} us a backward one "
            f"({host.source})")
    return (list(with_host_times(units, host, work, bookkeeping)),
            (phase_host_s(work.forward_python_s, work.forward_ops, host.forward_op_s),
             phase_host_s(work.backward_python_s, work.backward_ops, host.backward_op_s)), note)
