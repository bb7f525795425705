"""Record one training step into a :class:`remat.costs.recording.Recording`.

Note [Timeline]
~~~~~~~~~~~~~~~
Memory is recorded by running forward, loss and backward once under a
:class:`remat.runtime.measure.StorageTracker` that numbers every dispatched operator (the
*timeline index*) and follows every storage created. Module hooks say which units are
running; ``saved_tensors_hooks`` say which storages autograd saves for backward, from
inside which units, and when backward first reads them back. That is all
``remat.costs.effects`` needs (Note [Memory model] in ``remat.costs.simulate``).

The recording runs under ``FakeTensorMode`` when it can: same operators, same storage
sizes, same frees, no device memory -- so profiling works when the plain step does not
fit, which is when users need remat. Models with data-dependent control flow cannot run
on fake tensors; they are recorded for real, at the plain step's peak (recorded in
``Profile.memory_recorded_with``; see also Note [Fake paths] in ``remat.profile.calibrate``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from remat._compat import fake_mode, op_bytes, op_flops, storage_key, tree_flatten, tree_map, written_arguments
from remat.runtime.measure import LossFn, StorageRecord, StorageTracker, input_tensors, run_step
from remat.runtime.meters import CudaAllocator, InOperatorPeak
from remat.runtime.tracker import OperatorProbe
from remat.costs.recording import ForwardOp, Recording, SavedTensor, Storage, Write
from remat.rewrite import PolicyNames, draws_random
from remat.runtime.state import fresh_grads


@dataclass
class _Pack:
    """One tensor saved for backward, while recording (``unpacked_at`` is filled in by backward)."""

    rec: StorageRecord | None
    stack: tuple[str, ...]
    calls: tuple[int, ...]
    at: int
    unpacked_at: int | None = None


class _Recorder(StorageTracker):
    """StorageTracker that also knows the running units, input uses, in-place writes and FLOPs."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, count_fake=True)
        self.stack: list[str] = []
        #: call number of each entry of ``stack``
        self.stack_calls: list[int] = []
        self.backward = False
        self.calls: dict[str, int] = defaultdict(int)
        #: forward span of every call of each unit, in call order (Note [Reused modules] in remat.costs.effects)
        self.spans: dict[str, list[list[int]]] = defaultdict(list)
        self.last_use: dict[int, int] = {}  # id(record) -> index of last forward operator reading it
        self.packs: list[_Pack] = []
        #: storages that existed before recording: storage key -> (kind, qualified name)
        self.preexisting: dict[int, tuple[str, str]] = {}
        #: (unit stack, storage key, record or None, op name, op index) of every in-place write during forward
        self.writes: list[tuple[tuple[str, ...], int, StorageRecord | None, str, int]] = []
        self.flops: dict[str, int] = defaultdict(int)
        #: per hooked module and forward call, the records of the tracked storages it took as inputs
        self.inputs: dict[str, list[list[StorageRecord]]] = defaultdict(list)
        #: (operator, records of the storages it created, draws random numbers, named) of every forward operator
        self.forward_ops: list[tuple[str, list[StorageRecord | None], bool, bool, int, int]] = []
        #: every backward operator's name, FLOPs and bytes
        self.backward_ops: list[ForwardOp] = []
        self.names = PolicyNames()

    # module hooks
    def enter(self, name: str, args: Any = ()) -> None:
        self.calls[name] += 1
        if not self.backward:
            self.spans[name].append([self.index, self.index - 1])
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
        ev = _Pack(rec, tuple(self.stack), tuple(self.stack_calls), self.index)
        self.packs.append(ev)
        return ev, t

    def unpack(self, packed):
        ev, t = packed
        if ev.unpacked_at is None:
            ev.unpacked_at = self.index
        return t

    def on_op(self, func, args, kwargs, out) -> None:
        n, nbytes = op_flops(func, args, kwargs, out), op_bytes(func, args, kwargs, out)
        if self.backward:
            self.backward_ops.append(ForwardOp(str(func), (), flops=n, bytes_accessed=nbytes))
            return
        named = self.names.key(func, args, kwargs) is not None  # Note [Operators named alike under compile]
        self.forward_ops.append((str(func), new_records(self, out), draws_random(func, args, kwargs), named, n,
                                 nbytes))
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                rec = self.by_key.get(storage_key(t))
                if rec is not None:
                    self.last_use[id(rec)] = self.index
        if not self.stack:
            return
        for v in written_arguments(func, args, kwargs):
            for t in tree_flatten(v)[0]:
                if isinstance(t, torch.Tensor):
                    key = storage_key(t)
                    self.writes.append((tuple(self.stack), key, self.by_key.get(key), str(func), self.index))
        for u in set(self.stack):
            self.flops[u] += n

    def freeze(self, n_ops: int, backward_start: int, after_backward_bytes: int, grads: set[int]) -> Recording:
        """The immutable Recording of what was seen, up to timeline index ``n_ops``; ``grads``: ids of
        the records of the parameters' gradients."""
        index = {id(r): i for i, r in enumerate(self.records)}
        held = {id(r) for r in self.held_before()}

        def idx(r: StorageRecord | None) -> int | None:
            return None if r is None else index[id(r)]

        return Recording(
            n_ops=n_ops, backward_start=backward_start, after_backward_bytes=after_backward_bytes,
            # a storage held from before the step counts from its start (Note [Memory found] in remat.runtime.measure)
            storages=tuple(Storage(r.nbytes, 0 if id(r) in held else r.alloc_index, r.free_index,
                                   id(r) in grads, r.shape, r.dtype) for r in self.records),
            saved=tuple(SavedTensor(idx(p.rec), p.stack, p.calls, p.at, p.unpacked_at) for p in self.packs),
            forward_ops=tuple(ForwardOp(name, tuple(idx(r) for r in recs), random, named=named, flops=flops,
                                        bytes_accessed=nbytes)
                              for name, recs, random, named, flops, nbytes in self.forward_ops),
            writes=tuple(Write(stack, idx(r), self.preexisting.get(key), op, at)
                         for stack, key, r, op, at in self.writes),
            spans={u: tuple((a, b) for a, b in sp) for u, sp in self.spans.items() if sp},
            calls=dict(self.calls),
            inputs={u: tuple(tuple(index[id(r)] for r in call) for call in calls) for u, calls in self.inputs.items()},
            last_use={index[k]: v for k, v in self.last_use.items()},
            flops=dict(self.flops),
            backward_ops=tuple(self.backward_ops),
            transient_bytes={i: b for i, b in self.transients.items() if i < n_ops},
        )


