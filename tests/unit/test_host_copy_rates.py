"""The host-link copy rates measured on the H200 (2026-12-04; issue #56): read from torch.profiler's trace of one
titan4 step with one layer offloaded (``benchmarks/h200/data/titan4_off__0.trace.json.gz``, copied from
``shared/gpu/h200-2026-12-04``), each ``Memcpy`` event's bytes over its duration, against what the device table
says was measured. The plan was applied on the meta model, so the offload's own copies were pageable (the bug
fixed since: Note [Pinned at first run] in remat.rewrite.offload); the pinned ones are FSDP2's."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

import pytest

from remat.target.spec_file import device_spec

TRACE = Path(__file__).parents[2] / "benchmarks" / "h200" / "data" / "titan4_off__0.trace.json.gz"


def copies() -> dict[str, list[tuple[int, float]]]:
    """Per kind of copy ("DtoH (Device -> Pageable)", ...), each copy's ``(bytes, seconds)`` on the GPU."""
    events = json.loads(gzip.open(TRACE).read())["traceEvents"]
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "gpu_memcpy" and e.get("ph") == "X":
            out[e["name"].removeprefix("Memcpy ")].append((int(e["args"]["bytes"]), e["dur"] * 1e-6))
    return dict(out)


def rate(pairs: list[tuple[int, float]]) -> float:
    """Bytes over seconds, all copies together (bytes/s)."""
    return sum(b for b, _ in pairs) / sum(s for _, s in pairs)


def test_the_trace_gives_the_pageable_rates_the_docs_write():
    """The offloaded layer's 3.49 GB each way, copied from pageable memory: 14.0 GB/s out (249 ms), 6.95 GB/s back
    (503 ms); on the step's one stream, synchronous (docs/offload.md)."""
    c = copies()
    out, back = c["DtoH (Device -> Pageable)"], c["HtoD (Pageable -> Device)"]
    assert sum(b for b, _ in out) == sum(b for b, _ in back) == 3_491_889_152
    assert rate(out) == pytest.approx(14.04e9, rel=1e-3) and sum(s for _, s in out) == pytest.approx(0.2487, rel=1e-3)
    assert rate(back) == pytest.approx(6.947e9, rel=1e-3) and sum(s for _, s in back) == pytest.approx(0.5026, rel=1e-3)
    assert "DtoH (Device -> Pinned)" not in c  # pinned device-to-host: not measured by this trace


def test_the_h200s_measured_host_to_device_rate_is_the_traces_largest_pinned_copy():
    (largest,) = sorted(c for c in copies()["HtoD (Pinned -> Device)"])[-1:]
    assert largest[0] == 16_416_992
    spec = device_spec("h200")
    assert spec.host_to_device_bytes_per_s == pytest.approx(largest[0] / largest[1], rel=5e-3)
    assert spec.device_to_host_bytes_per_s is None  # not measured: no pinned device-to-host copy in the trace
    assert spec.host_to_device_bytes_per_s < spec.host_link_bytes_per_s  # below PCIe Gen5's nominal 63.0 GB/s
