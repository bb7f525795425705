"""Time: real steps, per unit, and checkpoint's own bookkeeping on this machine.

Time is measured for real, with every top-level candidate unit checkpointed (so its memory stays near
the least-memory plan's): each unit's forward is timed by module hooks on its first call, its
recomputation on the second call that checkpointing makes in backward. The plain backward time is
the measured one less the recomputations. CPU timings are noisy upwards, never downwards: every time
is the least of the timed steps.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat._compat import outside_dispatch_modes
from remat.costs.unit_costs import op_key
from remat.errors import InternalError
from remat.runtime.measure import Clock, LossFn, input_tensors, median_time, new_step, one_thread, run_step, \
    trainable_parameters
from remat.profile.calibrate import LoggedOp, ForwardLog, log_forward
from remat.profile.recorder import grad_targets, hook_units
from remat.costs.recording import CheckpointOverhead, UnitTimes
from remat.rewrite import checkpoint_modules, keep_ops
from remat.runtime.state import fresh_grads


# Note [Long steps are timed twice]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Timing repeats steps because a short step's times are noisy (a 50 ms CPU step moves by milliseconds) and
# the first steps of a process run slow (allocator, thread pools). For a step of a second or more each repeat
# costs a whole training step of the user's time (issue #23: 12-22 steps' time to plan a GPT-2 small, 8.9 of
# them profiling). So when the first hooked step (forward and backward, hooked, with the top-level units
# checkpointed) takes at least LONG_STEP_S, one more hooked step is timed and each time is the lesser of the
# two: no further hooked steps, no unhooked step (hooks cost microseconds per unit call), and each operator's
# second timing is that of the plain forward profiling runs anyway to check the fake recording's sizes (Note
# [Fake sizes] in remat.profile.calibrate).
#
# The first hooked step logs every operator (a dispatch mode around each), so its forward is not the lesser; and on
# a CPU it may be the first to reach the step's peak, every new page of the heap faulted in as it grows (the
# recomputations in its backward grow it most). A cold step only reads slower, so where the first one was cold the
# lesser of the two is the second's. Is the second step then settled? At 4206b42 it was not always: on an 8-block
# ViT-style model (benchmarks/plans/ranking.py's "vit": width 256, 16 x 256 tokens; 2-core CPU) a block's
# recomputation read 149 ms in the first step, 54-72 ms in the second (three runs) and 56-58 ms as the lesser of the
# second and third. So, until issue #60, a third hooked step ran where the logging step's backward read over 5%
# above the next one's, and the times were the lesser of the last two. Measured since, with a third step recorded
# beside every long profile and not used (benchmarks/accuracy/hooked_steps.py at 5daf1a8: the ViT, the 16 MLP
# blocks and GPT-2 small, 8 calls each, 12 of them a process's first): the logging step's backward read
# 0.916-1.107 of the next one's, above 1.05 in the ViT's four first calls and one GPT-2 call, where the third step
# ran; there it moved the sums of the units' lesser recomputation times by -5.8 to -0.2%, and in the 19 calls where
# it did not run it would have moved them by -9.9 to +6.2%: one more step's noise, not a cold second step. Each
# third step cost one more training step of the user's time (on GPT-2 small 1.2 plain steps, a quarter of what
# planning at 85% of the plain peak takes, benchmarks/scale/planning_cost.py), and a ViT user's first call paid it
# every time. Now two hooked steps are timed, whatever the first read; where a second step does read cold, the
# plan's checked step shows it beside its prediction and the hand rules within that error are timed (Note [The
# model's measured error] in remat.api.margins). The profile's notes, and so the plan's, give both steps' backward
# times.
LONG_STEP_S = 1.0


def _least(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: min(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {*a, *b}}


def time_units(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, units: list[str],
    checkpointed: list[str], mutated: dict[str, tuple[str, ...]], steps: int, forward_calls: dict[str, int],
    distributed: bool = False, warm_ops: tuple[LoggedOp, ...] | None = None, notes: list[str] | None = None,
) -> tuple[UnitTimes, tuple[LoggedOp, ...]]:
    """Real forward + backward with ``checkpointed`` units checkpointed (mutates ``model``'s forwards: run
    it under ``remat.runtime.state.preserved``); per-unit times from hooks on ``units`` (a unit's forward time is
    the sum over its ``forward_calls`` calls, default 1). Also returns the operators of the real forward
    with their sizes and the least of two timings of each (selective checkpointing's recompute cost).
    ``distributed``: the model is wrapped by FSDP2 or DDP, whose hooks expect a backward after every
    forward: no forward-only pass. ``warm_ops``: the operators of a plain forward already logged, whose times
    are each operator's second timing when the step is long (Note [Long steps are timed twice]). ``notes``: a
    long step's two hooked steps, with their backward times, are said there."""
    clock = Clock(device)
    targets = grad_targets(trainable_parameters(model), (args, kwargs))
    checkpoint_modules(model, checkpointed, mutated_buffers=mutated)
    mods = dict(model.named_modules())
    recompute: dict[str, float] = {}
    for name in checkpointed:
        mods[name].forward.recompute_timer = _recompute_timer(clock, recompute, name)
    pre = [*model.parameters(), *model.buffers(), *input_tensors(args, kwargs)]
    timer = _Timer(model, args, kwargs, loss_fn, device, clock, targets, mods, units, checkpointed, forward_calls,
                   recompute, pre)
    best, forward_ops, long = _hooked_steps(timer, steps, notes)
    if best is None:
        raise InternalError(f"none of the {steps} hooked steps was timed", stage="profile")
    # the step's own forward and backward, timed without hooks (their cost is not the model's): once, the
    # least with the hooked steps' (each real step here is one more call of the user's training step)
    if not long:
        timer.unhooked_step(best)
    forward_ops = _with_warm_times(timer, forward_ops, long, distributed, warm_ops)
    for name in checkpointed:
        mods[name].forward.recompute_timer = None
    times = UnitTimes(forward_s=best["forward"], recompute_s=best["recompute"], backward_s=best["backward"],
                      mutated_buffers=best["mutated"], step_forward_s=best["step_forward"],
                      step_backward_s=best["step_backward"])
    return times, forward_ops


def _recompute_timer(clock: Clock, recompute: dict[str, float], name: str):
    """A checkpointed unit's recompute timer: its recomputation's time, into ``recompute``."""
    @contextlib.contextmanager
    def timer():
        t0 = clock.mark()
        try:
            yield
        finally:
            recompute[name] = clock.seconds(t0, clock.mark())
    return timer


def _hooked_steps(timer: _Timer, steps: int, said: list[str] | None = None) -> \
        tuple[dict[str, Any] | None, tuple[LoggedOp, ...], bool]:
    """The hooked steps: the least of each time over them, the operators step 0 logged, and whether the step
    was long (Note [Long steps are timed twice]: then two steps, each time the lesser of the two). ``said``: a long
    step's two backward times are appended to it (the profile's notes)."""
    best: dict[str, Any] | None = None
    first: dict[str, Any] | None = None
    forward_ops: tuple[LoggedOp, ...] = ()
    long = False  # Note [Long steps are timed twice]
    for step in range(max(2, steps)):  # step 0 logs the operators and warms up; the others are timed
        timing, ops = timer.hooked_step(log_ops=step == 0)
        if ops is not None:
            forward_ops = ops
        if step == 0:
            first = timing
            long = timing["step_forward"] + timing["step_backward"] >= LONG_STEP_S
        elif step == 1 and long:
            if said is not None:
                said.append(_long_note(first, timing))
            return _lesser(timing, first), forward_ops, long
        else:
            best = timing if best is None else _lesser(best, timing)
    return best, forward_ops, long


def _long_note(first: dict[str, Any], second: dict[str, Any]) -> str:
    """The profile's note on a long step's hooked steps (Note [Long steps are timed twice])."""
    step_s = second["step_forward"] + second["step_backward"]
    return (f"timed on 2 hooked steps of {step_s:.2f} s, each time the lesser of the two (the logging step's "
            f"backward read {first['step_backward']:.2f} s, the next one's {second['step_backward']:.2f} s: Note "
            "[Long steps are timed twice] in remat.profile.timing)")


def _lesser(best: dict[str, Any], timing: dict[str, Any]) -> dict[str, Any]:
    """Each time the lesser of two hooked steps' (the buffers each unit changes: ``best``'s)."""
    return dict(mutated=best["mutated"], forward=_least(best["forward"], timing["forward"]),
                recompute=_least(best["recompute"], timing["recompute"]),
                backward=_least(best["backward"], timing["backward"]),
                step_forward=min(best["step_forward"], timing["step_forward"]),
                step_backward=min(best["step_backward"], timing["step_backward"]))


def _with_warm_times(timer: _Timer, forward_ops: tuple[LoggedOp, ...], long: bool, distributed: bool,
                     warm_ops: tuple[LoggedOp, ...] | None) -> tuple[LoggedOp, ...]:
    """The logged operators, each timed the least of its two timings."""
    model, args, kwargs, loss_fn = timer.model, timer.args, timer.kwargs, timer.loss_fn
    # each operator's time again, warm (step 0's were the first calls): keep the lesser of the two
    # (not for a model wrapped by FSDP2 or DDP: a forward without backward leaves FSDP2's parameters
    # unsharded and DDP waiting for a reduction; its operator times only rank selective options, which the
    # hooks path such models take does not offer); a long step's are the plain forward's, given by the caller
    new_step()
    warm = warm_ops if long and warm_ops is not None else () if distributed else \
        log_forward(lambda: loss_fn(model(*args, **kwargs)), timer.device, timer.pre)
    new_step()
    if [o.name for o in warm] == [o.name for o in forward_ops]:
        forward_ops = tuple(LoggedOp(a.name, a.sizes, min(a.seconds, b.seconds)) for a, b in zip(forward_ops, warm))
    return forward_ops


@dataclass(frozen=True)
class _Timer:
    """What time_units' steps share: the step, the clock, the hooked units and the checkpointed ones, and the
    recomputation times their recompute timers write (``recompute``)."""

    model: nn.Module
    args: tuple
    kwargs: dict
    loss_fn: LossFn
    device: torch.device
    clock: Clock
    targets: Any
    mods: dict[str, nn.Module]
    units: list[str]
    checkpointed: list[str]
    forward_calls: dict[str, int]
    recompute: dict[str, float]
    pre: list[torch.Tensor]

    def hooked_step(self, log_ops: bool) -> tuple[dict[str, Any], tuple[LoggedOp, ...] | None]:
        """One step with hooks on the units: its times, and its forward's operators when ``log_ops``."""
        clock, mods, forward_calls, recompute = self.clock, self.mods, self.forward_calls, self.recompute
        cuda = self.device.type == "cuda"
        calls: dict[str, int] = defaultdict(int)
        starts: dict[tuple[str, int], Any] = {}
        fwd: dict[str, float] = {}
        grad_at: dict[tuple[str, str], float] = {}
        buf_before: dict[str, list[tuple[str, torch.Tensor]]] = {}
        changed: dict[str, tuple[str, ...]] = {}

        def on_grad(key):
            def hook(g):
                grad_at.setdefault(key, clock.mark())
            return hook

        def enter(name, a):
            calls[name] += 1
            if calls[name] == 1:
                # some kernels (native_batch_norm) update buffers without saying so in their schema
                with outside_dispatch_modes():  # profiler bookkeeping: not the step's operators
                    buf_before[name] = [(n, b.detach().clone()) for n, b in mods[name].named_buffers() if b is not None]
                if not cuda:
                    for t in input_tensors((a,), {}):
                        if t.requires_grad:
                            t.register_hook(on_grad((name, "in")))
            starts[(name, calls[name])] = clock.mark()

        def leave(name, o):
            k = calls[name]
            dt = clock.seconds(starts[(name, k)], clock.mark()) if (name, k) in starts else 0.0
            if 1 < k <= forward_calls.get(name, 1):  # later calls of a reused module (Note [Reused modules])
                fwd[name] += dt
            if k == 1:
                fwd[name] = dt
                now_bufs = dict(mods[name].named_buffers())
                with outside_dispatch_modes():
                    changed[name] = tuple(n for n, old in buf_before.pop(name, []) if not torch.equal(old, now_bufs[n]))
                if not cuda:
                    for t in input_tensors((o,), {}):
                        if t.requires_grad:
                            t.register_hook(on_grad((name, "out")))
            elif k == forward_calls.get(name, 1) + 1:
                recompute[name] = dt

        handles = hook_units(self.model, self.units, enter, leave)
        log = ForwardLog(self.device, self.pre) if log_ops else None
        marks: dict[str, Any] = {}
        try:
            marks["start"] = clock.mark()
            with fresh_grads(self.targets):
                run_step(self.model, self.args, self.kwargs, self.loss_fn, forward_context=log,
                         on=lambda event: marks.__setitem__(event, clock.mark()))
        finally:
            for h in handles:
                h.remove()
        # gradient arrival at the unit's input less at its output, less the recomputation inside it
        bwd = {u: grad_at[(u, "in")] - grad_at[(u, "out")] - (recompute.get(u, 0.0) if u in self.checkpointed else 0.0)
               for u in self.units if (u, "in") in grad_at and (u, "out") in grad_at}
        timing = dict(mutated=changed, forward=fwd, recompute=dict(recompute), backward=bwd,
                      step_forward=clock.seconds(marks["start"], marks["loss"]),
                      step_backward=clock.seconds(marks["loss"], marks["backward"]))
        return timing, log.ops if log is not None else None

    def unhooked_step(self, best: dict[str, Any]) -> None:
        """One step without hooks: ``best``'s step times become the least with its own."""
        clock = self.clock
        marks = {"start": clock.mark()}
        with fresh_grads(self.targets):
            run_step(self.model, self.args, self.kwargs, self.loss_fn,
                     on=lambda event: marks.__setitem__(event, clock.mark()))
        best["step_forward"] = min(best["step_forward"], clock.seconds(marks["start"], marks["loss"]))
        best["step_backward"] = min(best["step_backward"], clock.seconds(marks["loss"], marks["backward"]))


def checkpoint_overhead(device: torch.device, reps: int = 30) -> CheckpointOverhead:
    """Note [Checkpoint overhead]: torch.utils.checkpoint's own bookkeeping per call (frame, RNG state,
    hooks) and per saved tensor (pack, unpack, recomputed-tensor checks), measured on this machine
    with tiny functions: checkpointed minus plain minus the recompute itself. On the 2-core CPU used
    here: about 120 us and 14 us, so a GPT block's checkpoint costs ~0.7 ms beyond its recompute. Also
    what a selective policy adds per operator (:func:`selective_overhead`). A property of the machine and
    the torch build: measured once per process and device (0.3-1.6 s), then reused."""
    return _checkpoint_overhead(str(device), reps)


@functools.lru_cache(maxsize=None)
def _checkpoint_overhead(device_name: str, reps: int) -> CheckpointOverhead:
    with one_thread():  # tiny operators: the host's cost, not the arithmetic's
        return _measured_overhead(torch.device(device_name), reps)


def _measured_overhead(device: torch.device, reps: int) -> CheckpointOverhead:
    from torch.utils.checkpoint import checkpoint

    def chain(k):
        def f(x):
            for _ in range(k):
                x = torch.sin(x)
            return x
        return f

    x = torch.randn(4, device=device, requires_grad=True)
    overhead = {}
    for k in (1, 16):
        f = chain(k)
        plain = lambda: f(x).sum().backward()  # noqa: E731
        ckpt = lambda: checkpoint(f, x, use_reentrant=False).sum().backward()  # noqa: E731
        fwd = lambda: f(x)  # noqa: E731
        for fn in (plain, ckpt, fwd):
            median_time(fn, device, reps)  # warm up
        overhead[k] = median_time(ckpt, device, reps) - median_time(plain, device, reps) - median_time(fwd, device, reps)
    per_tensor = max((overhead[16] - overhead[1]) / 15, 0.0)
    # the CPU RNG state each call saves (preserve_rng_state) is device memory only when the device is the CPU
    held = torch.get_rng_state().untyped_storage().nbytes() if torch.device(device).type == "cpu" else 0
    return CheckpointOverhead(max(overhead[1] - per_tensor, 0.0), per_tensor, selective_overhead(device, reps),
                              held_bytes=held)


def selective_overhead(device: torch.device, reps: int = 30) -> float:
    """Seconds per operator that selective checkpointing adds over plain checkpointing (its policy and
    cache run for every operator in forward and in the recomputation), measured on a tiny
    transformer-like block (layer norm, linear, matmul, softmax, gelu, residual: operators with several
    tensor arguments, which cost the dispatch mode more than single-argument ones; ~30% more per
    operator than a chain of ``sin`` on the CPU here) whose policy keeps every other operator."""
    from torch.utils.checkpoint import checkpoint

    def weight(*shape):
        return torch.randn(*shape, device=device, requires_grad=True)

    w1, w2, g, b = weight(8, 8), weight(8, 8), weight(8), weight(8)

    def f(x):
        for _ in range(2):
            h = torch.nn.functional.layer_norm(x, (8,), g, b)
            q = torch.nn.functional.linear(h, w1)
            a = torch.softmax(q @ q.transpose(-1, -2) / 3.0, dim=-1) @ q
            x = x + torch.nn.functional.linear(torch.nn.functional.gelu(a), w2)
        return x

    x = torch.randn(4, 8, device=device, requires_grad=True)
    ops = [op.name for op in log_forward(lambda: f(x), device, [x])]
    seen: dict[str, int] = defaultdict(int)
    keys = []
    for i, op in enumerate(ops):
        if i % 2 == 0:
            keys.append(op_key(op, seen[op]))
        seen[op] += 1
    policy = keep_ops(keys)
    runs = {
        False: lambda: checkpoint(f, x, use_reentrant=False).sum().backward(),
        True: lambda: checkpoint(f, x, use_reentrant=False, context_fn=policy).sum().backward(),
    }
    runs["forward"] = lambda: f(x)
    for fn in runs.values():
        median_time(fn, device, 3)  # warm up
    # interleaved, the least of each: a busy moment of a shared machine falls on one reading, not on one kind
    # (medians of 30 in a row read 0 and 124 us an operator minutes apart on two loaded cores)
    least = {key: float("inf") for key in runs}
    for _ in range(reps):
        for key, fn in runs.items():
            least[key] = min(least[key], median_time(fn, device, 1))
    # the selective recomputation skips the kept operators: add their share of the time back
    kept = len(keys) / len(ops)
    return max((least[True] - least[False] + least["forward"] * kept) / len(ops), 0.0)