def new_records(tracker: StorageTracker, out: Any) -> list[StorageRecord | None]:
    """For each tensor output of the current operator, the record of the storage it created, or None."""
    recs = []
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            r = tracker.by_key.get(storage_key(t))
            recs.append(r if r is not None and r.alloc_index == tracker.index else None)
    return recs


def hook_units(model: nn.Module, units: list[str], enter: Callable[[str, Any], None],
               leave: Callable[[str, Any], None]) -> list:
    """Forward pre-hooks and hooks on the named modules: ``enter(name, (args, kwargs))`` and
    ``leave(name, output)``. Returns the handles (remove them)."""
    mods = dict(model.named_modules())
    handles = []
    for name in units:
        m = mods[name]
        handles.append(m.register_forward_pre_hook(lambda mod, a, kw, name=name: enter(name, (a, kw)),
                                                   with_kwargs=True))
        handles.append(m.register_forward_hook(lambda mod, a, o, name=name: leave(name, o), always_call=True))
    return handles


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def grad_targets(params: list[torch.Tensor], inputs: Any) -> list[torch.Tensor]:
    """What a training step differentiates: the parameters and the inputs that are leaves requiring grad."""
    return params + [t for t in _tensors(inputs) if t.requires_grad and t.is_leaf]


def record_step(
    model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, device: torch.device, units: list[str], *,
    fake: bool, output_alive: bool = True, probe: OperatorProbe | None = None,
) -> Recording:
    """Run forward + loss + backward once under the recorder, as the training loop does (Note [Loop
    style] in remat.profile): ``loss.backward()`` into gradients that start as None, the output dropped
    after the loss unless ``output_alive``; on fake tensors (``fake``) or for real. ``units``: the modules
    to follow (those that do not run have no span). ``probe``: reads what each operator allocates inside itself
    (Note [In-operator transients] in remat.costs.recording); None: the allocator's peak inside each operator on
    a real CUDA recording, nothing elsewhere. Leaves the model's ``.grad`` as it was; the caller restores buffers
    and RNG (``remat.runtime.state.preserved``)."""
    rec = _Recorder(device)
    if probe is None and not fake and torch.device(device).type == "cuda" and torch.cuda.is_available():
        probe = InOperatorPeak(CudaAllocator(torch.device(device)))
    rec.probe = probe
    named_params = dict(model.named_parameters(remove_duplicate=False))
    named_buffers = dict(model.named_buffers(remove_duplicate=False))
    if fake:
        mode = fake_mode()
        conv = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        params = {n: conv(p) for n, p in named_params.items()}
        buffers = {n: conv(b) for n, b in named_buffers.items()}
        args, kwargs = tree_map(conv, args), tree_map(conv, kwargs)
        ctx = mode

        def forward(*a, **kw):
            return torch.func.functional_call(model, {**params, **buffers}, a, kw, strict=False, tie_weights=True)
    else:
        params, buffers, ctx, forward = named_params, named_buffers, torch.enable_grad(), model
    for kind, table in (("param", params), ("buffer", buffers)):
        for n, t in table.items():
            if t is not None:
                rec.preexisting.setdefault(storage_key(t), (kind, n))
    for i, t in enumerate(input_tensors(args, kwargs)):
        rec.preexisting.setdefault(storage_key(t), ("input", str(i)))
    rec.ignored.update(rec.preexisting)
    trainable = list({id(p): p for n, p in params.items() if named_params[n].requires_grad}.values())
    targets = grad_targets(trainable, (args, kwargs))
    marks: dict[str, int] = {}
    after_backward: list[int] = []

    def on(event: str) -> None:
        if event == "loss":
            rec.backward = True
        else:
            after_backward.append(rec.live_bytes)
        marks[event] = rec.index

    handles = hook_units(model, list(dict.fromkeys(units)), lambda n, a: rec.enter(n, a), lambda n, o: rec.leave(n))
    try:
        with ctx, torch.enable_grad(), fresh_grads(targets), rec, \
                torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
            run_step(forward, args, kwargs, loss_fn, output_alive=output_alive, on=on)
            grads = {id(r) for t in targets if t.grad is not None and (r := rec.by_key.get(storage_key(t.grad)))}
    finally:
        for h in handles:
            h.remove()
    return rec.freeze(marks["backward"], marks["loss"], after_backward[0], grads)
