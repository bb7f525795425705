"""Profile: measure one training step of the model on its device, per unit.

Note [Timeline]
~~~~~~~~~~~~~~~
Memory is recorded by running forward, loss and backward once under a
:class:`remat.measure.StorageTracker` that numbers every dispatched operator (the
*timeline index*) and follows every storage created. Module hooks say which units are
running; ``saved_tensors_hooks`` say which storages autograd saves for backward, from
inside which units, and when backward first reads them back. That is all the simulator
needs (Note [Memory model] in ``remat.simulate``).

The recording runs under ``FakeTensorMode`` when it can: same operators, same storage
sizes, same frees, no device memory -- so profiling works when the plain step does not
fit, which is when users need remat. Models with data-dependent control flow cannot run
on fake tensors; they are recorded for real, at the plain step's peak (recorded in
``Profile.memory_recorded_with``).

Time is measured for real, with every top-level candidate unit checkpointed (so its
memory stays near the least-memory plan's): each unit's forward is timed by module hooks
on its first call, its recomputation on the second call that checkpointing makes in
backward. The plain backward time is the measured one less the recomputations.

Note [Loop style]
~~~~~~~~~~~~~~~~~
The training loop decides part of the peak, so remat records the loop the user runs:
``loss.backward()`` (not ``torch.autograd.grad``: a real backward lays gradients out as
``.grad`` does, e.g. channels-last copies for convolution weights) into gradients that start as
None (``zero_grad(set_to_none=True)``), backward outside autocast (Note [Autocast] in
remat.measure), and the model's output either kept until the step ends (``output_alive=True``:
``out = model(x); loss = crit(out, y); loss.backward(); opt.step()``) or dropped once the loss
is computed (``output_alive=False``: Hugging Face Trainer's ``compute_loss``, torchtitan's
``del pred``). The optimizer step starts from what is alive once backward has returned
(``Profile.after_backward_bytes``): the last backward operator's incoming gradient is gone by
then. The user's own ``.grad`` objects are set aside and given back (``remat.state.fresh_grads``).

Note [Segments]
~~~~~~~~~~~~~~~
Besides submodules, a unit can be a run of consecutive children of an ``nn.Sequential``
(``blocks[0:4]``), checkpointed as one piece like ``checkpoint_sequential``: it keeps only the
run's input, where checkpointing each child keeps every child's input. Segments are costed
from the same recording (their children are hooked too), and compete in the ILP with the
modules they overlap.

Nothing here mutates the model, its gradients, its buffers or the optimizer; RNG state is
restored (see ``remat.state``).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from remat._compat import outside_dispatch_modes
from remat.capture import ModelGraph, quiet_loggers, unit_parent
from remat.costs import SELECTIVE, CallSpan, Drop, Keep, Profile, UnitCost
from remat.errors import InvalidInputError
from remat.measure import StorageRecord, StorageTracker, new_step, outside_autocast, storage_key, tensor_bytes
from remat.optimizer import optimizer_costs
from remat.rewrite import KeepOps, checkpoint_modules, draws_random, segment_name
from remat.solve import chen_segments
from remat.state import fresh_grads, preserved

log = logging.getLogger(__name__)

LossFn = Callable[[Any], torch.Tensor]


@dataclass
class _Pack:
    """One tensor saved for backward."""

    rec: StorageRecord | None
    stack: tuple[str, ...]
    #: operators run when it was saved (the saving operator is the one before)
    at: int = 0
    unpacked_at: int | None = None
    #: per entry of ``stack``, which call of that unit was running (1 = the first)
    calls: tuple[int, ...] = ()


class _Recorder(StorageTracker):
    """StorageTracker that also knows the running units, input uses, in-place writes and FLOPs."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, count_fake=True)
        self.keep_timeline = True
        self.stack: list[str] = []
        self.backward = False
        self.calls: dict[str, int] = defaultdict(int)
        #: first-call forward span [first, last operator] of each unit (= ``spans[u][0]``)
        self.span: dict[str, list[int]] = {}
        #: forward span of every call of each unit, in call order (Note [Reused modules])
        self.spans: dict[str, list[list[int]]] = defaultdict(list)
        #: call number of each entry of ``stack``
        self.stack_calls: list[int] = []
        self.last_use: dict[int, int] = {}  # id(record) -> index of last forward operator reading it
        self.packs: list[_Pack] = []
        #: storages that existed before recording: storage key -> (kind, qualified name)
        self.preexisting: dict[int, tuple[str, str]] = {}
        #: (unit stack, storage key, record or None, op name) of every in-place write during forward
        self.writes: list[tuple[tuple[str, ...], int, StorageRecord | None, str]] = []
        self.flops: dict[str, int] = defaultdict(int)
        #: per hooked module and forward call, the records of the tracked storages it took as inputs
        self.inputs: dict[str, list[list[StorageRecord]]] = defaultdict(list)
        #: (operator, records of the storages it created) of every forward operator
        self.forward_ops: list[tuple[str, list[StorageRecord | None]]] = []
        #: forward operator index -> measured seconds on the real forward (set after timing)
        self.op_seconds: dict[int, float] = {}
        #: forward operators (timeline indices) that draw random numbers (dropout masks)
        self.random_ops: set[int] = set()

    # module hooks
    def enter(self, name: str, args: Any = ()) -> None:
        self.calls[name] += 1
        if not self.backward:
            self.spans[name].append([self.index, self.index - 1])
            self.span.setdefault(name, self.spans[name][0])
            self.inputs[name].append([r for t in _tensors(args) if (r := self.by_key.get(storage_key(t))) is not None])
        self.stack.append(name)
        self.stack_calls.append(self.calls[name])

    def leave(self, name: str) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
            self.stack_calls.pop()
        if not self.backward and self.spans[name]:
            self.spans[name][-1][1] = self.index - 1

    # saved-tensor hooks
    def pack(self, t: torch.Tensor):
        rec = self.by_key.get(storage_key(t)) if t.device.type == self.device_type else None
        ev = _Pack(rec, tuple(self.stack), self.index, calls=tuple(self.stack_calls))
        self.packs.append(ev)
        return ev, t

    def unpack(self, packed):
        ev, t = packed
        if ev.unpacked_at is None:
            ev.unpacked_at = self.index
        return t

    def on_op(self, func, args, kwargs, out) -> None:
        if self.backward:
            return
        self.forward_ops.append((str(func), _new_records(self, out)))
        if draws_random(func, args, kwargs):
            self.random_ops.add(self.index)
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                rec = self.by_key.get(storage_key(t))
                if rec is not None:
                    self.last_use[id(rec)] = self.index
        schema = func._schema
        if schema.is_mutable and self.stack:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is None or not a.alias_info.is_write:
                    continue
                v = args[i] if i < len(args) else kwargs.get(a.name)
                for t in tree_flatten(v)[0]:
                    if isinstance(t, torch.Tensor):
                        key = storage_key(t)
                        self.writes.append((tuple(self.stack), key, self.by_key.get(key), str(func)))
        if self.stack:
            count = flop_registry.get(func._overloadpacket)
            if count is not None:
                try:
                    n = int(count(*args, **kwargs, out_val=out))
                except Exception:  # noqa: BLE001 - a FLOP formula that does not fit these arguments
                    n = 0
                for u in set(self.stack):
                    self.flops[u] += n


