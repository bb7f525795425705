"""Costs modelled for a target: the second implementation of :class:`~remat.api.source.CostSource` (Note [Where
costs come from]). The step is recorded on fake tensors in the target's world (remat.target.world), counted as
the target's allocator counts it, timed by a device model, and each candidate plan is checked by recording its
checkpointed step and replaying the CUDA caching allocator over it: the budget applies to the predicted reserved
bytes. Every figure is predicted for the target, not measured.

Note [Target kernels]
~~~~~~~~~~~~~~~~~~~~~
What a CUDA target does differently from the CPU kernels the step is recorded with (Note [Fake CUDA on a CPU
build] in remat.target.world), and how each is taken into account (docs/targets.md lists them with figures):

* allocation sizes: every block is rounded up to 512 bytes (``Modelled.counted``), segments and pools by the
  allocator replay (remat.costs.allocator);
* attention: each ``scaled_dot_product_attention`` call runs through the CUDA operator of the kernel torch would
  pick on the target's GPU (flash, memory-efficient, cuDNN or math, by torch's rules: Note [SDPA selection rules]
  in remat.costs.attention_kernels), so the recording keeps what that kernel saves and times it by its name, not
  the CPU's choice (Note [Attention on the target] in remat.target.attention);
* optimizer steps: ``foreach`` (torch's default on CUDA) unless the optimizer says otherwise, so one step's
  temporaries are a whole parameter group's at once, recorded on the fake parameters;
* cuBLAS workspaces: one per thread that runs matrix products (the step's and autograd's), of torch's default
  size for the device's generation, allocated through the caching allocator (Note [cuBLAS workspaces]);
* collectives: FSDP2's all-gather and reduce-scatter buffers are the real code's allocations (fake process
  group); NCCL's own buffers and the CUDA context are outside the allocator and not counted;
* streams: FSDP2 allocates its all-gather buffers on its all-gather
  streams and the reduce-scatter's output (the sharded gradients) on its reduce-scatter stream, and the caching
  allocator keeps one pool per stream: a block freed on one stream is not reused by another. On CPU, FSDP2 runs
  the same code with ``torch.cpu`` streams, whose current stream the recording reads at every allocation; the
  replay keeps a pool per stream. (Blocks used on another stream than their own are freed at once in the replay:
  FSDP2 holds them until its events instead of ``record_stream``.)
* autocast: CUDA's op lists differ from the CPU's and cannot be run on fake CPU tensors: a step under autocast is
  refused for a CUDA target (use FSDP2's ``MixedPrecisionPolicy`` or a model in bf16).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.costs.allocator import Alloc, AllocatorPeaks, Free, events_of, replay
from remat.costs.device_time import DeviceRates
from remat.costs.recording import CheckpointOverhead, Recording
from remat.costs.unit_costs import Profile
from remat.errors import UnsupportedError
from remat.profile.modelled import Modelled
from remat.runtime.measure import StorageTracker, allocated_bytes, input_tensors, run_step, tensor_bytes
from remat.solve import Planner
from remat.solve.plan import Plan, fmt_bytes
from remat.target.optimizer import fake_optimizer, optimizer_cost, optimizer_seconds
from remat.target.timing import efficiencies_elsewhere, operator_seconds, rates_of, step_time
from remat.target.attention import AttentionCall, describe_calls
from remat.target.limits import fake_tensor_limits
from remat.target.world import Target, as_target, built, wrapping_assumed

if TYPE_CHECKING:
    from remat.api.request import Request

#: how many plans' steps are replayed at most to find the one whose reserved peak fits the budget
TIGHTENINGS = 8


class ModelledTarget:
    """Costs of a step on a :class:`~remat.target.world.Target`, modelled on this machine (Note [Where costs
    come from]). Nothing of the user's runs: the model is copied onto fake tensors (no weight read or
    allocated), its optimizer is read for its class and settings only."""

    def __init__(self, target: Target | str) -> None:
        self.target = as_target(target)
        #: the allocator replay of the last plan checked: (plan's units, peaks)
        self.replayed: dict[tuple[str, ...], AllocatorPeaks] = {}
        #: what the time model found worth saying about the last profile (FSDP2's communication)
        self.time_notes: list[str] = []
        #: every attention call of the last profile's recordings, with the kernel assumed (Note [Attention on
        #: the target] in remat.target.attention)
        self.attention: list[AttentionCall] = []

    def describe(self) -> str:
        return f"predicted for {self.target.describe()}, not measured"

    # -- the profile -------------------------------------------------------------------------------------
    def profile(self, req: Request) -> Profile:
        from remat.capture import capture
        from remat.profile import captured_profile
        from remat.runtime.distributed import wrapping_of

        _refuse_autocast(self.target)
        if req.loop is not None:
            raise UnsupportedError(
                f"the loop compiles the model ({req.loop}), but a compiled step cannot be modelled for "
                f"{self.target.describe()} yet: what inductor's programs allocate is read from programs compiled here. "
                "Plan the eager step for the target (compile=False), or plan the compiled step where it runs")
        started = time.perf_counter()
        graphs = []

        def capture_unwrapped(fake: nn.Module, inputs: Any) -> None:
            # Note [Capture before parallelizing]: what the capture decides (units, whether the operator
            # sequence can depend on the data) is the Python of the model's forwards, which FSDP2 and TP do not
            # change; the copy is captured before they wrap it (torch.export runs hooks, so a wrapped model is
            # traced by fx alone where it runs: Note [Tracing without module hooks]), its modules named alike
            graphs.append(capture(fake, *inputs))

        rates = rates_of(self.target, _model_dtype(req.model))
        self.time_notes = []
        self.attention = []
        with fake_tensor_limits(self.target), \
                built(self.target, req.model, (req.args, req.kwargs), before=capture_unwrapped,
                      attention_calls=self.attention) as (fake, (args, kwargs), mode):
            opt = optimizer_cost(req.optimizer, req.model, fake, mode, self.target)
            modelled = Modelled(optimizer=opt, op_seconds=lambda op: operator_seconds(op, rates, self.target),
                                overhead=self._overhead(), counted=self._counted, note=self._note(rates),
                                step_time=lambda rec: self._step_time(rec, rates), host=rates.host,
                                host_bookkeeping=self._host_bookkeeping() if rates.host is not None else None)
            wrapping, graph = wrapping_of(fake), graphs[0]
            with mode:
                profile = captured_profile(fake, args, kwargs, loss_fn=req.loss_fn, optimizer=None,
                                        device=torch.device("cpu"), output_alive=req.output_alive,
                                        wrapping=wrapping, graph=graph, modelled=modelled)
                optimizer_s = optimizer_seconds(req.optimizer, req.model, fake, self.target, rates)
            # the step's fixed memory as the target's allocator counts it (profiling counted it as the CPU's)
            fixed = dict(params_bytes=tensor_bytes(fake.parameters(), counted_as=CUDA),
                         grads_bytes=tensor_bytes((p for p in fake.parameters() if p.requires_grad), counted_as=CUDA),
                         buffers_bytes=tensor_bytes(fake.buffers(), counted_as=CUDA),
                         inputs_bytes=tensor_bytes(input_tensors(args, kwargs), counted_as=CUDA)) \
                if self.target.is_cuda else {}
        return dataclasses.replace(
            profile, device=self.describe(), world_size=self.target.world, target=self.target.describe(), **fixed,
            optimizer_s=optimizer_s, tokens_per_step=_tokens(req.args, req.kwargs, self.target),
            peak_flops_per_s=rates.flops_per_s,
            notes=profile.notes + tuple(self.time_notes) + tuple(
                n for n in (describe_calls(self.attention, self.target),) if n) + (
                f"wrapping assumed: {wrapping_assumed(self.target, req.model)}",
                f"recorded on fake tensors in {time.perf_counter() - started:.1f} s",))

    def _step_time(self, rec: Recording, rates: DeviceRates) -> tuple[float, float, int]:
        st = step_time(rec, rates, self.target)
        self.time_notes = [f"FSDP2's collectives predicted {st.fsdp_comm_s * 1e3:.1f} ms a step, of which "
                           f"{st.exposed_comm_s * 1e3:.1f} ms not hidden behind compute (Note [FSDP2 prefetch] in "
                           "remat.target.timing)"] if st.fsdp_comm_s else []
        return st.forward_s, st.backward_s, st.flops

    def _overhead(self) -> CheckpointOverhead:
        """Checkpoint's bookkeeping on the target's device: on a GPU none (the host's bookkeeping runs ahead of the
        GPU: it is the host's, :meth:`_host_bookkeeping`, and the saved RNG states live in host memory); on this
        machine's CPU, as measured here."""
        return CheckpointOverhead(0.0, 0.0, 0.0) if self.target.is_cuda else self._host_bookkeeping()

    @staticmethod
    def _host_bookkeeping() -> CheckpointOverhead:
        """What checkpointing adds to a host, measured on this machine's CPU (Note [Host time decomposed] in
        remat.costs.host_time; the same measurement, cached, the measured path uses)."""
        from remat.profile import cache
        from remat.profile.timing import checkpoint_overhead

        cpu = torch.device("cpu")
        return cache.overhead(cpu, lambda: checkpoint_overhead(cpu))

    def _counted(self, rec: Recording) -> Recording:
        if not self.target.is_cuda:
            return rec
        return dataclasses.replace(rec, storages=tuple(
            dataclasses.replace(s, nbytes=_round(s.nbytes)) for s in rec.storages))

    def _note(self, rates: DeviceRates) -> str:
        peak = f"{rates.flops_per_s / 1e12:.1f} TFLOP/s" if rates.flops_per_s >= 1e12 else \
            f"{rates.flops_per_s / 1e9:.1f} GFLOP/s"
        return (f"memory and time predicted for {self.target.describe()}, not measured: the step recorded on fake "
                f"tensors in the target's world (Note [Target kernels]); each operator timed by the device model "
                f"({rates.name}: {peak} dense, {rates.memory_bytes_per_s / 1e9:.0f} GB/s; Note [Device time model] "
                "in remat.costs.device_time), collectives by ring over the target's links"
                + efficiencies_elsewhere(rates, self.target.spec.name))

    # -- the plan ----------------------------------------------------------------------------------------
    def choose(self, req: Request, planner: Planner, profile: Profile) -> tuple[Plan, tuple[str, ...]]:
        """The plan for the budget, which applies to the reserved peak: planned for the budget; when its replayed
        reserved peak exceeds it, or the replay runs out of the device's memory, the budget asked of the planner is
        lowered by the excess until a plan fits, then bisected between that and the lowest that failed, to 1% of
        the budget (Note [Reserved budget]). A budget above the device's memory is lowered to it, with a note."""
        budget, notes = req.budget_bytes, ()
        capacity = self.target.allocator.capacity_bytes if self.target.is_cuda else None
        if capacity is not None and budget > capacity:
            notes = (f"the budget ({fmt_bytes(budget)}) is above the memory of {self.target.spec} that the CUDA caching "
                     f"allocator can get ({fmt_bytes(capacity)}): planned for {fmt_bytes(capacity)}",)
            budget = capacity
        no_budget = (f"No budget on {self.target.spec} holds this step with checkpointing alone: shrink the batch or "
                     "the sequence, shard over more ranks (fsdp), or plan for a device with more memory.")
        if capacity is not None and planner.min_peak_bytes > capacity:
            raise planner.infeasible(budget, remedy=no_budget)
        plan = planner.plan_for_budget(budget)
        if not (req.check and self.target.is_cuda):
            return _labelled(plan, None, self.target), notes
        best: tuple[Plan, AllocatorPeaks] | None = None
        fits, fails, asked = planner.min_peak_bytes, budget + 1, budget
        for _ in range(TIGHTENINGS):
            peaks = self.replay(req, plan)
            if _fits(peaks, budget):
                best, fits = (plan, peaks), asked
                if asked == budget:
                    break
            else:
                fails = asked
            if fails - fits <= budget // 100:  # within 1% of the budget
                break
            # Note [Reserved budget]: the allocator's segments and pools cost more than a plan's live bytes, by an
            # amount that depends on the plan: ask for less by the excess and 1% more until a plan fits (by the
            # excess alone, the steps shrink as a plan nears the budget), then bisect; a replay that ran out of the
            # device's memory says no excess (it stopped there): bisect at once
            asked = (fits + fails) // 2 if best is not None or peaks.oom is not None else max(
                planner.min_peak_bytes, asked - (peaks.reserved_peak_bytes - budget) - budget // 100)
            plan = dataclasses.replace(planner.plan_for_budget(asked), budget_bytes=budget)
        if best is not None:
            return _labelled(*best, self.target), notes
        least = dataclasses.replace(planner.least_memory(), budget_bytes=budget)
        peaks = self.replay(req, least)
        if _fits(peaks, budget):
            return _labelled(least, peaks, self.target), notes
        where = f"reserved, predicted for {self.target.describe()}, not measured: the CUDA caching allocator " \
                "replayed over two recorded steps"
        remedy = ""
        if peaks.oom is not None:
            oom = peaks.oom
            where += (f"; even the least-memory plan runs out of the device's {fmt_bytes(capacity)}: the replay "
                      f"stopped where it asks for a segment of {fmt_bytes(oom.segment_bytes)} with "
                      f"{fmt_bytes(oom.reserved_bytes)} reserved and the cache released")
            remedy = no_budget
        raise planner.infeasible(budget, least_bytes=max(peaks.reserved_peak_bytes, least.predicted_peak_bytes),
                                 source=where, remedy=remedy)

    def replay(self, req: Request, plan: Plan | None) -> AllocatorPeaks:
        """The target allocator's peaks over two training steps with ``plan`` (forward, loss, backward, the
        optimizer's step and ``zero_grad``), recorded on fake tensors in the target's world (None: the model as it
        is, its own checkpointing included)."""
        key = plan.choices if plan is not None else ()
        if key not in self.replayed:
            self.replayed[key] = replay(self.step_events(req, plan), self.target.allocator)
        return self.replayed[key]

    def step_events(self, req: Request, plan: Plan | None) -> list:
        """The allocations and frees of two training steps with ``plan``, in order, as the target's allocator
        sees them: the parameters and the batch first, the BLAS workspaces (Note [cuBLAS workspaces])."""
        from remat.rewrite import checkpoint_plan

        with fake_tensor_limits(self.target), \
                built(self.target, req.model, (req.args, req.kwargs)) as (fake, (args, kwargs), mode), mode:
            if plan is not None:
                checkpoint_plan(fake, plan)
            held = {id(t): t for t in [*fake.parameters(), *fake.buffers(), *input_tensors(args, kwargs)]}
            before = [Alloc(i, _local_bytes(t)) for i, t in enumerate(held.values())]
            before += [Alloc(len(before) + i, n) for i, n in enumerate(self.target.blas_workspaces())]
            opt = fake_optimizer(req.optimizer, req.model, fake, self.target)
            with StorageTracker(torch.device("cpu"), ignore=list(held.values()), count_fake=True,
                                follow_streams=True) as tracker:  # (streams: Note [Target kernels])
                for _ in range(2):
                    run_step(fake, args, kwargs, req.loss_fn, output_alive=req.output_alive)
                    if self.target.clip_grad_norm is not None:
                        torch.nn.utils.clip_grad_norm_(list(fake.parameters()), self.target.clip_grad_norm,
                                                       foreach=True)
                    if opt is not None:
                        type(opt).step(opt)
                    for p in fake.parameters():
                        p.grad = None
            recorded = [(r.nbytes, r.alloc_index, r.free_index) for r in tracker.records]
            streams = [r.stream for r in tracker.records]
        return before + [Alloc(e.handle + len(before), e.nbytes, streams[e.handle]) if isinstance(e, Alloc)
                         else Free(e.handle + len(before)) for e in events_of(recorded)]


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _tokens(args: tuple, kwargs: dict, target: Target) -> int | None:
    """Tokens one device trains on per step: the first integer tensor of two or more dimensions among the inputs
    (token ids: batch x sequence), shared by the ranks of a tensor-parallel group; None when there is none."""
    for t in input_tensors(args, kwargs):
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool and t.dim() >= 2:
            return max(1, t.numel() // target.tp)
    return None


#: the device whose allocator a CUDA target's bytes are counted as (Note [CUDA block size] in remat.runtime.tracker)
CUDA = torch.device("cuda")


def _round(nbytes: int) -> int:
    return allocated_bytes(nbytes, CUDA)


def _local_bytes(t: torch.Tensor) -> int:
    from remat._compat import local_tensor

    return _round(local_tensor(t).untyped_storage().nbytes())


def _refuse_autocast(target: Target) -> None:
    if target.is_cuda and (torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")):
        raise UnsupportedError(
            f"autocast is on, but a step for {target.spec} is recorded on CPU tensors, where CUDA's autocast op "
            "lists do not apply (Note [Target kernels]): plan with autocast off and mixed precision given by "
            "FSDP2 (Target(param_dtype=torch.bfloat16)) or a model in bf16")


def _fits(peaks: AllocatorPeaks, budget: int) -> bool:
    """Whether a replayed step holds the budget: its reserved peak within it, and no out-of-memory on the way."""
    return peaks.oom is None and peaks.reserved_peak_bytes <= budget


def _labelled(plan: Plan, peaks: AllocatorPeaks | None, target: Target) -> Plan:
    """The plan with what it predicts for the target, labelled predicted."""
    notes = (f"predicted for {target.describe()}, not measured",)
    if peaks is not None:
        notes += (f"predicted peak reserved by the CUDA caching allocator (replayed over two recorded steps): "
                  f"{fmt_bytes(peaks.reserved_peak_bytes)}; allocated {fmt_bytes(peaks.allocated_peak_bytes)}; "
                  "the budget applies to reserved",)
    return dataclasses.replace(plan, predicted_reserved_bytes=None if peaks is None else peaks.reserved_peak_bytes,
                               device_memory_bytes=target.allocator.capacity_bytes if target.is_cuda else None,
                               target=target.describe(), notes=plan.notes + notes)

