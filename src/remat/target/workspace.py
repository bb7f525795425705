"""What the BLAS library holds in a target's caching allocator: the workspaces torch gives its cuBLAS (hipBLAS on
ROCm) handles. Stdlib only: the figures are torch's defaults, read from its source, not measured here.

Note [cuBLAS workspaces]
~~~~~~~~~~~~~~~~~~~~~~~~
torch keeps one workspace per cuBLAS handle and stream (``aten/src/ATen/cuda/CublasHandlePool.cpp``,
``cublas_handle_stream_to_workspace``), allocated through the caching allocator at the handle's first product on
that stream and never freed. Handles are per thread: a training step multiplies on two threads, the step's own
(forward, loss, the optimizer's step) and autograd's device thread (the backward), both on the default stream,
so it holds **two** workspaces. Their size is the default of ``CUBLAS_WORKSPACE_CONFIG`` unless the variable is
set (``:SIZE_KIB:COUNT`` pairs):

* NVIDIA, Hopper and Blackwell (compute capability 9.x and 10.x): ``:4096:8``, 32 MiB; earlier parts
  (Ampere, Ada): ``:4096:2:16:8``, 8 MiB + 128 KiB. (torch's source before Blackwell was added gave 32 MiB to
  compute capability 9.0 alone.)
* AMD, MI300 (gfx94x) and gfx95x: 128 MiB (32 MiB elsewhere); hipBLASLt keeps a workspace of its own per handle
  and stream, 76 MiB by default (``HIPBLASLT_WORKSPACE_SIZE``, KiB).
* cuBLASLt (the products torch sends to it, e.g. with a bias) shares the cuBLAS workspace on NVIDIA
  (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, the default of torch 2.13's open-source builds).

torch 2.15 changed the default on NVIDIA: the cached workspaces are off unless ``TORCH_CUBLAS_WORKSPACE_CACHE=1``
(its ``torch.backends.cuda.blas_workspace_size`` documents the variable; 2.13's does not), and cuBLAS then uses a
workspace of its own outside torch's allocator; cuBLASLt's (1 MiB, ``CUBLASLT_WORKSPACE_SIZE`` in KiB) stays in
it, per handle and stream. remat models the torch it runs with. Checked against the docstrings of torch 2.8,
2.13 and 2.15 and the C++ source stored for the newest; torch 2.14 was not checked (modelled as 2.13).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["blas_workspaces", "BLAS_THREADS"]

#: threads that run a step's matrix products, each with its own handle: the step's and autograd's device thread
BLAS_THREADS = 2

_MiB = 2**20
#: torch's default cuBLAS workspace by GPU generation (Note [cuBLAS workspaces])
_CUBLAS_DEFAULT = {"hopper": 32 * _MiB, "blackwell": 32 * _MiB}
_CUBLAS_OLDER = 4096 * 1024 * 2 + 16 * 1024 * 8
_ROCM_DEFAULT = {"cdna3": 128 * _MiB}
_ROCM_OLDER = 32 * _MiB
_HIPBLASLT_DEFAULT = 76 * _MiB
_CUBLASLT_DEFAULT = 1 * _MiB


def _config_bytes(value: str | None) -> int | None:
    """The bytes a ``CUBLAS_WORKSPACE_CONFIG`` value asks for (``:SIZE_KIB:COUNT`` pairs summed), None unset or
    unparsable (torch then takes its default)."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", value or "")
    return sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else None


def _kib(value: str | None, default: int) -> int:
    try:
        return int(value) * 1024 if value is not None else default
    except ValueError:
        return default


def blas_workspaces(vendor: str, generation: str, torch_version: tuple[int, int],
                    env: Mapping[str, str]) -> tuple[int, ...]:
    """The workspaces (bytes each) a training step's BLAS handles hold in the target's caching allocator
    (Note [cuBLAS workspaces]): per handle (:data:`BLAS_THREADS`), the cuBLAS (hipBLAS) workspace where torch
    caches it, and cuBLASLt's (hipBLASLt's) where it has its own. ``env``: the process's environment
    (``CUBLAS_WORKSPACE_CONFIG`` and the others named in the note)."""
    if vendor.upper() == "AMD":
        blas = _config_bytes(env.get("CUBLAS_WORKSPACE_CONFIG") or env.get("HIPBLAS_WORKSPACE_CONFIG")
                             or env.get("ROCBLAS_WORKSPACE_CONFIG"))
        blas = _ROCM_DEFAULT.get(generation, _ROCM_OLDER) if blas is None else blas
        lt = _kib(env.get("CUBLASLT_WORKSPACE_SIZE", env.get("HIPBLASLT_WORKSPACE_SIZE")), _HIPBLASLT_DEFAULT)
        per_handle = (blas, lt) if env.get("TORCH_CUBLAS_WORKSPACE_CACHE", "1") != "0" else (lt,)
    else:
        blas = _config_bytes(env.get("CUBLAS_WORKSPACE_CONFIG"))
        blas = _CUBLAS_DEFAULT.get(generation, _CUBLAS_OLDER) if blas is None else blas
        cached = torch_version < (2, 15) or env.get("TORCH_CUBLAS_WORKSPACE_CACHE") == "1"
        # cached: cuBLASLt shares the cuBLAS workspace; not: cuBLAS's own is outside the allocator, cuBLASLt's in it
        per_handle = (blas,) if cached else (_kib(env.get("CUBLASLT_WORKSPACE_SIZE"), _CUBLASLT_DEFAULT),)
    return tuple(b for b in per_handle if b > 0) * BLAS_THREADS