def _new_records(tracker: StorageTracker, out: Any) -> list[StorageRecord | None]:
    """For each tensor output of the current operator, the record of the storage it created, or None."""
    recs = []
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            r = tracker.by_key.get(storage_key(t))
            recs.append(r if r is not None and r.alloc_index == tracker.index else None)
    return recs


class _SizeLog(StorageTracker):
    """Logs each real forward operator: the sizes of the storages it creates (Note [Fake sizes]) and
    its wall time (for selective checkpointing's recompute cost)."""

    def __init__(self, device: torch.device, ignore) -> None:
        super().__init__(device, ignore=ignore)
        self.sync_cuda = torch.device(device).type == "cuda"
        self.ops: list[tuple[str, list[int | None], float]] = []

    def on_op(self, func, args, kwargs, out) -> None:
        sizes = [r.nbytes if r is not None else None for r in _new_records(self, out)]
        self.ops.append((str(func), sizes, self.last_op_s))


def _logged_ops(run, device: torch.device, ignore) -> list[tuple[str, list[int | None], float]]:
    """The operators ``run()`` dispatches, as ``_SizeLog`` logs them (its result is dropped)."""
    log = _SizeLog(device, ignore)
    with log:
        run()
    return log.ops


def _hook_units(model: nn.Module, units: list[str], enter, leave) -> list:
    mods = dict(model.named_modules())
    handles = []
    for name in units:
        m = mods[name]
        handles.append(m.register_forward_pre_hook(lambda mod, a, kw, name=name: enter(name, (a, kw)),
                                                   with_kwargs=True))
        handles.append(
            m.register_forward_hook(lambda mod, a, o, name=name: leave(name, o), always_call=True)
        )
    return handles


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _grad_targets(params: list[torch.Tensor], inputs: Any) -> list[torch.Tensor]:
    return params + [t for t in _tensors(inputs) if t.requires_grad and t.is_leaf]


def _record_memory(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device,
    units: list[str], fake: bool, extra: list[str] = (), output_alive: bool = True,
) -> tuple[_Recorder, int, list[str], int]:
    """Run forward + loss + backward once under the recorder, as the training loop does (Note [Loop
    style]): ``loss.backward()`` into gradients that start as None, the output dropped after the loss
    unless ``output_alive``. Returns the recorder, the backward start index, the names of the units
    that ran and the bytes still alive once backward has returned (what the optimizer step starts
    from)."""
    rec = _Recorder(device)
    named_params = dict(model.named_parameters(remove_duplicate=False))
    named_buffers = dict(model.named_buffers(remove_duplicate=False))
    if fake:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        conv = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        params = {n: conv(p) for n, p in named_params.items()}
        buffers = {n: conv(b) for n, b in named_buffers.items()}
        fargs, fkwargs = tree_map(conv, args), tree_map(conv, kwargs)
        ctx = mode
    else:
        params, buffers, fargs, fkwargs = named_params, named_buffers, args, kwargs
        ctx = torch.enable_grad()
    for kind, table in (("param", params), ("buffer", buffers)):
        for n, t in table.items():
            if t is not None:
                rec.preexisting.setdefault(storage_key(t), (kind, n))
    for i, t in enumerate(_tensors((fargs, fkwargs))):
        rec.preexisting.setdefault(storage_key(t), ("input", str(i)))
    rec.ignored.update(rec.preexisting)
    trainable = []
    seen = set()
    for n, p in params.items():
        if named_params[n].requires_grad and id(p) not in seen:
            seen.add(id(p))
            trainable.append(p)

    handles = _hook_units(model, list(dict.fromkeys([*units, *extra])), lambda n, a: rec.enter(n, a),
                          lambda n, o: rec.leave(n))
    targets = _grad_targets(trainable, (fargs, fkwargs))
    try:
        with ctx, torch.enable_grad(), fresh_grads(targets), rec, \
                torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
            new_step()
            if fake:
                out = torch.func.functional_call(model, {**params, **buffers}, fargs, fkwargs,
                                                 strict=False, tie_weights=True)
            else:
                out = model(*fargs, **fkwargs)
            loss = checked_loss(loss_fn, out)
            if not output_alive:
                out = None
            rec.backward = True
            backward_start = rec.index
            with outside_autocast():
                loss.backward()
            after_backward = rec.live_bytes
            for t in targets:
                r = rec.by_key.get(storage_key(t.grad)) if t.grad is not None else None
                if r is not None:
                    r.is_grad = True  # type: ignore[attr-defined]
            end = rec.index
            rec.timeline = rec.timeline[:end]
            del out, loss  # alive until the end of backward, as in a training loop
    finally:
        for h in handles:
            h.remove()
    return rec, backward_start, [u for u in units if u in rec.span], after_backward


def checked_loss(loss_fn: LossFn, out: Any) -> torch.Tensor:
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


def _timeline(records: list[StorageRecord], n: int, pick) -> tuple[int, ...]:
    diff = [0] * (n + 1)
    for r in records:
        if not pick(r) or r.alloc_index >= n:
            continue
        diff[r.alloc_index] += r.nbytes
        diff[min(r.free_index if r.free_index is not None else n, n)] -= r.nbytes
    out, acc = [], 0
    for i in range(n):
        acc += diff[i]
        out.append(acc)
    return tuple(out)


