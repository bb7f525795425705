"""What this machine's CPU can do at most, from what it reports of itself (``/proc/cpuinfo``, the CPUs this process
may run on), for tests of remat.target.timing.measure_cpu: each limit is a bound no correct measurement can pass,
however busy or idle the machine, so that the tests assert no time (the project's rule) and still catch a
measurement that reads too fast (:func:`rate_violations`).

Every figure here is an upper bound, generous where the hardware does not say more:

* the clock: :data:`MAX_CLOCK_HZ`, or more where the machine reports more. A virtual machine's ``cpu MHz`` is its
  nominal clock (this one's reads 2,596 MHz, and has no cpufreq), which boost may pass, and cpufreq's
  ``cpuinfo_max_freq`` may leave out boost (AMD's, under acpi-cpufreq): neither bounds the clock;
* the cores: the logical CPUs the process may run on, or torch's threads where fewer (a matrix product runs on
  torch's intra-op threads); SMT siblings count as cores (an over-count);
* FLOPs a cycle per core, by the vector extensions the CPU reports (:func:`fp32_flops_per_cycle`,
  :func:`bf16_flops_per_cycle`; float32 products at bfloat16's where ``torch.get_float32_matmul_precision()`` is
  not "highest");
* bytes a cycle per core: four 64-byte accesses (:data:`BYTES_PER_CYCLE`), more than any x86 core's first-level
  cache serves (two 64-byte loads and one or two stores a cycle: Intel since Skylake-SP, AMD Zen 5).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

#: the highest clock any x86 CPU is sold to run at: Intel Core i9-14900KS, 6.2 GHz (turbo, 2024)
MAX_CLOCK_HZ = 6.2e9
#: bytes a core moves a cycle at most (:mod:`cpu_limits`' docstring)
BYTES_PER_CYCLE = 4 * 64
#: an eager operator's host cost at least: 620 cycles at :data:`MAX_CLOCK_HZ` (a Python call into the dispatcher,
#: autograd's record and the kernel's launch on the host take microseconds on any CPU)
MIN_DISPATCH_S = 1e-7


@dataclass(frozen=True)
class CpuLimits:
    """Upper bounds of this machine's CPU rates, and how each was reached."""

    cores: int
    clock_hz: float
    fp32_flops_per_cycle: int
    bf16_flops_per_cycle: int

    @property
    def fp32_flops_per_s(self) -> float:
        return self.cores * self.clock_hz * self.fp32_flops_per_cycle

    @property
    def bf16_flops_per_s(self) -> float:
        return self.cores * self.clock_hz * self.bf16_flops_per_cycle

    @property
    def bytes_per_s(self) -> float:
        return self.cores * self.clock_hz * BYTES_PER_CYCLE

    def __str__(self) -> str:
        return (f"{self.cores} cores x {self.clock_hz / 1e9:.2f} GHz x {self.fp32_flops_per_cycle} float32 FLOPs a "
                f"cycle = {self.fp32_flops_per_s / 1e9:.0f} GFLOP/s ({self.bf16_flops_per_cycle} bfloat16: "
                f"{self.bf16_flops_per_s / 1e9:.0f}), {self.bytes_per_s / 1e9:.0f} GB/s")


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def has_float16_arithmetic(info: dict[str, str] | None = None) -> bool:
    """Whether the CPU multiplies float16 in hardware (AVX512-FP16 or AMX-FP16); without, torch's float16 matrix
    products run a reference loop (a 1024-square product took 3.1 s on this machine's AMD EPYC)."""
    flags = set((info if info is not None else cpuinfo()).get("flags", "").split())
    return bool(flags & {"avx512_fp16", "amx_fp16"})


def fp32_flops_per_cycle(info: dict[str, str]) -> int:
    """Float32 FLOPs one core does a cycle at most (a fused multiply-add two), by the widest vector extension it
    reports: AVX-512, two 512-bit FMA pipes (2 x 16 lanes x 2; AMD before Zen 5, family 0x19 and below, runs a
    512-bit operation as two halves on two 256-bit pipes: 32); AVX2 with FMA, two 256-bit FMA pipes (32); AVX, a
    256-bit multiply and a 256-bit add (16); SSE 8. Another architecture (no x86 flags): 64, more than Arm's
    cores issue (four 128-bit FMAs: 32)."""
    flags = set(info.get("flags", "").split())
    if not flags:
        return 64
    if "avx512f" in flags:
        family = int(info.get("cpu family", "0") or 0)
        return 32 if info.get("vendor_id") == "AuthenticAMD" and family < 0x1A else 64
    if "fma" in flags or "avx2" in flags:
        return 32
    if "avx" in flags:
        return 16
    return 8


