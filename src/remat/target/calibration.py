"""What ``remat calibrate`` measured on a GPU, and the device spec file it makes of it (issue #56). Stdlib only:
the measurements are plain numbers (:class:`Measurements`), measured by remat.target.measure_device; this module
maps them to the spec's fields and their notes, and is tested on hand-written measurements.

Note [Calibrated fields]
~~~~~~~~~~~~~~~~~~~~~~~~
The time model (remat.costs.device_time) reads a device as peaks (FLOP/s per dtype, memory bandwidth) times a
fraction of them per operator class, plus host seconds per operator. A calibration measures what the classes
reach here and writes each as the fraction of the spec's peak that gives the measured rate:

* **peaks**: the base device's (its datasheet's) where the GPU here is a built-in one (``--base``, or the table's
  entry torch's name matches); for a GPU not in the table, each dtype's best measured rate and the best measured
  bandwidth (noted so: a datasheet's peak is higher, and the fractions below are of these);
* ``efficiency.matmul.compute``: square bf16 products at each size measured, less the smallest (launch-bound):
  the mean of their rates over the bf16 peak. fp16, TF32 and plain fp32 are measured and noted; the model applies
  one fraction to every dtype;
* ``efficiency.attention.compute``: ``scaled_dot_product_attention`` forward and backward (causal, bf16, the
  kernel torch picks, noted): the model's FLOPs for them (remat._compat.op_flops: causal halved) over the bf16
  peak, over their measured time;
* ``efficiency.{pointwise,transcendental,reduction,foreach}.memory``: each class's samples at a training step's
  sizes, the bytes the model counts for them (remat._compat.op_bytes) over the bandwidth peak, over their time;
* ``host_forward_op_s``, ``host_backward_op_s``: what one operator costs the host below the model's own work (the
  dispatcher, the operator's host code, the allocator, the launch): decoder blocks (RMS norm written out as
  Hugging Face writes it, gated MLP, residual) at the samples' width and tokens, bf16, forward and backward timed
  on the host without waiting for the GPU, less the blocks' own work between their operators (measured as for a
  planned model), over the operators, per phase
  (remat.costs.host_time.op_s_from_phase, the function the built-in H200 figure is derived with); what
  checkpointing adds to a host is measured where remat plans (Note [Host time decomposed]);
* ``device_to_host_bytes_per_s``, ``host_to_device_bytes_per_s``: copies between device memory and pinned host
  memory; pageable copies are noted (the offloader never copies from pageable memory on a GPU);
* ``shortest_kernel_s``: one-element additions captured in a CUDA graph and replayed (no host between them),
  GPU time per kernel: the model's floor for any operator (a GPU only);
* ``memory_bytes``: ``total_memory``; ``compute_capability`` as torch reports it, and ``generation`` from it.

Nothing here is fitted to a step time: every figure is a rate of the kernels or the host measured directly.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from dataclasses import dataclass
from typing import Any

__all__ = ["Environment", "GemmRate", "ClassSample", "HostSample", "CopyRate", "Measurements",
           "calibrated_file", "generation_for", "MEMORY_CLASSES"]

#: the operator classes bound by memory bandwidth whose fraction a calibration measures
MEMORY_CLASSES = ("pointwise", "transcendental", "reduction", "foreach")

#: compute capability (major, minor) to the generation names of the device table and the time model
_GENERATIONS = {(8, 0): "ampere", (8, 6): "ampere", (8, 7): "ampere", (8, 9): "ada", (9, 0): "hopper"}


def generation_for(capability: tuple[int, int] | None) -> str:
    """The generation of a GPU of this compute capability ("hopper" for 9.0; Blackwell's 10.x and 12.x), "" if
    unknown."""
    if capability is None:
        return ""
    if capability[0] in (10, 12):
        return "blackwell"
    return _GENERATIONS.get(tuple(capability), "")


@dataclass(frozen=True)
class Environment:
    """Where the measurements ran."""

    #: torch's name of the GPU ("NVIDIA H200"), or "cpu" for the CPU test run
    device_name: str
    #: False for the CPU test run (not a GPU calibration)
    is_gpu: bool
    total_memory_bytes: int
    torch_version: str
    #: the CUDA torch was built with ("" on a CPU)
    cuda_version: str = ""
    #: the NVIDIA driver's version ("" where it could not be read)
    driver_version: str = ""
    capability: tuple[int, int] | None = None
    #: ISO 8601, UTC
    date: str = ""
    #: the host (platform.platform())
    machine: str = ""


@dataclass(frozen=True)
class GemmRate:
    """One square matrix product timed: ``size`` x ``size`` by ``size`` x ``size`` in ``dtype``."""

    #: "bfloat16", "float16", "tf32" (float32 inputs, TF32 tensor cores) or "float32" (TF32 off)
    dtype: str
    size: int
    flops: int
    seconds: float

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds


@dataclass(frozen=True)
class ClassSample:
    """Operators of one class timed together: the FLOPs and bytes the time model counts for them, the seconds
    measured. ``op_class`` "bandwidth": a plain large copy, read for the peak bandwidth only."""

    op_class: str
    label: str
    flops: int
    bytes_accessed: int
    seconds: float
    #: the operators that ran (e.g. the attention kernel torch picked)
    operators: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostSample:
    """The device host's seconds per operator (Note [Calibrated fields]) and what they were derived from."""

    #: seconds per forward and per backward operator below the blocks' own work (op_s_from_phase)
    forward_op_s: float
    backward_op_s: float
    #: per phase ("forward", "backward"): the host's wall seconds (the least of the steps timed), of them the
    #: blocks' own work between operators, and the operators dispatched
    wall_s: tuple[float, float]
    python_s: tuple[float, float]
    ops: tuple[int, int]
    label: str = ""


@dataclass(frozen=True)
class CopyRate:
    """One copy between device and host memory timed."""

    #: "device_to_host" or "host_to_device"
    direction: str
    pinned: bool
    nbytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds


@dataclass(frozen=True)
class Measurements:
    """Everything one calibration measured."""

    environment: Environment
    gemm: tuple[GemmRate, ...]
    samples: tuple[ClassSample, ...]
    host: HostSample
    copies: tuple[CopyRate, ...]
    #: wall seconds the calibration took
    seconds: float = 0.0
    quick: bool = False
    #: GPU seconds of a one-element kernel replayed from a CUDA graph (None: not measured, as on a CPU)
    shortest_kernel_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurements:
        env = dict(d["environment"])
        env["capability"] = tuple(env["capability"]) if env.get("capability") else None
        return cls(environment=Environment(**env), gemm=tuple(GemmRate(**g) for g in d["gemm"]),
                   samples=tuple(ClassSample(**{**s, "operators": tuple(s.get("operators", ()))})
                                 for s in d["samples"]),
                   host=HostSample(**{k: tuple(v) if isinstance(v, list) else v
                                      for k, v in d["host"].items()}), copies=tuple(CopyRate(**c) for c in d["copies"]),
                   seconds=d.get("seconds", 0.0), quick=d.get("quick", False),
                   shortest_kernel_s=d.get("shortest_kernel_s"))


_PEAK_FIELD = {"bfloat16": "bf16_flops_per_s", "float16": "fp16_flops_per_s", "tf32": "tf32_flops_per_s",
               "float32": "fp32_flops_per_s"}


def flops_text(x: float) -> str:
    """A FLOP/s figure as printed: TFLOP/s from 10^12, else GFLOP/s."""
    return f"{x / 1e12:.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.2f} GFLOP/s"


def _gbs(x: float) -> str:
    return f"{x / 1e9:.1f} GB/s" if x >= 1e9 else f"{x / 1e6:.1f} MB/s"


def _us(x: float) -> str:
    return f"{x * 1e6:.2f} us"


class _Written:
    """The spec file's fields as :func:`calibrated_file` writes them, each figure with its note."""

    def __init__(self, test: str) -> None:
        self.test = test  # "" on a GPU; the CPU test run's label otherwise
        self.fields: dict[str, Any] = {}
        self.notes: list[list[str]] = []

    def put(self, field: str, value: Any, note: str) -> None:
        self.fields[field] = value
        self.notes.append([field, "doc:calibration", note])

    def note(self, field: str, note: str) -> None:
        self.notes.append([field, "doc:calibration", note])


def calibrated_file(m: Measurements, base: Any = None, *, name: str | None = None) -> dict[str, Any]:
    """The spec file's object for the measurements ``m`` (Note [Calibrated fields]): derived from ``base`` (a
    :class:`~remat.target.devices.DeviceSpec` of the built-in table, or None: every peak measured), each figure
    with its note, the raw measurements under ``"calibration"``. remat.target.spec_file reads it back."""
    env = m.environment
    w = _Written("" if env.is_gpu else "CPU test run, not a GPU calibration: ")
    test = w.test
    gpu_key = re.sub(r"[^a-z0-9]+", "-", env.device_name.lower()).strip("-").removeprefix("nvidia-")
    name = name or (f"{base.name}-calibrated" if base is not None and env.is_gpu
                    else f"{gpu_key}-calibrated" if env.is_gpu else "cpu-test-calibration")
    w.fields["name"] = name
    w.fields["title"] = (f"{env.device_name} (calibrated {env.date[:10]})" if env.is_gpu
                         else "CPU test run of remat calibrate (not a GPU calibration)")
    if env.device_name.upper().startswith("NVIDIA"):
        w.fields["vendor"] = "NVIDIA"
    generation = generation_for(env.capability)
    if generation:
        w.put("generation", generation, f"{test}compute capability {env.capability[0]}.{env.capability[1]}")
    if env.capability is not None and env.is_gpu:
        w.put("compute_capability", list(env.capability), "torch.cuda.get_device_capability()")
    w.put("memory_bytes", int(env.total_memory_bytes),
          f"{test}torch.cuda.get_device_properties().total_memory: {env.total_memory_bytes:,} bytes"
          if env.is_gpu else f"{test}this machine's physical memory (os.sysconf)")
    efficiency = {**_products_and_attention(m, base, w), **_memory_classes(m, base, w)}
    if efficiency:
        w.fields["efficiency"] = efficiency
    _host_and_copies(m, w)
    out: dict[str, Any] = {
        "about": "A device spec measured by remat calibrate (docs/targets.md, 'Calibrating on your GPU'): plan "
                 "with --device THIS_FILE or Target(device=THIS_FILE). Fields not given are the base's.",
    }
    if base is not None:
        out["base"] = base.name
    out.update(w.fields)
    out["documents"] = {"calibration": _environment_text(m)}
    out["sources"] = w.notes
    out["calibration"] = m.to_dict()
    return out


def _products_and_attention(m: Measurements, base: Any, w: _Written) -> dict[str, dict[str, float]]:
    """The products' rates by dtype and size (a peak per dtype: the base's, else the best measured) and the
    efficiencies of products and attention, as fractions of the reference dtype's peak."""
    test = w.test
    by_dtype: dict[str, list[GemmRate]] = {}
    for g in sorted(m.gemm, key=lambda g: g.size):
        by_dtype.setdefault(g.dtype, []).append(g)
    listing = "; ".join(f"{d} " + ", ".join(f"{g.size}: {flops_text(g.flops_per_s)}" for g in gs)
                        for d, gs in by_dtype.items())
    peaks: dict[str, float] = {}
    for dtype, gs in by_dtype.items():
        field = _PEAK_FIELD[dtype]
        if base is not None and getattr(base, field):
            peaks[dtype] = getattr(base, field)
        else:
            best = max(gs, key=lambda g: g.flops_per_s)
            peaks[dtype] = best.flops_per_s
            w.put(field, best.flops_per_s, f"{test}measured: the best rate of square {dtype} products here "
                                           f"({best.size}), not a datasheet peak (none is known for this GPU); "
                                           f"every size: {listing}")
    ref = "bfloat16" if "bfloat16" in by_dtype else next(iter(by_dtype), None)
    efficiency: dict[str, dict[str, float]] = {}
    if ref is None:
        return efficiency
    gs = by_dtype[ref]
    used = gs[1:] if len(gs) > 1 else gs
    fraction = statistics.fmean(g.flops_per_s / peaks[ref] for g in used)
    others = "; ".join(f"{d} at {statistics.fmean(g.flops_per_s for g in (x[1:] if len(x) > 1 else x)) / peaks[d]:.2f}"
                       f" of its {flops_text(peaks[d])}" for d, x in by_dtype.items() if d != ref)
    efficiency["matmul"] = {"compute": fraction}
    w.note("efficiency.matmul",
           f"{test}square {ref} products at {', '.join(str(g.size) for g in used)}: the mean of their "
           f"rates over the {ref} peak {flops_text(peaks[ref])} ({fraction:.3f}); every size measured: "
           f"{listing}" + (f"; the other dtypes reach {others} (the model applies {fraction:.2f} to "
                           f"every dtype)" if others else "")
           + ("; ABOVE the base's peak: is the base this GPU?" if fraction > 1 else ""))
    # attention: FLOPs at the products' dtype peak
    attention = [s for s in m.samples if s.op_class == "attention"]
    if attention:
        fraction = sum(s.flops for s in attention) / peaks[ref] / sum(s.seconds for s in attention)
        efficiency["attention"] = {"compute": fraction}
        kernels = sorted({o for s in attention for o in s.operators if "attention" in o})
        w.note("efficiency.attention",
               f"{test}scaled_dot_product_attention forward and backward ("
               + "; ".join(f"{s.label}: {flops_text(s.flops / s.seconds)}" for s in attention)
               + f"; kernels {', '.join(kernels) or 'not recorded'}): the model's FLOPs (causal halved) "
                 f"over the {ref} peak {flops_text(peaks[ref])}, over the time measured ({fraction:.3f})")
    return efficiency


def _memory_classes(m: Measurements, base: Any, w: _Written) -> dict[str, dict[str, float]]:
    """The memory-bound classes' efficiencies, as fractions of the bandwidth peak (the base's, else the best
    measured)."""
    test = w.test
    efficiency: dict[str, dict[str, float]] = {}
    memory_samples = [s for s in m.samples if s.op_class in MEMORY_CLASSES + ("bandwidth",)]
    if base is not None and base.hbm_bytes_per_s:
        bandwidth = float(base.hbm_bytes_per_s)
    elif memory_samples:
        best = max(memory_samples, key=lambda s: s.bytes_accessed / s.seconds)
        bandwidth = best.bytes_accessed / best.seconds
        w.put("hbm_bytes_per_s", bandwidth, f"{test}measured: the best bandwidth reached here ({best.label}: "
                                            f"bytes read and written over its time), not a datasheet peak (none "
                                            f"is known for this GPU)")
    for cls in MEMORY_CLASSES:
        samples = [s for s in m.samples if s.op_class == cls]
        if not samples or not memory_samples:
            continue
        fraction = sum(s.bytes_accessed for s in samples) / bandwidth / sum(s.seconds for s in samples)
        efficiency[cls] = {"memory": fraction}
        w.note(f"efficiency.{cls}",
               f"{test}" + "; ".join(f"{s.label}: {_gbs(s.bytes_accessed / s.seconds)}" for s in samples)
               + f": the bytes the model counts over the bandwidth peak {_gbs(bandwidth)}, over the time "
                 f"measured ({fraction:.3f})")
    return efficiency


def _host_and_copies(m: Measurements, w: _Written) -> None:
    """The host's seconds per operator, the shortest kernel and the copy rates each way."""
    test, h = w.test, m.host
    for i, phase in enumerate(("forward", "backward")):
        w.put(f"host_{phase}_op_s", (h.forward_op_s, h.backward_op_s)[i],
              f"{test}{h.label}: the {phase} {_us(h.wall_s[i])} on the host, less the blocks' own work between "
              f"operators {_us(h.python_s[i])}, over {h.ops[i]} operators (Note [Host time decomposed] in "
              "remat.costs.host_time)")
    if m.shortest_kernel_s is not None:
        w.put("shortest_kernel_s", m.shortest_kernel_s,
              f"{test}one-element additions captured in a CUDA graph and replayed: GPU time per kernel, no host "
              f"between them ({_us(m.shortest_kernel_s)}; the time model's floor for any operator)")

    def rate(direction: str, pinned: bool) -> CopyRate | None:
        found = [c for c in m.copies if c.direction == direction and c.pinned == pinned]
        return max(found, key=lambda c: c.bytes_per_s) if found else None

    for direction in ("device_to_host", "host_to_device"):
        pinned, pageable = rate(direction, True), rate(direction, False)
        use = pinned or pageable
        if use is None:
            continue
        text = direction.replace("_", " ")
        w.put(f"{direction}_bytes_per_s", use.bytes_per_s,
              f"{test}a copy {text}, {use.nbytes / 2**20:.0f} MiB "
              + (f"with pinned host memory: {_gbs(use.bytes_per_s)}" if pinned else
                 f"with pageable host memory (none pinned here): {_gbs(use.bytes_per_s)}")
              + (f"; from pageable memory: {_gbs(pageable.bytes_per_s)}" if pinned and pageable else ""))


def _environment_text(m: Measurements) -> str:
    """The calibration's document: where, when and with what it was measured."""
    env = m.environment
    return (f"remat calibrate on {env.device_name}"
            + (f" (compute capability {env.capability[0]}.{env.capability[1]})" if env.capability else "")
            + f", {env.date}: torch {env.torch_version}"
            + (f", CUDA {env.cuda_version}" if env.cuda_version else "")
            + (f", driver {env.driver_version}" if env.driver_version else (", driver not read" if env.is_gpu
                                                                              else ""))
            + (f", {env.machine}" if env.machine else "")
            + ("" if env.is_gpu else "; a test run of the pipeline on the CPU, NOT a GPU calibration")
            + f"; {m.seconds:.0f} s" + (", --quick" if m.quick else ""))