@dataclass
class _Timing:
    #: per unit, the buffers (relative names) whose values its first forward changed
    mutated_buffers: dict[str, tuple[str, ...]]
    forward_s: dict[str, float]
    recompute_s: dict[str, float]
    #: each real forward operator of the first step: name, sizes of the storages it created, seconds
    forward_sizes: list[tuple[str, list[int | None], float]]
    backward_s: dict[str, float]
    step_forward_s: float
    step_backward_s: float


def _measure_time(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device,
    units: list[str], checkpointed: list[str], mutated: dict[str, tuple[str, ...]], steps: int,
    forward_calls: dict[str, int] | None = None,
) -> _Timing:
    """Real forward + backward with ``checkpointed`` units checkpointed; per-unit times from hooks (a unit's
    forward time is the sum over its ``forward_calls`` calls, default 1)."""
    forward_calls = forward_calls or {}
    cuda = device.type == "cuda"
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]

    def now():
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    checkpoint_modules(model, checkpointed, mutated_buffers=mutated)
    mods = dict(model.named_modules())
    rec: dict[str, float] = {}

    def timer_for(name):
        @contextlib.contextmanager
        def timer():
            t0 = now()
            try:
                yield
            finally:
                rec[name] = now() - t0
        return timer

    for name in checkpointed:
        mods[name].forward.recompute_timer = timer_for(name)
    result = None
    sizes: list[tuple[str, list[int | None], float]] = []
    pre = list(model.parameters()) + list(model.buffers()) + _tensors((args, kwargs))
    for step in range(max(2, steps)):  # step 0 logs sizes and warms up; the others are timed
        calls: dict[str, int] = defaultdict(int)
        starts: dict[tuple[str, int], float] = {}
        fwd: dict[str, float] = {}
        grad_at: dict[tuple[str, str], float] = {}
        buf_before: dict[str, list[tuple[str, torch.Tensor]]] = {}
        changed: dict[str, tuple[str, ...]] = {}

        def on_grad(key):
            def hook(g):
                grad_at.setdefault(key, time.perf_counter())
            return hook

        def enter(name, a):
            calls[name] += 1
            if calls[name] == 1:
                # some kernels (native_batch_norm) update buffers without saying so in their schema
                with outside_dispatch_modes():  # profiler bookkeeping: not the step's operators
                    buf_before[name] = [(n, b.detach().clone()) for n, b in mods[name].named_buffers() if b is not None]
            if calls[name] == 1 and not cuda:
                for t in _tensors(a):
                    if t.requires_grad:
                        t.register_hook(on_grad((name, "in")))
            starts[(name, calls[name])] = now()

        def leave(name, o):
            k = calls[name]
            dt = now() - starts.get((name, k), time.perf_counter())
            if 1 < k <= forward_calls.get(name, 1):  # later calls of a reused module (Note [Reused modules])
                fwd[name] += dt
            if k == 1:
                fwd[name] = dt
                now_bufs = dict(mods[name].named_buffers())
                with outside_dispatch_modes():
                    changed[name] = tuple(n for n, old in buf_before.pop(name, [])
                                          if not torch.equal(old, now_bufs[n]))
                if not cuda:
                    for t in _tensors(o):
                        if t.requires_grad:
                            t.register_hook(on_grad((name, "out")))
            elif k == forward_calls.get(name, 1) + 1:
                rec[name] = dt

        handles = _hook_units(model, units, enter, leave)
        try:
            size_log = _SizeLog(device, pre) if step == 0 else contextlib.nullcontext()
            new_step()
            t0 = now()
            with size_log:
                out = model(*args, **kwargs)
                loss = loss_fn(out)
            t1 = now()
            if isinstance(size_log, _SizeLog):
                sizes = size_log.ops
            with outside_autocast():
                torch.autograd.grad(loss, _grad_targets(params, (args, kwargs)), allow_unused=True)
            t2 = now()
            del out, loss
        finally:
            for h in handles:
                h.remove()
        # gradient arrival at the unit's input less at its output, less the recomputation inside it
        bwd = {u: grad_at[(u, "in")] - grad_at[(u, "out")] - (rec.get(u, 0.0) if u in checkpointed else 0.0)
               for u in units if (u, "in") in grad_at and (u, "out") in grad_at}
        timing = _Timing(changed, fwd, dict(rec), sizes, bwd, t1 - t0, t2 - t1)
        if step == 1:
            result = timing
        elif step > 1:  # the least of the timed steps: CPU timings are noisy upwards, never downwards
            result = _min_timing(result, timing)
    assert result is not None
    # the step's own forward and backward, timed without hooks (their cost is not the model's)
    for _ in range(2):
        new_step()
        t0 = now()
        out = model(*args, **kwargs)
        loss = loss_fn(out)
        t1 = now()
        with outside_autocast():
            torch.autograd.grad(loss, _grad_targets(params, (args, kwargs)), allow_unused=True)
        t2 = now()
        del out, loss
        result.step_forward_s = min(result.step_forward_s, t1 - t0)
        result.step_backward_s = min(result.step_backward_s, t2 - t1)
    # each operator's time again, warm (step 0's were the first calls): keep the lesser of the two
    new_step()
    warm = _logged_ops(lambda: loss_fn(model(*args, **kwargs)), device, pre)
    new_step()
    if [o[0] for o in warm] == [o[0] for o in result.forward_sizes]:
        result.forward_sizes = [(f, sz, min(t, t2)) for (f, sz, t), (_, _, t2) in zip(result.forward_sizes, warm)]
    for name in checkpointed:
        mods[name].forward.recompute_timer = None
    return result


def _min_timing(a: _Timing, b: _Timing) -> _Timing:
    def lo(x: dict[str, float], y: dict[str, float]) -> dict[str, float]:
        return {k: min(x[k], y[k]) if k in x and k in y else x.get(k, y.get(k)) for k in {*x, *y}}
    return _Timing(a.mutated_buffers, lo(a.forward_s, b.forward_s), lo(a.recompute_s, b.recompute_s),
                   a.forward_sizes, lo(a.backward_s, b.backward_s), min(a.step_forward_s, b.step_forward_s),
                   min(a.step_backward_s, b.step_backward_s))