def bf16_flops_per_cycle(info: dict[str, str]) -> int:
    """bfloat16 FLOPs one core does a cycle at most: AMX's tile unit 2,048 (1,024 multiply-adds, Intel's figure for
    Sapphire Rapids); AVX512-BF16 twice float32's (VDPBF16PS: two products per float32 lane); else float32's (the
    products run in float32 after conversion)."""
    flags = set(info.get("flags", "").split())
    if "amx_bf16" in flags or not flags:  # (not x86: Arm's matrix instructions multiply bfloat16 faster too)
        return 2048
    if "avx512_bf16" in flags:
        return 2 * fp32_flops_per_cycle(info)
    return fp32_flops_per_cycle(info)


def clock_ceiling_hz(info: dict[str, str]) -> float:
    """:data:`MAX_CLOCK_HZ`, or the most any CPU of this machine reports where that is more (an overclock)."""
    reported = [MAX_CLOCK_HZ]
    try:
        reported.append(float(info.get("cpu MHz", "0")) * 1e6)
    except ValueError:
        pass
    for f in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/cpuinfo_max_freq"):
        try:
            reported.append(float(f.read_text()) * 1e3)
        except (OSError, ValueError):
            pass
    return max(reported)


def cpu_limits(threads: int | None = None) -> CpuLimits:
    """This machine's limits for work on ``threads`` of torch's threads (default: as many as torch uses now)."""
    info = cpuinfo()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = min(usable, threads or torch.get_num_threads())
    bf16 = bf16_flops_per_cycle(info)
    # float32 products at bfloat16's rate where the process lets oneDNN run them so (a precision below "highest")
    fp32 = fp32_flops_per_cycle(info) if torch.get_float32_matmul_precision() == "highest" else bf16
    return CpuLimits(cores, clock_ceiling_hz(info), fp32, bf16)


def rate_violations(rates: dict[str, float]) -> list[str]:
    """What in ``rates`` (remat.target.timing.measure_cpu's figures) no measurement on this machine can read: a
    rate above the CPU's limits, a per-operator cost below :data:`MIN_DISPATCH_S`, a class efficiency outside
    (0, 1]. Empty when all of it can be."""
    limits = cpu_limits(int(rates.get("threads", 0)) or None)
    wrong = []

    def bounded(name: str, value: float, low: float, high: float) -> None:
        if not low < value <= high:
            wrong.append(f"{name} = {value:.4g}, outside ({low:.4g}, {high:.4g}] ({limits})")

    bounded("flops_per_s", rates["flops_per_s"], 0.0, limits.fp32_flops_per_s)
    bounded("bf16_flops_per_s", rates["bf16_flops_per_s"], 0.0, limits.bf16_flops_per_s)
    bounded("memory_bytes_per_s", rates["memory_bytes_per_s"], 0.0, limits.bytes_per_s)
    bounded("random_bytes_per_s", rates["random_bytes_per_s"], 0.0, limits.bytes_per_s)
    # (no upper bound on the dispatch: a busy machine makes every operator slower, and that is no hardware limit;
    # one reading here took 2.2 ms an operator while another process ran on both cores)
    bounded("dispatch_s", rates["dispatch_s"], MIN_DISPATCH_S, float("inf"))
    for key in sorted(k for k in rates if k.endswith("_efficiency")):
        bounded(key, rates[key], 0.0, 1.0)
    return wrong


def check_rates(rates: dict[str, float]) -> None:
    """Raises AssertionError naming every figure of ``rates`` that :func:`rate_violations` finds impossible here."""
    wrong = rate_violations(rates)
    if wrong:
        raise AssertionError("measured beyond this CPU's limits:\n  " + "\n  ".join(wrong))
