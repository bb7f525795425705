"""Profile: measure one training step of the model on its device, per unit.

The stage in parts, one module each:

* ``recorder``: one step recorded (fake tensors when possible) into an immutable
  :class:`remat.costs.recording.Recording` (Note [Timeline]);
* ``calibrate``: the recording checked against a real forward (Note [Fake sizes], Note [Fake paths]);
* ``units``: the candidate units (modules, Note [Segments], Note [Regions], Note [Policy menus]);
* ``timing``: real timed steps per unit and checkpoint's own bookkeeping (Note [Checkpoint overhead]);
* ``optimizer``: the optimizer's state and step, on shadow copies (Note [Never call the user's optimizer]);
* ``cache``: the times of a step already measured on this machine, kept on disk (Note [Timing cache]);
* ``host_work``: the model's own host work, for a modelled target (Note [Time between operators]);
* ``step``: the step measured, one recording of it with its units, and the Profile assembled from them.

``profile_model`` puts them together (``profile_modelled`` for a modelled target: ``modelled``); ``remat.costs.effects.unit_costs`` turns the recording and the times
into a :class:`remat.costs.unit_costs.UnitCost` per unit.

Note [Loop style]
~~~~~~~~~~~~~~~~~
The training loop decides part of the peak, so remat records the loop the user runs:
``loss.backward()`` (not ``torch.autograd.grad``: a real backward lays gradients out as
``.grad`` does, e.g. channels-last copies for convolution weights) into gradients that start as
None (``zero_grad(set_to_none=True)``), backward outside autocast (Note [Autocast] in
remat.runtime.measure), and the model's output either kept until the step ends (``output_alive=True``:
``out = model(x); loss = crit(out, y); loss.backward(); opt.step()``) or dropped once the loss
is computed (``output_alive=False``: Hugging Face Trainer's ``compute_loss``, torchtitan's
``del pred``). The optimizer step starts from what is alive once backward has returned
(``Profile.after_backward_bytes``): the last backward operator's incoming gradient is gone by
then. The user's own ``.grad`` objects are set aside and given back (``remat.runtime.state.fresh_grads``).

Nothing here mutates the model, its gradients, its buffers or the optimizer; RNG state is restored (runtime.state).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Callable

import torch
from torch import nn

from remat.capture import ModelGraph, capture, quiet_loggers, unit_parent
from remat.costs.unit_costs import Profile, UnitCost
from remat.costs.effects import UnitSpec, unit_costs
from remat.errors import InvalidInputError
from remat.rewrite import remove_checkpointing
from remat.runtime.distributed import Wrapping
from remat.runtime.measure import LossFn, found_storages_are_fresh, input_tensors, tensor_bytes
from remat.runtime.meters import CudaAllocator
from remat.profile import cache
from remat.profile.calibrate import LoggedOp, align_forward, calibrate_sizes, diverged, ops_summary, \
    plain_forward_ops, plain_step_fits
from remat.profile.optimizer import optimizer_costs
from remat.profile.host_work import code_of, modelled_host, step_host_work
from remat.profile.step import ProfiledStep, Recorded, assembled, with_selective_specs
from remat.profile.modelled import Modelled, times_of_ops
from remat.profile.timing import checkpoint_overhead, time_units
from remat.costs.recording import CheckpointOverhead, Recording, UnitTimes, shared_by_twins
from remat.runtime.state import preserved

log = logging.getLogger(__name__)


def captured_profile(
    model: nn.Module, args: tuple, kwargs: dict, *, loss_fn: LossFn, optimizer: torch.optim.Optimizer | None,
    device: torch.device, output_alive: bool = True, wrapping: Wrapping | None = None,
    graph: ModelGraph | None = None, memory_known: Callable[[Profile], None] | None = None,
    modelled: Modelled | None = None, staged: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> Profile:
    """The model captured (unless ``graph``, its capture on another batch of the same model: its units do not depend
    on the batch) and profiled, remat's own checkpointing taken off while it runs and the model as it was after.
    ``memory_known``, ``modelled``: see :func:`profile_model`; ``staged``: a context the capture and the profile
    run in (the front doors' sorting of whose failure an exception is: Note [Whose failure] in remat.api.inputs)."""
    wrapping = wrapping or Wrapping()
    wrapped = None if wrapping.kind == "none" else f"the model is wrapped by {wrapping}"
    with preserved(model), found_storages_are_fresh(wrapping.kind == "fsdp2"):
        remove_checkpointing(model)
        with (staged or contextlib.nullcontext)():
            # Note [Tracing without module hooks]: torch.fx traces on proxies, running no kernel and no
            # collective, and here without module hooks (capture's _WithoutModuleHooks): what it sees is the
            # Python of the forwards, which is what decides whether the operator sequence can depend on the data
            # (Note [Selective checkpointing]). The hooks parallelize_module installs redistribute DTensors by
            # their placements, not their values (SequenceParallel's refuses a proxy: traced with hooks, a
            # sequence-parallel model failed); FSDP2's gather and free parameters, and hold state that running
            # them on proxies or fake tensors breaks: left out, they are not run at all. So a model wrapped by
            # tensor parallelism (sequence parallel or not) or FSDP2, 2-D included, is traced when its own
            # forwards trace, and gets selective options named by position in the real step's operators,
            # collectives included (ranks agree: Note [One plan for every rank]). torch.export is not tried: it
            # would run the hooks on fake tensors. DDP's wrapper does its bookkeeping in its own forward, not in
            # hooks: it is never traced
            traced = wrapping.kind in ("tp", "fsdp2")
            graph = graph or capture(model, args, kwargs, untraceable=None if traced else wrapped,
                                     no_export=wrapped if traced else None)
            return profile_model(model, args, kwargs, loss_fn=loss_fn, optimizer=optimizer, graph=graph,
                                 device=device, output_alive=output_alive, record_real=wrapped,
                                 world_size=wrapping.world_size,
                                 wrapping=str(wrapping) if wrapping.world_size > 1 else "",
                                 sharded=tuple(name for name, _ in wrapping.fsdp), memory_known=memory_known,
                                 modelled=modelled)


def profile_model(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None,
    graph: ModelGraph,
    device: torch.device,
    timing_steps: int = 3,
    output_alive: bool = True,
    record_real: str | None = None,
    world_size: int = 1,
    wrapping: str = "",
    sharded: tuple[str, ...] = (),
    memory_known: Callable[[Profile], None] | None = None,
    modelled: Modelled | None = None,
) -> Profile:
    """Measure ``model``'s training step on the example inputs. Leaves the model, its gradients and
    buffers, the optimizer and the RNG state as they were. ``record_real``: why memory must be recorded
    on a real step, not on fake tensors (a model wrapped for distributed training). ``sharded``: the modules
    FSDP2 manages; a unit that contains one (other than itself) is not a candidate: recomputing it in
    backward would run that module's FSDP hooks again, gathering its parameters a second time (checkpoint
    inside each sharded module instead, as torchtitan does). ``memory_known``: called with the profile as
    memory alone gives it (no times), before any timed step runs (Note [Memory before time]); what it raises
    ends profiling. ``modelled``: the model and inputs are already fake, for a device that is not here
    (remat.target): the step is recorded on them and nothing runs for real (Note [Where costs come from])."""
    notes: list[str] = []
    step = ProfiledStep.of(model, args, kwargs, loss_fn, device, graph, output_alive, sharded, world_size, wrapping)
    if modelled is not None:
        return profile_modelled(step, modelled, notes)
    recorded = _record(step, record_real, notes)
    recorded, plain, changed = _check_against_real_forward(step, recorded, notes)
    specs = with_selective_specs(step, recorded, notes)
    opt = optimizer_costs(optimizer, device)
    if optimizer is None:
        notes.append("no optimizer given: optimizer state and step are not counted")
    buffer_bytes = {name: tensor_bytes([b], device) for name, b in model.named_buffers()}
    # the BLAS workspaces the step holds all along (Note [The budget on CUDA is absolute] in
    # remat.costs.allocator_reading): measured, as the check measures them
    workspaces = CudaAllocator(device).workspace_bytes() if device.type == "cuda" else 0
    assemble = functools.partial(assembled, step, opt=opt, recorded=recorded.how, notes=notes,
                                  workspace_bytes=workspaces)

    rec, ran, memory = recorded.rec, recorded.ran, recorded.memory
    cand = [u for u in ran if memory[u].excluded is None and memory[u].drops and memory[u].calls == 1]
    top = [u for u in cand if unit_parent(u, cand) is None]
    timed = list(dict.fromkeys([*ran, *(c for c in step.extra if c in rec.spans)]))
    # (also memory: the RNG state each checkpoint holds on CPU)
    overhead = cache.overhead(device, lambda: checkpoint_overhead(device))
    if memory_known is not None and changed is not None:
        memory_known(assemble(rec, _memory_alone(step, rec, specs, timed, changed, overhead, buffer_bytes),
                               0.0, 0.0))

    rec, times = _timed(step, recorded, timed, top, plain, timing_steps, record_real is not None, notes)
    units = unit_costs(rec, specs, times=times, overhead=overhead, buffer_bytes=buffer_bytes)
    return assemble(rec, units, times.step_forward_s, _backward_s(units, times, top))


def profile_modelled(step: ProfiledStep, modelled: Modelled, notes: list[str]) -> Profile:
    """The profile of a step recorded on fake tensors for a modelled target: no real forward to calibrate
    against, no timed step; times from ``modelled.op_seconds``."""
    rec, ran, specs = step.record(fake=False)  # the model's tensors are fake already
    if step.world_size > 1:  # FSDP2's lazy initialisation in the first step, as _record
        rec, ran, specs = step.record(fake=False)
    recorded = Recorded.of(modelled.counted(rec), ran, specs, "fake")
    specs = with_selective_specs(step, recorded, notes)
    notes.append(modelled.note)
    rec = recorded.rec.with_op_seconds({i: modelled.op_seconds(op) for i, op in enumerate(recorded.rec.forward_ops)})
    timed = list(dict.fromkeys([*ran, *(c for c in step.extra if c in rec.spans)]))
    times = times_of_ops(rec, timed)
    flops = 0
    if modelled.step_time is not None:
        forward_s, backward_s, flops = modelled.step_time(rec)
        ratio = backward_s / forward_s if forward_s > 0 else 2.0
        times = dataclasses.replace(times, step_forward_s=forward_s, step_backward_s=backward_s,
                                    backward_s={u: s * ratio for u, s in times.forward_s.items()})
    buffer_bytes = {name: tensor_bytes([b], step.device) for name, b in step.model.named_buffers()}
    units = unit_costs(rec, specs, times=times, overhead=modelled.overhead, buffer_bytes=buffer_bytes)
    host_s = None
    if modelled.host is not None:  # Note [Host time decomposed] in remat.costs.host_time
        work = cache.host_work(rec, f"{modelled.note}; {code_of(step.model)}", lambda: step_host_work(step))
        units, host_s, note = modelled_host(units, work, modelled.host, modelled.host_bookkeeping)
        notes.append(note)
    profile = assembled(step, rec, units, times.step_forward_s, times.step_backward_s, opt=modelled.optimizer,
                         recorded="fake", notes=notes)
    if host_s is not None:
        profile = dataclasses.replace(profile, forward_host_s=host_s[0], backward_host_s=host_s[1])
    return dataclasses.replace(profile, model_flops=flops) if flops else profile


def _record(step: ProfiledStep, record_real: str | None, notes: list[str]) -> Recorded:
    """Record one step: on fake tensors when possible, else (or when ``record_real`` says why not) a real one."""
    reason = record_real
    if reason is None and _autocast_enabled(step.device):
        # Note [Autocast and fake tensors]: the autocast cache does not hold casts of fake weights,
        # so a fake recording casts weights again at every use where the real step reuses them.
        reason = "autocast is on"
    if reason is None:
        try:
            with quiet_loggers("torch._subclasses.fake_tensor"):  # a failure here is expected and handled
                rec, ran, specs = step.record(fake=True)
            recorded = "fake"
        except InvalidInputError:
            raise
        except Exception as e:  # noqa: BLE001 - data-dependent code cannot run on fake tensors
            log.info("recording on fake tensors failed (%s: %s); recording a real step", type(e).__name__, e)
            reason = f"fake tensors failed: {type(e).__name__}"
    if reason is not None:
        notes.append(f"memory recorded on a real step ({reason}); profiling needed the plain step's peak")
        rec, ran, specs = step.record(fake=False)
        if record_real is not None:
            # a model wrapped for distributed training sets itself up in its first step (FSDP2's lazy
            # initialisation, the process group's first buffers): record the second step, as training runs
            rec, ran, specs = step.record(fake=False)
        recorded = "real"
    return Recorded.of(rec, ran, specs, recorded)


def _check_against_real_forward(
    step: ProfiledStep, recorded: Recorded, notes: list[str],
) -> tuple[Recorded, tuple[LoggedOp, ...], frozenset[str] | None]:
    """A fake recording checked against a real plain forward: recorded again for real if the step took another
    path (Note [Fake paths]), its sizes corrected from the real kernels' (Note [Fake sizes]). Also returns the
    plain forward's operators and the buffers it changed (none and None after a real recording)."""
    # the plain forward's operators and sizes, to check the fake recording against (Note [Fake paths]) and
    # correct its sizes (Note [Fake sizes]): before timing, so that what memory alone decides (a budget below
    # the least peak, ``memory_known``) is known before any timed step runs
    plain, changed = plain_forward_ops(step.model, step.args, step.kwargs, step.loss_fn, step.device) \
        if recorded.how == "fake" else ((), None)
    paths = diverged(recorded.rec, plain) if recorded.how == "fake" else []
    if paths and not plain_step_fits(recorded.rec, step.device):
        notes.append(f"the step took another path on fake tensors than on real ones ({ops_summary(paths)}), but "
                     "the plain step may not fit the device to record it for real: memory recorded on fake tensors")
    elif paths:  # Note [Fake paths]
        notes.append(f"the step took another path on fake tensors than on real ones ({ops_summary(paths)}): "
                     "memory recorded on a real step; profiling needed the plain step's peak")
        recorded = Recorded.of(*step.record(fake=False), "real")
    if recorded.how == "fake":
        # sizes from the plain forward (the same operators as the recording, one for one, when it took the
        # same path), not from a timed one, whose checkpoint and buffer-snapshot clones can shift the
        # alignment: a ResNet-D stem's BatchNorm output once took another BatchNorm's size (+256 KiB)
        rec, fixed = calibrate_sizes(recorded.rec, plain)
        recorded = dataclasses.replace(recorded, rec=rec)
        if fixed:
            notes.append(f"{fixed} storage size(s) on fake tensors differed from the real kernels' and were "
                         "corrected from the real forward")
    if recorded.how == "fake" and step.device.type == "cuda" and plain_step_fits(recorded.rec, step.device):
        # Note [In-operator transients] in remat.costs.recording: what an operator allocates inside itself (cuDNN's
        # and cuBLASLt's workspaces) only the allocator sees, on a real step; the plain step fits, so it is recorded
        recorded = Recorded.of(*step.record(fake=False), "real")
        held = recorded.rec.transient_bytes
        notes.append("memory recorded on a real CUDA step (it fits the device), with what each operator allocates "
                     f"inside itself as the allocator reads it: {len(held)} operators, at most "
                     f"{max(held.values(), default=0):,} bytes (Note [In-operator transients] in remat.costs.recording)")
    return recorded, plain, changed


def _memory_alone(step: ProfiledStep, rec: Recording, specs: list[UnitSpec], timed: list[str], changed: frozenset[str],
                  overhead: CheckpointOverhead, buffer_bytes: dict[str, int]) -> list[UnitCost]:
    """For ``memory_known``: the units' costs before any timed step."""
    # Note [Memory before time] in remat.api: the profile as memory alone gives it (every time 0 s), with
    # the buffers each module's forward changes (which a checkpoint of it snapshots) from the plain forward
    # (a real recording has none: the hook is not called, profiling times as before)
    mods = dict(step.model.named_modules())
    mutated = {u: tuple(n for n, _ in mods[u].named_buffers() if (f"{u}.{n}" if u else n) in changed)
               for u in timed if u in mods}
    none = UnitTimes(forward_s={}, recompute_s={}, backward_s={}, mutated_buffers=mutated, step_forward_s=0.0,
                     step_backward_s=0.0)
    return unit_costs(rec, specs, times=none, overhead=overhead, buffer_bytes=buffer_bytes)


def _timed(step: ProfiledStep, recorded: Recorded, timed: list[str], top: list[str], plain: tuple[LoggedOp, ...],
           timing_steps: int, distributed: bool, notes: list[str]) -> tuple[Recording, UnitTimes]:
    """The units' times (``time_units``, looked up in this module), and the recording with each forward
    operator's time."""
    rec, memory = recorded.rec, recorded.memory
    # time, measured for real with the top-level candidate modules checkpointed
    # (a module called more than once is not checkpointed while timing: its recomputation is its forwards)
    # (Note [Timing cache]: the same step measured before on this machine is not timed again)
    key = cache.step_key(rec, timed, top, step.device, input_tensors(step.args, step.kwargs),
                         timing_steps=timing_steps, distributed=distributed)
    hit = cache.load_times(key)
    if hit is None:
        with preserved(step.model):
            times, forward_ops = time_units(step.model, step.args, step.kwargs, step.loss_fn, step.device, timed, top,
                                            {u: memory[u].mutated_buffers for u in top}, timing_steps,
                                            {u: len(rec.spans[u]) for u in timed}, distributed=distributed,
                                            warm_ops=plain or None, notes=notes)
        op_seconds = {i: forward_ops[j].seconds for i, j in align_forward(rec, forward_ops).items()}
        cache.store_times(key, times, op_seconds)
    else:
        times, op_seconds, note = hit
        notes.append(note)
    rec = rec.with_op_seconds(op_seconds)
    return shared_by_twins(rec, times, timed)  # Note [Twins share their times] in remat.costs.recording


def _backward_s(units: list[UnitCost], times: UnitTimes, top: list[str]) -> float:
    """The plain step's backward time."""
    # the timed steps checkpointed the top-level units: take their recomputation and bookkeeping out. Each is
    # timed separately, so on a busy machine they can add up to more than the backward timed around them: the
    # backward is then at least its top-level units' own backward times (measured in the same step), never 0
    by_name = {u.name: u for u in units}
    return max(times.step_backward_s - sum(times.recompute_s.get(u, 0.0) + by_name[u].overhead_s
                                           for u in top), sum(times.backward_s.get(u, 0.0) for u in top), 0.0)


def _autocast_enabled(device: torch.device) -> bool:
    return bool(torch.is_autocast_enabled(device.type))