@dataclass(frozen=True)
class _Spec:
    """A unit to cost: a module (members = itself) or a segment of a Sequential (members = children)."""

    name: str
    members: tuple[str, ...]
    parent: str | None
    #: prefix of buffer names relative to the unit's module (the Sequential's for a segment)
    scope: str
    #: for a selective unit (``h.3@ops2``), the forward operators (timeline indices) whose outputs its
    #: policy keeps (Note [Selective checkpointing] in remat.rewrite); None for a whole unit
    keep: frozenset[int] | None = None
    #: the same operators as the rewrite names them (``aten.addmm.default#1``)
    saved_ops: tuple[str, ...] = ()

    @property
    def selective(self) -> bool:
        return self.keep is not None


def _segments(n: int, container_is_unit: bool) -> list[tuple[int, int]]:
    """Candidate segments of a Sequential with ``n`` children (Note [Segments]): every run of two or
    more children up to 12 children, else runs of each length aligned at multiples of it; always
    Chen's sqrt(n) segments; never the whole container when it is a unit itself."""
    out: set[tuple[int, int]] = set()
    if n <= 12:
        out = {(i, j) for i in range(n) for j in range(i + 2, n + 1)}
    else:
        for size in range(2, n):
            out |= {(i, min(i + size, n)) for i in range(0, n, size) if min(i + size, n) - i >= 2}
    out |= set(chen_segments(n))
    if container_is_unit:
        out.discard((0, n))
    return sorted(out)


def _specs(rec: "_Recorder", ran: list[str], sequentials: dict[str, list[str]]) -> list[_Spec]:
    """Module units that ran, then the segments of each Sequential that ran once with its children
    back to back (Note [Segments])."""
    specs = [_Spec(u, (u,), unit_parent(u, ran), u + ".") for u in ran]
    for container, children in sequentials.items():
        if container and rec.calls.get(container, 0) != 1:
            continue
        if any(rec.calls.get(c, 0) != 1 for c in children):
            continue
        if any(rec.span[b][0] != rec.span[a][1] + 1 for a, b in zip(children, children[1:])):
            continue
        parent = container if container in ran else unit_parent(container, ran)
        scope = container + "." if container else ""
        for i, j in _segments(len(children), container in ran):
            specs.append(_Spec(segment_name(container, i, j), tuple(children[i:j]), parent, scope))
    return specs


def _unit_costs(rec: _Recorder, specs: list[_Spec]) -> dict[str, dict[str, Any]]:
    """Per unit: its forward span, where its recomputation would run, what checkpointing it frees,
    and whether it may be checkpointed at all (see Note [Memory model] in remat.simulate).

    Note [Reused modules]: a module called more than once per forward (a shared MLP, ALBERT's one
    layer) is checkpointed call by call (each call is its own checkpoint, recomputed when backward
    first reads a tensor saved by that call, with its own RNG state). Its cost is the sum of its
    calls': each call frees its own saved tensors until its own recomputation (``Drop.until_index``),
    keeps its own inputs, and adds its own recomputation row (``UnitCost.later_calls``)."""
    n = len(rec.timeline)
    live = _timeline(rec.records, n, lambda r: True)
    packs_of: dict[int, list[_Pack]] = defaultdict(list)
    for ev in rec.packs:
        if ev.rec is not None:
            packs_of[id(ev.rec)].append(ev)
    # the forward operator (timeline index) that created each storage
    made_by = {id(r): i for i, (_, recs) in enumerate(rec.forward_ops) for r in recs if r is not None}
    unit_costs: dict[str, dict[str, Any]] = {}
    for spec in specs:
        u, members = spec.name, spec.members
        inside = (lambda stack, m=members[0]: m in stack) if len(members) == 1 else \
            (lambda stack, ms=frozenset(members): not ms.isdisjoint(stack))
        calls = max(rec.calls[m] for m in members)
        forward_calls = len(rec.spans[members[0]])
        if len(members) == 1:
            spans = [tuple(sp) for sp in rec.spans[members[0]]]
        else:
            spans = [(rec.span[members[0]][0], rec.span[members[-1]][1])]

        def in_call(ev: _Pack, c: int, m: str = members[0]) -> bool:
            if not inside(ev.stack):
                return False
            return len(spans) == 1 or ev.calls[ev.stack.index(m)] == c + 1

        effects = [_call_effects(rec, spec, lambda ev, c=c: in_call(ev, c), start, end,
                                 rec.inputs[members[0]][c] if c < len(rec.inputs[members[0]]) else [],
                                 n, live, packs_of, made_by, until=len(spans) > 1)
                   for c, (start, end) in enumerate(spans)]
        first = effects[0]
        start, end = spans[0]
        excluded = None
        mutated: set[str] = set()
        if calls != forward_calls:
            excluded = f"called {calls} times per step, {forward_calls} in forward"
        elif forward_calls > 1 and spec.selective:
            excluded = "selective policies are per call sequence: not offered for a module called more than once"
        for stack, key, r, op in rec.writes:
            if not inside(stack):
                continue
            kind = rec.preexisting.get(key)
            if kind is not None and kind[0] == "buffer" and any(kind[1].startswith(m + ".") for m in members):
                mutated.add(kind[1][len(spec.scope):])
            elif kind is not None:
                excluded = excluded or f"modifies a tensor from outside the unit in place ({kind[0]} {kind[1]}, {op})"
            elif r is not None and r.alloc_index < start:
                excluded = excluded or f"modifies its input in place ({op})"
        saved = {id(r): r for e in effects for r in e["saved"]}
        unit_costs[u] = dict(
            name=u, parent=spec.parent, calls=forward_calls, flops=sum(rec.flops.get(m, 0) for m in members),
            forward_start=start, forward_end=end, recompute_at=first["r_at"],
            drops=tuple(d for e in effects for d in e["drops"]),
            recompute_peak_bytes=first["peak_inc"], saved_bytes=sum(r.nbytes for r in saved.values()),
            excluded=excluded, mutated_buffers=tuple(sorted(mutated)),
            members=members if members != (u,) and not spec.selective else (),
            keeps=tuple(k for e in effects for k in e["keeps"]), release=first["release"],
            saved_count=sum(e["packs"] for e in effects), op_count=end - start + 1, recompute_end=first["end_rec"],
            saved_ops=spec.saved_ops,
            later_calls=tuple(CallSpan(sp[0], sp[1], e["r_at"], e["peak_inc"]) for sp, e in zip(spans[1:], effects[1:])),
        )
        if excluded and members == (u,):
            log.info("unit %s cannot be checkpointed: %s", u, excluded)
    return unit_costs


