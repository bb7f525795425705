"""A profiled step's host side, read from the Chrome trace ``torch.profiler`` exports (``export_chrome_trace``;
gzip or plain JSON): per phase its host wall time and the profiler events recorded in it, what the built-in
device figures are derived from (Note [Host time decomposed] in remat.costs.host_time). Torch-free.

Phases: the forward is the main thread up to the first event of autograd's thread, the backward autograd's thread
from its first event to its last (CUDA runs the backward on a thread of its own), the optimizer the
``Optimizer.step`` annotation to the end.
"""

from __future__ import annotations

import gzip
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from remat.costs.device_time import HostCosts
from remat.costs.host_time import op_s_from_phase
from remat.errors import InvalidInputError

__all__ = ["HOST_CATEGORIES", "PhaseHost", "TraceEvents", "host_phases", "host_costs_from_traces"]

#: the categories of events the profiler records on the host
HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class PhaseHost:
    """One phase of a profiled step on the host."""

    #: host wall time from its first event's start to its last event's end, seconds
    wall_s: float
    #: profiler events recorded on the host in it (operators nested in operators included, runtime calls)
    events: int
    #: of ``wall_s``, seconds the host waited in ``cuda*Synchronize`` (not host work)
    synchronize_s: float


@dataclass(frozen=True)
class TraceEvents:
    """The complete ("X") events of one trace and the thread that ran the forward."""

    name: str
    events: tuple[dict, ...]
    main_tid: int

    @classmethod
    def load(cls, path: str) -> "TraceEvents":
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            data = json.load(f)
        events = tuple(e for e in data["traceEvents"] if e.get("ph") == "X")
        host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
        if not host:
            raise InvalidInputError(f"{path}: no host events ({', '.join(HOST_CATEGORIES)}): not a torch.profiler "
                                    "trace recorded with CPU activity (record one with ProfilerActivity.CPU)")
        return cls(os.path.basename(path).split(".")[0], events, min(host, key=lambda e: e["ts"])["tid"])

    def of(self, *categories: str) -> list[dict]:
        return [e for e in self.events if e.get("cat") in categories]

    def phases(self) -> dict[str, tuple[float, float]]:
        """(start, end) in µs of each phase on the host (the module's docstring)."""
        host = self.of(*HOST_CATEGORIES)
        main = [e for e in host if e["tid"] == self.main_tid]
        other = [e for e in host if e["tid"] != self.main_tid]
        start, end = min(e["ts"] for e in main), max(e["ts"] + e["dur"] for e in host)
        opt = [e for e in self.of("user_annotation") if e["name"].startswith("Optimizer.step")]
        out = {}
        if not other:  # no autograd thread of its own: the forward is all before the optimizer
            out["forward"] = (start, opt[0]["ts"] if opt else end)
        else:
            out["forward"] = (start, min(e["ts"] for e in other))
            out["backward"] = (min(e["ts"] for e in other), max(e["ts"] + e["dur"] for e in other))
        if opt:
            out["optimizer"] = (opt[0]["ts"], end)
        return out

    def phase_of(self, ts: float, tid: int, phases: dict[str, tuple[float, float]]) -> str:
        if "optimizer" in phases and ts >= phases["optimizer"][0] and tid == self.main_tid:
            return "optimizer"
        if tid != self.main_tid:
            return "backward"
        return "forward" if ts < phases.get("backward", phases["forward"])[0] else \
            "optimizer" if "optimizer" in phases else "backward"


def host_phases(trace: TraceEvents) -> dict[str, PhaseHost]:
    """Each phase's host wall time, profiler events and synchronization (:class:`PhaseHost`)."""
    ph = trace.phases()
    events: dict[str, int] = defaultdict(int)
    sync: dict[str, float] = defaultdict(float)
    for e in trace.of(*HOST_CATEGORIES):
        p = trace.phase_of(e["ts"], e["tid"], ph)
        if ph[p][0] <= e["ts"] < ph[p][1]:
            events[p] += 1
            if "Synchronize" in e["name"]:
                sync[p] += e["dur"] * 1e-6
    return {p: PhaseHost((b - a) * 1e-6, events[p], sync[p]) for p, (a, b) in ph.items()}


def host_costs_from_traces(phases: dict[str, dict[str, PhaseHost]], inputs: dict[str, Any]) -> HostCosts:
    """A GPU host's figures (remat.costs.device_time.GPU_HOST for the H200) from the profiled steps of one model:
    ``phases["llama1b__1"]`` every block checkpointed, ``phases["llama1b__4"]`` one selective unit per block, and
    ``inputs`` measured on the planning machine for the same model (benchmarks/h200/data/host_inputs.json:
    benchmarks/h200/gpu_traces.py --host writes it). Each figure through op_s_from_phase (what ``remat calibrate``
    uses): a phase's host wall less what is known of it (the model's own work, checkpointing's bookkeeping, the
    profiler's events, operators at a figure already derived), over the operators the figure is for: the device's
    cost per operator from the first forward (no phase runs a backward without recomputing: the backward takes the
    forward's figure), what a selective unit's dispatch mode adds per operator from the second's forward and
    backward."""
    p = inputs["profiler_event_s"]
    f1, f4, b4 = phases["llama1b__1"]["forward"], phases["llama1b__4"]["forward"], phases["llama1b__4"]["backward"]
    op_s = op_s_from_phase(f1.wall_s, inputs["forward_python_s"], inputs["forward_ops"],
                           bookkeeping_s=inputs["bookkeeping_s"], profiler_events=f1.events, profiler_event_s=p)
    forward = inputs["forward_python_s"] + inputs["forward_ops"] * op_s
    selective_forward_op_s = op_s_from_phase(f4.wall_s, forward, inputs["selective_ops"],
                                             bookkeeping_s=inputs["selective_bookkeeping_s"],
                                             profiler_events=f4.events, profiler_event_s=p)
    recomputed = inputs["selective_recomputed_ops"]
    backward = inputs["backward_python_s"] + inputs["backward_ops"] * op_s \
        + recomputed * (inputs["forward_python_s"] / inputs["forward_ops"] + op_s)
    selective_recompute_op_s = op_s_from_phase(b4.wall_s, backward, recomputed, profiler_events=b4.events,
                                               profiler_event_s=p)
    return HostCosts(forward_op_s=op_s, backward_op_s=op_s, selective_forward_op_s=selective_forward_op_s,
                     selective_recompute_op_s=selective_recompute_op_s,
                     source=f"derived from {', '.join(inputs.get('traces', ()))} (host_costs_from_traces)")
