"""The H200 measurements of 2026-12-04 (``data/``: a copy of the project's shared ``../shared/gpu/h200-2026-12-04``,
less its suite log) for the benchmarks that predict them again here: the one loader of that data set. Where it is
(``GPU_DATA`` to read another copy), its rows, plans and traces, and each step it ran profiled for the H200 on this
CPU (the steps: ``gpu_models.py`` beside this file), as the shared oracle's ``gpu_oracle_predict.py`` profiled it."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.environ.get("GPU_DATA", os.path.join(HERE, "data"))


def shared_models() -> Any:
    """The ``gpu_models`` module beside this file (the steps measured on the H200)."""
    sys.path.insert(0, HERE)
    import gpu_models

    return gpu_models


def oracle_rows() -> list[dict]:
    """``oracle.json``: every row the H200 ran (peaks in bytes, step seconds, measured and as predicted then)."""
    import json

    with open(os.path.join(DATA, "oracle.json")) as f:
        return json.load(f)


def plan(name: str) -> Any:
    """The plan of ``plans/NAME`` (the plan the GPU ran), as remat loads it."""
    import remat

    return remat.Plan.load(os.path.join(DATA, "plans", name))


def trace(name: str) -> Any:
    """``NAME.trace.json.gz``, the Chrome trace of one profiled step, read by remat.target.host_trace."""
    from remat.target.host_trace import TraceEvents

    return TraceEvents.load(os.path.join(DATA, f"{name}.trace.json.gz"))


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