def _call_effects(rec: _Recorder, spec: _Spec, in_call, start: int, end: int, inputs: list[StorageRecord], n: int,
                  live: tuple[int, ...], packs_of: dict[int, list[_Pack]], made_by: dict[int, int],
                  until: bool) -> dict[str, Any]:
    """What checkpointing one forward call ``start..end`` of a unit does to memory (Note [Memory model]
    in remat.simulate); ``in_call(pack)`` says whether a saved tensor was saved by that call. ``until``:
    the unit runs more than once, so each drop says when its own call is recomputed (Note [Reused
    modules])."""
    packs = [ev for ev in rec.packs if in_call(ev)]
    unpacks = [ev.unpacked_at for ev in packs if ev.unpacked_at is not None]
    r_at = min(unpacks) if unpacks else None
    saved = {id(ev.rec): ev.rec for ev in packs if ev.rec is not None}
    drops = []
    for r in saved.values():
        if getattr(r, "is_grad", False) or not (start <= r.alloc_index <= end) or r_at is None:
            continue
        # Note [Held storages]: a storage the plain step never frees is held by something besides
        # autograd (the output, the autocast cache's casts of the weights, a module attribute):
        # checkpointing does not free it either.
        if r.free_index is None or r.free_index >= n:
            continue
        # Note [Shared saved storages]: a storage that operators outside the unit also save
        # dies, once the unit is checkpointed, when the last of those releases it (just after
        # its backward operator first reads it); one that is never read back stays.
        outside = [ev.unpacked_at for ev in packs_of[id(r)] if not in_call(ev)]
        if any(t is None for t in outside):
            continue
        free_from = max(end + 1, rec.last_use.get(id(r), -1) + 1, max(outside, default=-1) + 1)
        if free_from >= r_at or (r.free_index is not None and r.free_index <= r_at):
            continue
        if spec.keep is not None and made_by.get(id(r)) in spec.keep:
            continue  # a selective checkpoint keeps it
        drops.append(Drop(r.nbytes, free_from, r_at if until else None))
    # Note [Checkpoint holds its inputs]: non-reentrant checkpoint keeps the unit's inputs in its
    # recompute closure, alive while any tensor saved inside the unit waits to be read back: until
    # the unit's backward is done, or, when some saved tensor is never read (a node that no
    # gradient reaches), until the graph is released at the end of the step. Inputs the plain
    # step frees earlier are kept that long.
    release = max(unpacks) + 1 if unpacks and all(ev.unpacked_at is not None for ev in packs) else n
    keeps = tuple(
        Keep(r.nbytes, r.free_index, release)
        for r in {id(r): r for r in inputs}.values()
        if r_at is not None and r.free_index is not None and r.free_index < release
    )
    if spec.keep is not None and r_at is not None:
        # the selective checkpoint caches every output of a kept operator until the recomputation
        # reads it back, also those the plain step frees early (Note [Selective checkpointing])
        keeps += tuple(
            Keep(r.nbytes, r.free_index, r_at) for r in rec.records
            if made_by.get(id(r)) in spec.keep and r.free_index is not None and r.free_index < r_at
        )
    base = live[start - 1] if start > 0 else 0
    # Note [Early stop]: non-reentrant checkpoint stops recomputing once the last tensor saved
    # inside the unit exists again, so what the unit allocates after that is not recomputed.
    end_rec = min(end, max((ev.at - 1 for ev in packs if ev.at - 1 >= start), default=end))
    if spec.keep is not None:
        # a selective recomputation reuses the cached outputs of kept operators: they add nothing
        cached = [r for r in rec.records if made_by.get(id(r)) in spec.keep]
        peak_inc = max((live[t] - sum(r.nbytes for r in cached if r.alloc_index <= t and
                                      (r.free_index is None or t < r.free_index))
                        for t in range(start, end_rec + 1)), default=base) - base
    else:
        peak_inc = max(live[start:end_rec + 1], default=base) - base
    return dict(r_at=r_at, drops=drops, keeps=keeps, release=release, end_rec=end_rec, peak_inc=max(peak_inc, 0),
                saved=list(saved.values()), packs=len(packs))


def _align_forward(rec: _Recorder, real: list[tuple[str, list[int | None], float]]) -> dict[int, int]:
    """Recorded forward operator index -> index of the same operator in the real forward."""
    matcher = difflib.SequenceMatcher(None, [f for f, _ in rec.forward_ops], [o[0] for o in real], autojunk=False)
    return {block.a + k: block.b + k for block in matcher.get_matching_blocks() for k in range(block.size)}


def _plain_forward_ops(model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn,
                       device: torch.device) -> list[tuple[str, list[int | None], float]]:
    """The operators of one real plain forward and loss (no hooks, no checkpointing: checkpointed
    forwards run plainly without grad), as ``_SizeLog`` logs them; model, buffers and RNG restored."""
    pre = list(model.parameters()) + list(model.buffers()) + _tensors((args, kwargs))
    with preserved(model), torch.no_grad():
        new_step()
        return _logged_ops(lambda: loss_fn(model(*args, **kwargs)), device, pre)


