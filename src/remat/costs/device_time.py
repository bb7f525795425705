"""How long a device takes for one operator and one collective: the time model of a modelled target (issue
#40), torch-free. A model, not a measurement: every time it gives is predicted.

Note [Device time model]
~~~~~~~~~~~~~~~~~~~~~~~~
An operator takes the longer of its arithmetic and its memory traffic, each at a stated fraction of the device's
peak, and never less than a kernel launch (a roofline, as torchao's ``roofline_utils`` models a training step's
GEMMs and casts):

    seconds = max(flops / (peak_flops_per_s x compute_eff), bytes / (memory_bytes_per_s x memory_eff), launch_s)

``flops`` are torch's FLOP formulas (``torch.utils.flop_counter``; attention counted and causal halved by
remat._compat.op_flops), ``bytes`` the operator's tensor arguments and outputs (remat._compat.op_bytes); a view
moves nothing and launches nothing (0 s). The efficiencies are one table per operator class
(:data:`EFFICIENCY`), each with the published measurement it comes from; none was fitted to a result remat is
compared with; each says which device it was measured on (:attr:`Efficiency.measured_on`), and a plan for another
says so. The peak is the dense rate of the dtype the products run in (FSDP2's ``param_dtype``, else the model's).
In float32 a GPU with tensor cores runs convolutions at the TF32 rate (cuDNN's ``torch.backends.cudnn.allow_tf32``
is True by default) and matrix products at the plain FP32 rate (``torch.get_float32_matmul_precision()`` is
"highest" by default); remat reads both settings from the process that plans (:attr:`DeviceRates.class_flops_per_s`).

A collective moves its bytes over a ring (NCCL's algorithm for large messages): an all-gather or reduce-scatter
of ``S`` bytes (the gathered size) over ``n`` ranks takes ``S (n-1)/n / bus``, an all-reduce twice that, where
``bus`` is the link bandwidth in one direction per GPU at :data:`COLLECTIVE_EFFICIENCY`: NVLink (or the
device's link) while the group fits in one node, the network's per-GPU bandwidth once it spans nodes.

On Hopper the efficiencies are the H200's own, measured from its kernels (``benchmarks/h200/gpu_traces.py``, issue
#56): the model's seconds for each class at the peak rates against the class's kernel time in the trace of the
1B Llama's step (every block checkpointed); an H100 takes them unmeasured (same generation, its own peaks).

What it leaves out: kernel fusion (eager operators, one kernel each: a compiled step is not modelled), caches
(every byte from device memory), overlap of compute and communication other than FSDP2's prefetch
(remat.target.timing), stragglers and clock throttling.

Note [Host time model]
~~~~~~~~~~~~~~~~~~~~~~
In eager mode the host dispatches every operator (Python, the dispatcher, autograd, the kernel's launch) while the
GPU runs what it was given before: a phase (forward, backward) takes the longer of its GPU work and its host work,
never their sum (the launch queue was never full in the H200's traces: no launch took over 56 µs). The host's
work is decomposed by what causes it (Note [Host time decomposed] in remat.costs.host_time): the model's own
(its Python, modules, autograd: measured on the model being planned, on fake tensors, between its operators), the
device's per operator (:class:`HostCosts`: the dispatcher, the operator's host code, the allocator, the launch),
and what checkpointing adds (measured on the planning machine). No figure was fitted to a step time. What it
leaves out: the optimizer's host time (its foreach operators are few and long: GPU-bound), synchronisations
(none in an eager step without ``.item()``), the queue's depth.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["Efficiency", "EFFICIENCY", "DeviceRates", "HostCosts", "GPU_HOST", "op_class", "op_seconds",
           "collective_seconds", "COLLECTIVE_EFFICIENCY"]


@dataclass(frozen=True)
class Efficiency:
    """The fractions of a device's peak FLOP/s (``compute``) and peak memory bandwidth (``memory``) that an
    operator class reaches at the sizes training uses, and the measurement they come from."""

    compute: float
    memory: float
    source: str
    #: the device the figures were measured on ("" where none was): applied to others unmeasured
    measured_on: str = ""


_TORCHAO = ("torchao testing/training/roofline_utils.py (pytorch/ao): pct_achievable_gemm_tops 0.78 'based on "
            "experimental observation with sample large inputs' and pct_achievable_mem_bw 0.92 (pointwise triton "
            "kernels with large inputs) on H100")

_H200 = ("measured on the H200 (torch 2.11, 2026-12-04) from its kernels in llama1b__1.trace.json.gz (a 1B Llama's "
         "step, every block checkpointed; benchmarks/h200/gpu_traces.py --calibrate): ")
_ELEMENTWISE = ("elementwise, copy and reduction kernels 76.89 ms for what the model moves in 45.58 ms at the peak "
                "4.8 TB/s (2.8 TB/s achieved: many kernels strided, broadcast or in float32, in torch's "
                "unvectorized loops)")

#: per operator class, the fractions of peak reached (Note [Device time model]). "attention@hopper": torch's
#: flash attention is FlashAttention-2, which does not use Hopper's asynchronous tensor-core instructions
EFFICIENCY: Mapping[str, Efficiency] = MappingProxyType({
    "matmul": Efficiency(0.78, 0.92, _TORCHAO, "H100"),
    "conv": Efficiency(0.78, 0.92, "as matmul (cuDNN's implicit GEMM): no separate published figure used", "H100"),
    "attention": Efficiency(0.70, 0.92, "FlashAttention-2 (Dao, 2023, arXiv:2307.08691): forward up to 73% of "
                                        "A100's peak, training 225 TFLOP/s of 312 (72%)", "A100"),
    # torch picks cuDNN's attention on Hopper for bf16 (the H200's traces: cudnn sdpa flash fprop/bprop kernels)
    "attention@hopper": Efficiency(0.33, 0.92, _H200 + "cuDNN's attention forward and backward (causal, head "
                                               "dimension 64): 5.00 ms of FLOPs (causal: halved) at the dense peak "
                                               "in 15.26 ms", "H200"),
    "pointwise": Efficiency(1.0, 0.92, _TORCHAO, "H100"),
    # the optimizer's foreach kernels (multi_tensor_apply): as pointwise where not measured
    "foreach": Efficiency(1.0, 0.92, "as pointwise: " + _TORCHAO, "H100"),
    # Hopper: measured on the H200 (Note [Device time model]; benchmarks/h200/gpu_traces.py --calibrate prints them)
    "matmul@hopper": Efficiency(0.80, 0.92, _H200 + "matrix products: 72.3 TFLOP (73.05 ms at the dense peak) in "
                                            "91.12 ms of cuBLAS's nvjet kernels", "H200"),
    "pointwise@hopper": Efficiency(1.0, 0.59, _H200 + _ELEMENTWISE, "H200"),
    "transcendental@hopper": Efficiency(1.0, 0.59, _H200 + _ELEMENTWISE, "H200"),
    "reduction@hopper": Efficiency(1.0, 0.59, _H200 + _ELEMENTWISE, "H200"),
    "foreach@hopper": Efficiency(1.0, 0.46, _H200 + "AdamW's foreach kernels: 15.56 ms of multi_tensor_apply for "
                                           "what the model moves in 7.21 ms at the peak bandwidth", "H200"),
    "transcendental": Efficiency(1.0, 0.92, "as pointwise on a GPU (bandwidth-bound): " + _TORCHAO, "H100"),
    "reduction": Efficiency(1.0, 0.92, "as pointwise (norms, softmax, losses read their input once): "
                                       + _TORCHAO, "H100"),
})

#: fraction of a link's one-direction bandwidth a ring collective reaches (NCCL's "bus bandwidth"):
#: nccl-tests on 8 A100 SXM4 over NVLink 3 read 230-250 GB/s of 300 (docs.alayanew.com, "NCCL-tests in
#: practice", reference table; 8 H100 over NVLink 4 reach 460-480 of 450 with NVLink SHARP, which rings do not use)
COLLECTIVE_EFFICIENCY = 0.8

#: seconds of the shortest kernel: torchao's KERNEL_LAUNCH_OVERHEAD_SEC, "a triton kernel with a single element
#: read/write on an H100", measured from the GPU's trace
GPU_LAUNCH_S = 2e-6

_MATMUL = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "linear", "matmul", "addbmm", "_int_mm")
_REDUCTION = ("sum", "mean", "norm", "softmax", "_log_softmax", "_softmax", "amax", "amin", "max", "min", "var",
              "std", "nll_loss", "cross_entropy", "layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm",
              "group_norm", "native_group_norm", "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
              "cumsum", "argmax", "argmin", "logsumexp", "prod", "_foreach_norm", "embedding_dense_backward",
              # windowed reductions
              "max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d", "max_pool3d_with_indices",
              "avg_pool3d", "_adaptive_avg_pool2d")


#: elementwise functions a CPU computes by polynomial or table (compute-bound there, bandwidth-bound on a GPU)
_TRANSCENDENTAL = ("gelu", "silu", "sigmoid", "tanh", "exp", "log", "erf", "rsqrt", "sqrt", "pow", "softplus",
                   "mish", "elu", "sin", "cos", "log_sigmoid_forward", "log1p", "expm1", "reciprocal")


@dataclass(frozen=True)
class HostCosts:
    """What one operator costs the device's host below the model's own work (Note [Host time decomposed] in
    remat.costs.host_time), and where the figure comes from."""

    #: seconds per operator of the forward (and of a recomputation): the dispatcher, the operator's host code,
    #: the caching allocator, the launch
    forward_op_s: float
    #: seconds per operator of the backward: the same, and the autograd engine's work per node on the device
    backward_op_s: float
    source: str
    #: what a selective unit's dispatch mode adds to each operator of its forward, and of its recomputation, on
    #: this host; None: as measured on the planning machine (remat.costs.recording.CheckpointOverhead)
    selective_forward_op_s: float | None = None
    selective_recompute_op_s: float | None = None


#: the H200's host (torch 2.11, 2026-12-04): what its operators cost below the model's own work, derived from
#: llama1b__1's profiled forward by ``python benchmarks/h200/gpu_traces.py --host`` through
#: remat.costs.host_time.op_s_from_phase (the function ``remat calibrate`` uses), the inputs measured on this
#: project's CPU in benchmarks/h200/data/host_inputs.json; no phase of the traces runs a backward without recomputing,
#: so the backward's operators take the forward's figure. Carried to every CUDA target unmeasured
GPU_HOST = HostCosts(
    forward_op_s=9.86e-6, backward_op_s=9.86e-6,
    selective_forward_op_s=62.28e-6, selective_recompute_op_s=30.90e-6,
    source="the H200's host (torch 2.11, 2026-12-04; benchmarks/h200/gpu_traces.py --host): llama1b__1's profiled "
           "forward, 35.35 ms of host wall, less the model's own work between its operators "
           "(16.51 ms, measured on fake tensors on a 2-core x86-64 CPU), 16 checkpointed blocks' "
           "bookkeeping (5.72 ms) and the profiler's 3,278 events (0.18 us each, "
           "measured there), over its 1,270 operators; the selective figures from llama1b__4's forward "
           "and backward (16 selective units) less what is known of them, over their operators")


def op_class(name: str) -> str:
    """The class of an operator (``"aten.addmm.default"``): "matmul", "conv", "attention", "collective",
    "reduction", "transcendental" (GELU, SiLU, exp, ...), "foreach" (an optimizer's ``_foreach_*``) or
    "pointwise" (every other kernel); a backward takes its forward's class; "none" for waiting
    on a collective (no kernel)."""
    parts = name.split(".")
    namespace, base = (parts[0], parts[1]) if len(parts) > 1 else ("", parts[0])
    if namespace in ("c10d", "_c10d_functional", "c10d_functional", "_dtensor"):
        return "none" if base.startswith(("wait", "barrier", "monitored_barrier")) else "collective"
    if base.startswith("_foreach_"):
        return "foreach"
    if "attention" in base:
        return "attention"
    if "convolution" in base or base.startswith(("conv", "cudnn_convolution", "mkldnn_convolution")):
        return "conv"
    stem = base.removesuffix("_backward").removesuffix("_")
    if stem in _MATMUL:
        return "matmul"
    if stem in _REDUCTION or stem.removesuffix("_backward") in _REDUCTION:
        return "reduction"
    if stem in _TRANSCENDENTAL:
        return "transcendental"
    return "pointwise"


@dataclass(frozen=True)
class DeviceRates:
    """What the time model reads of a device: its dense peak FLOP/s in the products' dtype, its memory's peak
    bandwidth, the shortest kernel, its links (one direction, per GPU) and the efficiency table to use."""

    #: a name for notes, e.g. "NVIDIA H100 SXM 80GB, bf16"
    name: str
    flops_per_s: float
    memory_bytes_per_s: float
    launch_s: float
    #: host seconds added to every kernel: a CPU runs its operators as the host dispatches them (synchronously);
    #: 0 for a GPU, whose host runs ahead of it
    dispatch_s: float = 0.0
    #: within a node (NVLink, Infinity Fabric, PCIe), one direction; None: unknown (collectives cost nothing)
    link_bytes_per_s: float | None = None
    #: between nodes, per GPU, one direction (e.g. 400 Gb/s InfiniBand: 50e9)
    network_bytes_per_s: float | None = None
    #: GPUs a node holds (a group larger than this crosses the network)
    devices_per_node: int = 8
    #: bytes/s (as :func:`op_seconds` counts them) of an operator that draws random numbers, where the generator
    #: and not memory bounds it (a CPU's: measured); None: a pointwise operator like any other (a GPU's Philox)
    random_bytes_per_s: float | None = None
    #: per operator class, the efficiencies (keys of :data:`EFFICIENCY`, one suffixed "@generation" preferred)
    efficiency: Mapping[str, Efficiency] = field(default_factory=lambda: EFFICIENCY)
    #: e.g. "hopper": selects "attention@hopper" where the table has it
    generation: str = ""
    #: per operator class, a peak other than ``flops_per_s``: float32 convolutions (and products, where the
    #: process allows it) at the TF32 tensor-core rate (Note [Device time model])
    class_flops_per_s: Mapping[str, float] = field(default_factory=dict)

    #: host seconds per operator (Note [Host time model]); None: the host is not modelled (a CPU's operators are
    #: timed with their dispatch in ``dispatch_s``)
    host: HostCosts | None = None

    def efficiency_of(self, cls: str) -> Efficiency:
        found = self.efficiency.get(f"{cls}@{self.generation}") or self.efficiency.get(cls)
        if found is None and cls == "foreach":  # a table without the class: as pointwise (a CPU's)
            return self.efficiency_of("pointwise")
        return found or Efficiency(1.0, 1.0, "no figure: peak")


def op_seconds(name: str, flops: int, bytes_accessed: int, rates: DeviceRates, *, random: bool = False) -> float:
    """Predicted seconds of one operator on the device (Note [Device time model]); 0 for one that launches no
    kernel (no FLOPs and no bytes: a view). A collective's time comes from :func:`collective_seconds`.
    ``random``: the operator draws random numbers (dropout), at ``rates.random_bytes_per_s`` where known."""
    cls = op_class(name)
    if (flops <= 0 and bytes_accessed <= 0) or cls == "none":
        return 0.0
    if random and rates.random_bytes_per_s and cls in ("pointwise", "transcendental"):
        return max(bytes_accessed / rates.random_bytes_per_s, rates.launch_s) + rates.dispatch_s
    eff = rates.efficiency_of(cls)
    peak = rates.class_flops_per_s.get(cls, rates.flops_per_s)
    compute = flops / (peak * eff.compute) if flops > 0 else 0.0
    memory = bytes_accessed / (rates.memory_bytes_per_s * eff.memory) if bytes_accessed > 0 else 0.0
    return max(compute, memory, rates.launch_s) + rates.dispatch_s


def collective_seconds(kind: str, nbytes: int, group_size: int, rates: DeviceRates, *,
                       across_nodes: bool | None = None) -> float:
    """Predicted seconds of a ring collective over ``group_size`` ranks, ``nbytes`` the gathered (all-gather),
    scattered-from (reduce-scatter) or reduced (all-reduce) size: ``(n-1)/n`` of it crosses each link, twice for
    an all-reduce, at :data:`COLLECTIVE_EFFICIENCY` of the link within a node or of the network across nodes;
    plus one launch. ``across_nodes``: whether the group's ranks span nodes (default: it holds more ranks than a
    node has devices). 0 for a group of one or a device without a known link."""
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    if across_nodes is None:
        across_nodes = group_size > rates.devices_per_node
    bandwidth = rates.network_bytes_per_s if across_nodes else rates.link_bytes_per_s
    if not bandwidth:
        return 0.0
    passes = 2 if "all_reduce" in kind or "allreduce" in kind else 1
    return passes * nbytes * (group_size - 1) / group_size / (bandwidth * COLLECTIVE_EFFICIENCY) + rates.launch_s
