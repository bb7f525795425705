"""The CUDA caching allocator's private corners: the BLAS workspaces torch keeps in it.

``torch._C._cuda_clearCublasWorkspaces`` frees the workspaces torch caches per cuBLAS (and cuBLASLt) handle and
stream (``aten/src/ATen/cuda/CublasHandlePool.cpp``, Note [cuBLAS workspaces] in remat.target.workspace); the next
product on that thread allocates its workspace again. It is in torch's CUDA builds since 2.0 (used by
``torch.cuda.graphs`` users and torch's own tests) and was named in the 2.11 build on the lent H200; a CPU build
(2.8, 2.13 and 2.15 in CI) has no such binding, and :func:`clear_blas_workspaces` then says so (False).
"""

from __future__ import annotations

import torch


def clear_blas_workspaces() -> bool:
    """Free the BLAS workspaces torch caches in the CUDA caching allocator (every thread's); False where this torch
    cannot (no such binding: a CPU build, or a release that dropped it)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True