def _plain_step_fits(model: nn.Module, args: tuple, kwargs: dict, rec: _Recorder, device: torch.device) -> bool:
    """Whether a real plain step fits the device, by the fake recording's peak plus 10% (always on CPU)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return 1.1 * max(rec.timeline, default=0) <= free


def _ops_summary(ops: list[str]) -> str:
    counts: dict[str, int] = defaultdict(int)
    for op in ops:
        counts[op.split(".")[1] if op.count(".") >= 2 else op] += 1
    return ", ".join(f"{n} x{c}" for n, c in sorted(counts.items(), key=lambda kv: -kv[1])[:4])


def _diverged(rec: _Recorder, real: list[tuple[str, list[int | None], float]]) -> list[str]:
    """Note [Fake paths]: the allocating operators of the real forward that the fake recording does not
    have, or the other way round (a data-dependent branch taken differently), by name; empty when the
    two forwards allocate through the same operators in the same order."""
    fake_ops = [f for f, recs in rec.forward_ops if any(r is not None for r in recs)]
    real_ops = [f for f, sizes, _ in real if any(b is not None for b in sizes)]
    if fake_ops == real_ops:
        return []
    sm = difflib.SequenceMatcher(None, fake_ops, real_ops, autojunk=False)
    return [op for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag != "equal"
            for op in fake_ops[i1:i2] + real_ops[j1:j2]]


def _calibrate_sizes(rec: _Recorder, real: list[tuple[str, list[int | None], float]], match: dict[int, int]) -> int:
    """Note [Fake sizes]: a few kernels allocate differently from their fake implementation (CPU
    ``mse_loss`` returns a 0-d view of an input-sized buffer). Take the real storage sizes of the
    operators matched between the recorded and the real forward. Returns how many were corrected."""
    fixed = 0
    for i, j in match.items():
        for r, nbytes in zip(rec.forward_ops[i][1], real[j][1]):
            if r is not None and nbytes is not None and r.nbytes != nbytes:
                r.nbytes = nbytes
                fixed += 1
    return fixed


def _median_time(fn, device: torch.device, reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn`` (seconds), synchronising CUDA around each."""
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def checkpoint_overhead(device: torch.device, reps: int = 30) -> tuple[float, float]:
    """Note [Checkpoint overhead]: torch.utils.checkpoint's own bookkeeping per call (frame, RNG state,
    hooks) and per saved tensor (pack, unpack, recomputed-tensor checks), measured on this machine
    with tiny functions: checkpointed minus plain minus the recompute itself. Returns (seconds per
    call, seconds per saved tensor). On the 2-core CPU used here: about 120 us and 14 us, so a GPT
    block's checkpoint costs ~0.7 ms beyond its recompute."""
    from torch.utils.checkpoint import checkpoint

    def chain(k):
        def f(x):
            for _ in range(k):
                x = torch.sin(x)
            return x
        return f

    def timed(fn):
        return _median_time(fn, device, reps)

    x = torch.randn(4, device=device, requires_grad=True)
    overhead = {}
    for k in (1, 16):
        f = chain(k)
        plain = lambda: f(x).sum().backward()  # noqa: E731
        ckpt = lambda: checkpoint(f, x, use_reentrant=False).sum().backward()  # noqa: E731
        fwd = lambda: f(x)  # noqa: E731
        for fn in (plain, ckpt, fwd):
            timed(fn)  # warm up
        overhead[k] = timed(ckpt) - timed(plain) - timed(fwd)
    per_tensor = max((overhead[16] - overhead[1]) / 15, 0.0)
    return max(overhead[1] - per_tensor, 0.0), per_tensor


def _recompute_share(rec: _Recorder, start: int, end: int, keep: frozenset[int]) -> float:
    """Share of the measured forward time of operators ``start..end`` spent in operators a selective
    checkpoint runs again (those not in ``keep``); operators without a time count as 1 us."""
    total = again = 0.0
    for i in range(start, end + 1):
        t = rec.op_seconds.get(i, 1e-6)
        total += t
        if i not in keep:
            again += t
    return again / total if total > 0 else 1.0


#: operators whose outputs the hand policy keeps (by overload packet name): matrix products,
#: attention kernels, convolutions (Megatron-LM's "selective recomputation"); one of the policies
#: remat profiles per unit
SAVED_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "convolution", "_grouped_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
})

#: Note [Policy menus]: the shares of a unit's keepable operator time at which its greedy policies stop
POLICY_TIME_SHARES = (0.5, 0.75, 0.9, 1.0)


def _policy_menu(rec: _Recorder, start: int, end: int) -> list[frozenset[int]]:
    """Note [Policy menus]
    ~~~~~~~~~~~~~~~~~~~~~~
    The selective policies remat offers for one unit, as sets of forward operators (timeline
    indices) whose outputs are kept. Recomputing with a policy runs every operator it does not keep
    (``torch.utils.checkpoint``'s selective mode reruns the whole forward and hands back the kept
    outputs), so against checkpointing the whole unit, keeping operator ``i`` costs the bytes of its
    new storages until the recomputation and saves its measured time ``t_i``: a knapsack per unit.
    The menu is its greedy frontier: operators ranked by time saved per byte kept (matmuls first,
    cheap memory-heavy ops last), cut where the kept operators reach each share of the keepable time
    in POLICY_TIME_SHARES; plus the hand policy of the field (keep the matrix products, attention
    kernels and convolutions: SAVED_OPS). The ILP then costs each option exactly, against the
    whole-step memory model, and picks at most one option per unit.

    An operator is keepable when it creates storage (views and in-place ops allocate nothing), does
    not draw random numbers (Note [Selective checkpointing]: skipping a draw would shift the ones
    after it), and no operator modifies its output in place later in the forward (the cache refuses
    mutated entries). Only operators up to ``end``, the last one the recomputation runs (Note [Early
    stop]), are worth keeping."""
    written = {id(r) for _, _, r, _ in rec.writes if r is not None}
    ops: list[tuple[int, int, float]] = []  # (index, bytes created, seconds)
    for i in range(start, end + 1):
        new = [r for r in rec.forward_ops[i][1] if r is not None]
        if not new or i in rec.random_ops or any(id(r) in written for r in new):
            continue
        ops.append((i, sum(r.nbytes for r in new), rec.op_seconds.get(i, 0.0)))
    if len(ops) < 2:
        return []
    ranked = sorted(ops, key=lambda o: o[2] / max(o[1], 1), reverse=True)
    total = sum(t for _, _, t in ops)
    menu: list[frozenset[int]] = []
    for share in POLICY_TIME_SHARES:
        acc, kept = 0.0, []
        for i, _, t in ranked:
            if acc >= share * total and kept:
                break
            kept.append(i)
            acc += t
        menu.append(frozenset(kept))
    menu.append(frozenset(i for i, _, _ in ops if rec.forward_ops[i][0].split(".")[1] in SAVED_OPS))
    out: list[frozenset[int]] = []
    for keep in sorted(menu, key=lambda k: (-sum(b for i, b, _ in ops if i in k), sorted(k))):
        if keep and keep not in out:
            out.append(keep)
    return out


