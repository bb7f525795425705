"""Step time on a modelled target (issue #40): the device model of remat.costs.device_time applied to a step
recorded on fake tensors in the target's world, and this machine's CPU measured for the same model.

Note [FSDP2 prefetch]
~~~~~~~~~~~~~~~~~~~~~
FSDP2 all-gathers a block's parameters on its own stream while the block before it computes (forward and
backward prefetch), and reduce-scatters a block's gradients while the next one computes its backward. The
recording sees every collective (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_`` on the fake process
group) with its bytes; their time is the ring model's (remat.costs.device_time) over the FSDP group, and only
what compute does not hide is added to the step:

    forward:  the first all-gather + max(0, the other forward all-gathers - forward compute)
    backward: the last reduce-scatter + max(0, the other backward collectives - backward compute)

That is the pipeline's time when the blocks are alike (a transformer's layers): each block's gathers hide behind
the block before. The per-operator times of FSDP2's collectives are 0 (they are not a unit's recomputation:
FSDP2 gathers a block's parameters for its backward whether it is checkpointed or not, and the recomputation runs
inside that gather), so checkpointing changes the step by its recomputation alone, and a recomputation's
compute hides more of the backward's communication than the step is credited with (a bound from above).
A tensor-parallel collective (``_c10d_functional.*``) sits between the operators that need it: it is timed as an
operator over the TP group, and recomputing its block runs it again.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from remat.costs.device_time import GPU_HOST, GPU_LAUNCH_S, DeviceRates, Efficiency, collective_seconds, op_class, \
    op_seconds
from remat.costs.recording import ForwardOp, Recording
from remat.runtime.meters import CountingMode, small_training_step
from remat.target.spec_file import efficiency_table, host_costs_of
from remat.target.devices import DeviceSpec, generation_of

#: per operator class, small training steps (forward and backward) whose kernels are of that class, at sizes a
#: small model trains at: what this CPU reaches on them, against its measured peak rates, is the class's
#: efficiency here (Note [CPU efficiencies])
CPU_SAMPLES: dict[str, tuple[tuple[str, Any], ...]] = {
    "matmul": (("Linear 512 x 512, 2,048 rows", lambda: (torch.nn.Linear(512, 512), (2048, 512))),),
    "conv": (("Conv2d 3x3 32 -> 32, 8 x 32 x 32", lambda: (torch.nn.Conv2d(32, 32, 3, padding=1), (8, 32, 32, 32))),),
    "reduction": (("LayerNorm 512, 2,048 rows", lambda: (torch.nn.LayerNorm(512), (2048, 512))),
                  ("softmax over 512, 2,048 rows", lambda: (torch.nn.Softmax(-1), (2048, 512))),
                  ("BatchNorm2d 32, 8 x 32 x 32", lambda: (torch.nn.BatchNorm2d(32), (8, 32, 32, 32))),
                  ("MaxPool2d 2, 8 x 32 x 32 x 32", lambda: (torch.nn.MaxPool2d(2), (8, 32, 32, 32)))),
    "transcendental": (("GELU, 2,048 x 512", lambda: (torch.nn.GELU(), (2048, 512))),
                       ("SiLU, 2,048 x 512", lambda: (torch.nn.SiLU(), (2048, 512)))),
    "pointwise": (("ReLU, 8 x 32 x 32 x 32", lambda: (torch.nn.ReLU(), (8, 32, 32, 32))),
                  ("x * 2 + 1, 2,048 x 512", lambda: (_Affine(), (2048, 512)))),
}

class _Affine(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


# Note [CPU efficiencies]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A GPU's efficiencies come from published measurements (remat.costs.device_time); this CPU's are measured here,
# the way torchao measured its GEMM figure: sample inputs of each class, forward and backward, timed against what
# the model predicts for the same operators at the measured peak rates (FLOP/s of a 1024-square float32
# product, bandwidth of an elementwise product) and dispatch. Each class is timed as the median of 40 steps after
# 5, three times, and the median of the three taken, after one unread pass over every sample: with one median of
# 10 steps, five measurements in one process read transcendental 0.27-0.46 and pointwise 0.43-0.53 (a process's
# first reading ran 5-25% slow, and now and then one ran 20-30% slow throughout, on a quiet machine). The samples
# run in float32 and their efficiencies apply to every dtype. A CPU computes GELU, SiLU or exp by polynomial,
# slower than it moves their bytes (a GPU does not): a class of their own, "transcendental". The samples are fixed
# above (sizes a small model trains at), not chosen per model; what a class reaches at other sizes differs (a 3x3
# convolution over few channels runs further below peak than over many), and that is what the model leaves out.


#: seconds of one product above which a dtype is read on the smaller products only (measure_cpu)
SLOW_PRODUCT_S = 0.05


def measure_cpu() -> dict[str, float]:
    """This machine's CPU rates, measured now (4-10 s; on a quiet machine, or they read low and stay cached):
    ``flops_per_s`` from float32 matrix products (512 and 1024 square, the best of 10 each after 3 warm-up
    runs), ``bf16_flops_per_s`` and ``fp16_flops_per_s`` from the same products in those dtypes (a CPU with AMX
    multiplies bfloat16 3.8 times as fast as float32, float16 no faster; a dtype whose product takes over
    :data:`SLOW_PRODUCT_S`, emulated, on two 512-square products), ``memory_bytes_per_s`` from an
    elementwise product of two 4 MiB tensors (read and written, the best of 20), ``random_bytes_per_s`` from
    drawing dropout's mask (``bernoulli_`` over 4 MiB, the best of 5), ``dispatch_s`` what an eager training
    step costs per operator beyond its arithmetic (:func:`_per_operator_s`: a CPU runs its operators as the host
    dispatches them)."""
    with torch.no_grad():
        products = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            best = 0.0
            for n in (512, 1024):
                a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
                # a dtype this CPU emulates (float16 without AVX512-FP16: 2.1 s a 1024-square product on an EPYC
                # Zen 4, 37 s of measuring before) is read on two 512-square products
                slow = _timed(lambda: a @ b) > SLOW_PRODUCT_S
                for _ in range(0 if slow else 2):
                    a @ b
                best = max(best, 2 * n ** 3 / min(_timed(lambda: a @ b) for _ in range(2 if slow else 10)))
                if slow:
                    break
            products[dtype] = best
        mm = products[torch.float32]
        # elementwise operators at an activation's size (4 MiB): read two, write one, as op_bytes counts them
        x, y = torch.randn(2**20), torch.randn(2**20)
        for _ in range(3):
            x * y
        product = 3 * x.nbytes / min(_timed(lambda: x * y) for _ in range(20))
        # dropout's mask: a CPU's generator, not its memory, bounds it (bernoulli_ in place: read and written)
        for _ in range(2):
            x.bernoulli_(0.9)
        draws = 2 * x.nbytes / min(_timed(lambda: x.bernoulli_(0.9)) for _ in range(5))
    rates = {"flops_per_s": mm, "bf16_flops_per_s": products[torch.bfloat16],
             "fp16_flops_per_s": products[torch.float16], "memory_bytes_per_s": product, "random_bytes_per_s": draws,
             "dispatch_s": _per_operator_s(), "threads": float(torch.get_num_threads())}
    peak = DeviceRates(name="cpu", flops_per_s=mm, memory_bytes_per_s=product, launch_s=0.0,
                       dispatch_s=rates["dispatch_s"], efficiency={}, random_bytes_per_s=draws)
    for samples in CPU_SAMPLES.values():  # once unread: a process's first readings ran 5-25% slow
        _class_efficiency(samples, peak)
    for cls, samples in CPU_SAMPLES.items():
        # the median of three readings: now and then one ran 20-30% slow throughout (on a quiet machine)
        rates[f"{cls}_efficiency"] = statistics.median(_class_efficiency(samples, peak) for _ in range(3))
    return rates


def _class_efficiency(samples: tuple[tuple[str, Any], ...], peak: DeviceRates) -> float:
    """What the samples' operators reach here: the model's seconds for them at the peak rates over the measured
    seconds less the dispatch (both summed over the samples; Note [CPU efficiencies]), within [0.05, 1]."""
    modelled = measured = 0.0
    for _, make in samples:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module, shape = make()
            x = torch.randn(*shape, requires_grad=True)

        def step() -> None:
            module(x).sum().backward()

        with OperatorTimes(peak, None) as timed:
            step()
        for _ in range(5):
            step()
        measured += statistics.median(_timed(step) for _ in range(40)) - timed.operators * peak.dispatch_s
        modelled += timed.seconds - timed.operators * peak.dispatch_s
    return min(1.0, max(0.05, modelled / measured)) if measured > 0 else 1.0


def _per_operator_s() -> float:
    """Seconds an eager training step spends per operator beyond the operator's arithmetic and memory traffic:
    :func:`~remat.runtime.meters.small_training_step` (nothing to compute), the median of 10 steps over the operators
    one of them dispatches (modules, autograd's records and its engine included)."""
    step = small_training_step()
    with CountingMode() as counted:
        step()
    for _ in range(3):
        step()
    return statistics.median(_timed(step) for _ in range(10)) / counted.calls


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measured_cpu_spec(memory_bytes: int | None = None) -> DeviceSpec:
    """This machine as a device: :func:`~remat.target.devices.cpu_spec` with its FP32 FLOP/s and memory bandwidth
    measured (:func:`measure_cpu`, cached in remat's timing cache), each with where it came from. (What the time
    model reads of ``Target(device="cpu")``; the dispatch and random-number rates are in :func:`measure_cpu`'s
    figures.)"""
    from remat.profile import cache
    from remat.target.devices import cpu_spec

    rates, where = cache.device_rates(measure_cpu)
    base = cpu_spec(memory_bytes)
    how = (f"measured on this machine ({where}; {int(rates.get('threads', 0))} threads): float32 512 and 1024 "
           "square matrix products, elementwise products of 4 MiB tensors (delete the cached rates, or set "
           "REMAT_CACHE=0, to measure again)")
    spec = dataclasses.replace(base, fp32_flops_per_s=rates["flops_per_s"], hbm_bytes_per_s=rates["memory_bytes_per_s"],
                               sources=base.sources + (("fp32_flops_per_s", how, "best of 10"),
                                                       ("hbm_bytes_per_s", how, "read + written, best of 20")))
    return spec


def compute_dtype(target: Any, model_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the target's matrix products run in: FSDP2's ``param_dtype`` when FSDP2 casts, else the
    model's parameters' (float32 when unknown)."""
    if target.fsdp and target.param_dtype is not None:
        return target.param_dtype
    return model_dtype or torch.float32


def rates_of(target: Any, model_dtype: torch.dtype | None = None) -> DeviceRates:
    """What the time model reads of ``target``'s device for a model whose products run in ``model_dtype``
    (Note [Device time model] in remat.costs.device_time). The ``cpu`` device is this machine, measured."""
    spec: DeviceSpec = target.spec
    dtype = compute_dtype(target, model_dtype)
    # the products' dtype's rate: the spec's (float32's where it gives no other)
    field = {torch.bfloat16: "bf16_flops_per_s", torch.float16: "fp16_flops_per_s"}.get(dtype, "fp32_flops_per_s")
    flops = getattr(spec, field) or spec.fp32_flops_per_s
    if spec.name == "cpu":
        from remat.profile import cache

        measured = cache.device_rates(measure_cpu)[0]
        # a spec without rates: those measured here in that dtype (float32's is measure_cpu's "flops_per_s")
        flops = flops or measured.get(field, measured["flops_per_s"])
        spec = dataclasses.replace(spec, fp32_flops_per_s=spec.fp32_flops_per_s or measured["flops_per_s"],
                                   hbm_bytes_per_s=spec.hbm_bytes_per_s or measured["memory_bytes_per_s"])
        dispatch_s, random_bytes_per_s = measured["dispatch_s"], measured.get("random_bytes_per_s")
        efficiency = {cls: Efficiency(e, e, "measured here (Note [CPU efficiencies])") for cls in CPU_SAMPLES
                      if (e := measured.get(f"{cls}_efficiency")) is not None}
        efficiency.setdefault("attention", efficiency.get("matmul", Efficiency(1.0, 1.0, "peak")))
        return DeviceRates(name=f"{spec.title or 'cpu'} (measured here), {str(dtype).removeprefix('torch.')}",
                           flops_per_s=float(flops), memory_bytes_per_s=float(spec.hbm_bytes_per_s),
                           launch_s=0.0, dispatch_s=dispatch_s, link_bytes_per_s=None, network_bytes_per_s=None,
                           devices_per_node=target.devices_per_node, efficiency=efficiency, generation="cpu",
                           random_bytes_per_s=random_bytes_per_s)
    missing = [f for f, v in ((field, flops), ("hbm_bytes_per_s", spec.hbm_bytes_per_s)) if not v]
    if missing:
        from remat.errors import InvalidInputError

        raise InvalidInputError(
            f"device {spec.name!r} lacks {' and '.join(missing)}, which the time model needs (issue #40: "
            f"seconds = max(FLOPs / peak, bytes / bandwidth)): give them in its spec (DeviceSpec(..., {missing[0]}=...)"
            ", dense FLOP/s, bytes/s)")
    generation = generation_of(spec)
    tf32 = tf32_classes(spec, dtype)
    return DeviceRates(name=f"{spec.title or spec.name}, {str(dtype).removeprefix('torch.')}"
                            + (f" ({' and '.join(tf32)} at TF32)" if tf32 else ""),
                       flops_per_s=float(flops), memory_bytes_per_s=float(spec.hbm_bytes_per_s), launch_s=spec.shortest_kernel_s or GPU_LAUNCH_S,
                       link_bytes_per_s=spec.link_bytes_per_s / 2 if spec.link_bytes_per_s else None,
                       network_bytes_per_s=target.network_bytes_per_s, devices_per_node=target.devices_per_node,
                       generation=generation, class_flops_per_s={c: float(spec.tf32_flops_per_s) for c in tf32},
                       # a calibrated spec's own (remat calibrate), else the table's and the H200 host's
                       efficiency=efficiency_table(spec), host=host_costs_of(spec, GPU_HOST))


def tf32_classes(spec: DeviceSpec, dtype: torch.dtype) -> tuple[str, ...]:
    """The operator classes a GPU runs at its TF32 rate in a float32 step, as this process is set (Note [Device
    time model]): "conv" while cuDNN may use TF32 (torch's default), "matmul" where the float32 matmul precision
    allows it (not by default)."""
    if dtype != torch.float32 or not spec.tf32_flops_per_s:
        return ()
    return (("conv",) if torch.backends.cudnn.allow_tf32 else ()) + (
        ("matmul",) if torch.get_float32_matmul_precision() != "highest" else ())


def efficiencies_elsewhere(rates: DeviceRates, device: str) -> str:
    """What a plan's note says of efficiencies measured on another device than ``device`` (applied unmeasured)."""
    on: dict[str, list[str]] = {}
    for cls in ("matmul", "conv", "attention", "pointwise"):
        eff = rates.efficiency_of(cls)
        if eff.measured_on and eff.measured_on.lower() not in device.lower():
            # the figure that bounds the class: FLOP/s for products and attention, bandwidth for pointwise
            on.setdefault(eff.measured_on, []).append(
                f"{cls} {eff.memory if cls == 'pointwise' else eff.compute:.2f}")
    return "".join(f"; efficiencies measured on the {gpu}, applied to {device} unmeasured: {', '.join(c)}"
                   for gpu, c in on.items())


def group_of(op_name: str, target: Any) -> tuple[int, bool]:
    """The ranks a collective runs over and whether they span nodes: FSDP2's (``c10d.*``) over the FSDP
    dimension (its ranks ``tp`` apart), tensor parallelism's (``_c10d_functional.*``) over the TP dimension."""
    if op_name.startswith("c10d."):
        n = target.fsdp or 1
        return n, n * target.tp > target.devices_per_node
    return target.tp, target.tp > target.devices_per_node


def _moved_bytes(op: ForwardOp, n: int) -> int:
    """The size a ring collective moves, from the bytes it reads and writes: an all-gather's output (its input is
    1/n of it), a reduce-scatter's input, an all-reduce's tensor (read and written)."""
    if "all_reduce" in op.name or "allreduce" in op.name:
        return op.bytes_accessed // 2
    return op.bytes_accessed * n // (n + 1)


def operator_seconds(op: ForwardOp, rates: DeviceRates, target: Any) -> float:
    """One operator's predicted seconds on the target: a TP collective over its group; FSDP2's collectives 0
    (the step's, Note [FSDP2 prefetch]); any other by the roofline."""
    cls = op_class(op.name)
    if cls == "collective":
        if op.name.startswith("c10d."):
            return 0.0
        n, across = group_of(op.name, target)
        return collective_seconds(op.name, _moved_bytes(op, n), n, rates, across_nodes=across)
    return op_seconds(op.name, op.flops, op.bytes_accessed, rates, random=op.random)


@dataclass(frozen=True)
class StepTime:
    """One plain step's predicted seconds on the target (no checkpointing beyond the model's own)."""

    #: forward and loss: operators, plus FSDP2's gathers compute does not hide
    forward_s: float
    #: backward: operators, plus FSDP2's collectives compute does not hide
    backward_s: float
    #: FSDP2's collectives in all (forward and backward), hidden or not
    fsdp_comm_s: float
    #: of ``fsdp_comm_s``, not hidden behind compute (Note [FSDP2 prefetch])
    exposed_comm_s: float
    #: FLOPs of the forward and backward (a model FLOPs figure for MFU: the plain step's)
    flops: int


def step_time(rec: Recording, rates: DeviceRates, target: Any) -> StepTime:
    """The plain step's predicted forward and backward seconds from its recording (Note [FSDP2 prefetch])."""
    def comm(ops: Iterable[ForwardOp]) -> list[float]:
        out = []
        for op in ops:
            if op.name.startswith("c10d.") and op_class(op.name) == "collective":
                n, across = group_of(op.name, target)
                out.append(collective_seconds(op.name, _moved_bytes(op, n), n, rates, across_nodes=across))
        return out

    fwd_compute = sum(operator_seconds(op, rates, target) for op in rec.forward_ops)
    bwd_compute = sum(operator_seconds(op, rates, target) for op in rec.backward_ops)
    fwd_comm, bwd_comm = comm(rec.forward_ops), comm(rec.backward_ops)
    fwd_exposed = (fwd_comm[0] + max(0.0, sum(fwd_comm[1:]) - fwd_compute)) if fwd_comm else 0.0
    bwd_exposed = (bwd_comm[-1] + max(0.0, sum(bwd_comm[:-1]) - bwd_compute)) if bwd_comm else 0.0
    flops = sum(op.flops for op in rec.forward_ops) + sum(op.flops for op in rec.backward_ops)
    return StepTime(fwd_compute + fwd_exposed, bwd_compute + bwd_exposed, sum(fwd_comm) + sum(bwd_comm),
                    fwd_exposed + bwd_exposed, flops)


class OperatorTimes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every operator's predicted seconds on the target (a DTensor's on its local shards), e.g. over an
    optimizer step on fake tensors."""

    def __init__(self, rates: DeviceRates, target: Any) -> None:
        super().__init__()
        self.rates, self.target, self.seconds, self.operators = rates, target, 0.0, 0
        self._marked: Any = None

    def __enter__(self):
        from remat._compat import sharding_propagation_marked

        self._marked = sharding_propagation_marked()
        self._marked.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._marked.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from remat._compat import in_sharding_propagation, is_dtensor_class, op_bytes, op_flops

        kwargs = kwargs or {}
        if any(is_dtensor_class(t) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        # DTensor's sharding propagation runs operators at global shapes, once per new signature (then cached):
        # no kernel of the step (Note [Sharded tensors] in remat.runtime.tracker)
        if func.namespace != "prim" and not in_sharding_propagation():
            op = ForwardOp(str(func), (), flops=op_flops(func, args, kwargs, out),
                           bytes_accessed=op_bytes(func, args, kwargs, out))
            seconds = operator_seconds(op, self.rates, self.target)
            self.seconds += seconds
            self.operators += seconds > 0
        return out
