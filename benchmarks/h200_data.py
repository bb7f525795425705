"""The H200 measurements of 2026-12-04 (``../shared/gpu/``, the project's shared data) for the benchmarks that
predict them again here: where they are (``GPU_DATA`` to move them) and each shared step profiled for the H200 on
this CPU, as ``../shared/gpu/oracle/gpu_oracle_predict.py`` profiled it."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.environ.get("GPU_DATA", os.path.join(HERE, "..", "..", "shared", "gpu", "h200-2026-12-04"))


def shared_models() -> Any:
    """The shared oracle's ``gpu_models`` module (the steps measured on the H200)."""
    sys.path.insert(0, os.path.join(DATA, "..", "oracle"))
    os.environ.setdefault("REMAT_PROJECT", os.path.join(HERE, ".."))
    import gpu_models

    return gpu_models


def profiled_for_h200(name: str) -> tuple[dict, Any, Any, float]:
    """The shared step ``name`` built on meta and profiled for ``Target(device="h200")``: (its config, the target,
    the profile, seconds the profile took)."""
    import remat
    from remat.api.profiling import make_profile

    c = shared_models().build(name, "meta")
    model = c["model"]
    opt = c["opt"](model.parameters())
    target = remat.Target(device="h200", parallelize=c["parallelize"], clip_grad_norm=c["clip"], **c["target"])
    t0 = time.perf_counter()
    profile = make_profile(model, c["inputs"], target=target, loss_fn=c["loss_fn"], optimizer=opt,
                           output_alive=c["output_alive"])
    return c, target, profile, time.perf_counter() - t0