def _op_keys(rec: _Recorder, start: int, keep: frozenset[int]) -> tuple[str, ...]:
    """The rewrite's names of forward operators ``keep`` of a unit starting at ``start``: the
    overload and its call count within the unit (``aten.addmm.default#1``)."""
    seen: dict[str, int] = defaultdict(int)
    keys = []
    for i in range(start, max(keep) + 1):
        op = rec.forward_ops[i][0]
        if i in keep:
            keys.append(f"{op}#{seen[op]}")
        seen[op] += 1
    return tuple(keys)


def _selective_specs(rec: _Recorder, ran: list[str], costs: dict[str, dict[str, Any]]) -> list[_Spec]:
    """The selective options of every module unit that may be checkpointed (Note [Policy menus])."""
    specs = []
    for u in ran:
        c = costs[u]
        if c["excluded"] is not None or not c["drops"] or c["calls"] > 1:
            continue
        for k, keep in enumerate(_policy_menu(rec, c["forward_start"], c["recompute_end"]), start=1):
            specs.append(_Spec(f"{u}{SELECTIVE}{k}", (u,), c["parent"], u + ".", keep=keep,
                               saved_ops=_op_keys(rec, c["forward_start"], keep)))
    return specs


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
    ops = [op for op, _, _ in _logged_ops(lambda: f(x), device, [x])]
    seen: dict[str, int] = defaultdict(int)
    keys = []
    for i, op in enumerate(ops):
        if i % 2 == 0:
            keys.append(f"{op}#{seen[op]}")
        seen[op] += 1
    policy = KeepOps(keys)
    runs = {
        False: lambda: checkpoint(f, x, use_reentrant=False).sum().backward(),
        True: lambda: checkpoint(f, x, use_reentrant=False, context_fn=policy).sum().backward(),
    }
    med = {}
    for key, fn in runs.items():
        _median_time(fn, device, 3)  # warm up
        med[key] = _median_time(fn, device, reps)
    forward = _median_time(lambda: f(x), device, reps)
    # the selective recomputation skips the kept operators: add their share of the time back
    kept = len(keys) / len(ops)
    return max((med[True] - med[False] + forward * kept) / len(ops), 0.0)


def _autocast_enabled(device: torch.device) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device.type))
    except TypeError:  # torch < 2.4 takes no device type
        return bool(torch.is_autocast_enabled() if device.type == "cuda" else torch.is_autocast_cpu_enabled())


def profile_model(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    graph: ModelGraph,
    device: torch.device,
    timing_steps: int = 4,
    output_alive: bool = True,
) -> Profile:
    """Measure ``model``'s training step on the example inputs. Leaves the model, its gradients and
    buffers, the optimizer and the RNG state as they were."""
    notes: list[str] = []
    units = list(graph.units)
    mods = dict(model.named_modules())
    sequentials = {
        name: [f"{name}.{k}" if name else k for k in m._modules]
        for name, m in mods.items() if isinstance(m, nn.Sequential) and len(m) >= 2
    }
    extra = [c for children in sequentials.values() for c in children] + [c for c in sequentials if c]
    def record_real():
        return _record_memory(model, args, kwargs, loss_fn, device, units, fake=False, extra=extra,
                              output_alive=output_alive)

    def units_of(rec: _Recorder, ran: list[str]):
        ran.sort(key=lambda u: (rec.span[u][0], -rec.span[u][1]))  # forward order: each unit's first operator
        specs = _specs(rec, ran, sequentials)
        return specs, _unit_costs(rec, specs)

    with preserved(model):
        reason = None
        if _autocast_enabled(device):
            # Note [Autocast and fake tensors]: the autocast cache does not hold casts of fake weights,
            # so a fake recording casts weights again at every use where the real step reuses them.
            reason = "autocast is on"
        else:
            try:
                with quiet_loggers("torch._subclasses.fake_tensor"):  # a failure here is expected and handled
                    rec, bstart, ran, after_bwd = _record_memory(model, args, kwargs, loss_fn, device, units,
                                                                 fake=True, extra=extra, output_alive=output_alive)
                recorded = "fake"
            except InvalidInputError:
                raise
            except Exception as e:  # noqa: BLE001 - data-dependent code cannot run on fake tensors
                log.info("recording on fake tensors failed (%s: %s); recording a real step", type(e).__name__, e)
                reason = f"fake tensors failed: {type(e).__name__}"
        if reason is not None:
            notes.append(f"memory recorded on a real step ({reason}); profiling needed the plain step's peak")
            rec, bstart, ran, after_bwd = record_real()
            recorded = "real"
    specs, costs = units_of(rec, ran)

    # time, measured for real with the top-level candidate modules checkpointed
    # (a module called more than once is not checkpointed while timing: its recomputation is its forwards)
    cand = [u for u in ran if costs[u]["excluded"] is None and costs[u]["drops"] and costs[u]["calls"] == 1]
    top = [u for u in cand if unit_parent(u, cand) is None]
    timed = list(dict.fromkeys([*ran, *(c for c in extra if c in rec.span)]))
    with preserved(model):
        timing = _measure_time(
            model, args, kwargs, loss_fn, device, timed, top,
            {u: costs[u]["mutated_buffers"] for u in top}, timing_steps, {u: len(rec.spans[u]) for u in timed},
        )
    plain = _plain_forward_ops(model, args, kwargs, loss_fn, device) if recorded == "fake" else []
    diverged = _diverged(rec, plain) if recorded == "fake" else []
    if diverged and not _plain_step_fits(model, args, kwargs, rec, device):
        notes.append(f"the step took another path on fake tensors than on real ones ({_ops_summary(diverged)}), but "
                     "the plain step may not fit the device to record it for real: memory recorded on fake tensors")
    elif diverged:
        # Note [Fake paths]: code that branches on data takes another path on fake tensors, where the
        # value is unknown: Hugging Face builds an explicit attention mask when it cannot see that the
        # mask is all ones, and then repeats grouped keys/values instead of SDPA's enable_gqa (Qwen3:
        # 61 more operators, +3% memory). The real forward is the truth: record a real step instead, when
        # the plain step fits the device (on CPU, always; on CUDA, by the fake recording's peak).
        notes.append(f"the step took another path on fake tensors than on real ones ({_ops_summary(diverged)}): "
                     "memory recorded on a real step; profiling needed the plain step's peak")
        with preserved(model):
            rec, bstart, ran, after_bwd = record_real()
        recorded = "real"
        specs, costs = units_of(rec, ran)
    match = _align_forward(rec, timing.forward_sizes)
    rec.op_seconds = {i: timing.forward_sizes[j][2] for i, j in match.items()}
    if recorded == "fake":
        # sizes from the plain forward (the same operators as the recording, one for one, when it took the
        # same path), not from the timed one, whose checkpoint and buffer-snapshot clones can shift the
        # alignment: a ResNet-D stem's BatchNorm output once took another BatchNorm's size (+256 KiB)
        same = [f for f, _ in rec.forward_ops] == [o[0] for o in plain]
        fixed = _calibrate_sizes(rec, plain, {i: i for i in range(len(plain))} if same else _align_forward(rec, plain))
        if fixed:
            notes.append(f"{fixed} storage size(s) on fake tensors differed from the real kernels' and were "
                         "corrected from the real forward")
            costs = _unit_costs(rec, specs)
    for u in ran:
        costs[u]["mutated_buffers"] = tuple(sorted({*costs[u]["mutated_buffers"], *timing.mutated_buffers.get(u, ())}))
    if graph.capture_path == "hooks":
        # a policy names operators by their position in the unit's forward, which must not depend on
        # the data (Note [Selective checkpointing]); without a captured graph that is not known
        selective = []
        notes.append("no selective (op-level) options: the model could not be captured as a graph (its "
                     "operator sequence may depend on the data), so policies naming operators by position "
                     "are not offered")
    else:
        selective = _selective_specs(rec, ran, costs)
    costs.update(_unit_costs(rec, selective))
    specs = specs[:len(ran)] + selective + specs[len(ran):]
    n = len(rec.timeline)
    live = _timeline(rec.records, n, lambda r: True)
    # Note [Between operators]: what is alive just before each operator runs: the live bytes after it,
    # less what it allocated (frees between two operators are already counted against the earlier one)
    made = [0] * n
    for r in rec.records:
        if r.alloc_index < n:
            made[r.alloc_index] += r.nbytes
    before = tuple(max(v - a, 0) for v, a in zip(live, made))
    grad_tl = _timeline(rec.records, n, lambda r: getattr(r, "is_grad", False))
    packed_ids = {id(ev.rec) for ev in rec.packs if ev.rec is not None}
    saved_tl = _timeline(rec.records, n, lambda r: id(r) in packed_ids)
    unit_costs = costs
    opt = optimizer_costs(optimizer, device)
    if optimizer is None:
        notes.append("no optimizer given: optimizer state and step are not counted")

    buffer_bytes = {name: tensor_bytes([b], device) for name, b in model.named_buffers()}
    call_s, per_tensor_s = checkpoint_overhead(device)
    per_op_s = selective_overhead(device)
    units_out = []
    for spec in specs:
        c = unit_costs[spec.name]
        members = spec.members
        segment = members != (spec.name,) and not spec.selective  # a selective unit is its module
        c["mutated_buffers"] = tuple(sorted(set(c["mutated_buffers"]) | {
            f"{m[len(spec.scope):]}.{b}" if segment else b
            for m in members for b in timing.mutated_buffers.get(m, ())}))
        fwd = sum(timing.forward_s.get(m, 0.0) for m in members)
        # a unit not recomputed while timing (nested, or a segment's members) recomputes as it runs forward
        recompute = sum(timing.recompute_s.get(m, timing.forward_s.get(m, 0.0)) for m in members)
        if spec.selective:
            # only the operators it does not keep run again: their share of the unit's measured op time
            recompute *= _recompute_share(rec, c["forward_start"], c["recompute_end"], spec.keep)
        backward = None if segment else timing.backward_s.get(spec.name)
        # what the checkpoint itself holds per call (Note [Checkpoint holds its inputs]): the snapshot of
        # the buffers it replays (Note [Buffers replay]). (The CPU RNG state it saves, 5 KB, is made
        # outside the dispatcher: neither counted here nor by the CPU measurement.)
        held = sum(buffer_bytes.get(spec.scope + b, 0) for b in c["mutated_buffers"])
        if held:
            c["keeps"] = c["keeps"] + (Keep(held, c["forward_start"], c.pop("release")),)
        else:
            c.pop("release")
        overhead = call_s * c["calls"] + per_tensor_s * c.pop("saved_count")
        ops = c.pop("op_count")
        c.pop("recompute_end")
        if spec.selective:
            overhead += per_op_s * ops
        units_out.append(UnitCost(**c, forward_s=fwd, recompute_s=recompute, backward_s=backward,
                                  overhead_s=overhead))
    # the timed steps checkpointed the top-level units: take their recomputation and bookkeeping out
    by_name = {u.name: u for u in units_out}
    backward_s = max(timing.step_backward_s - sum(timing.recompute_s.get(u, 0.0) + by_name[u].overhead_s
                                                  for u in top), 0.0)
    trainable = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    return Profile(
        units=tuple(units_out),
        live_bytes=live,
        before_bytes=before,
        after_backward_bytes=after_bwd,
        output_alive=output_alive,
        grad_bytes=grad_tl,
        saved_bytes=saved_tl,
        backward_start=bstart,
        params_bytes=tensor_bytes(model.parameters()),
        grads_bytes=tensor_bytes(trainable),
        buffers_bytes=tensor_bytes(model.buffers()),
        inputs_bytes=tensor_bytes(_tensors((args, kwargs)), device),
        optimizer_state_bytes=opt.state_bytes,
        optimizer_step_bytes=opt.step_bytes,
        forward_s=timing.step_forward_s,
        backward_s=backward_s,
        optimizer_s=opt.step_s,
        device=str(device),
        capture_path=graph.capture_path,
        memory_recorded_with=recorded,
        optimizer=opt.label,
        notes=tuple(notes),
    )
