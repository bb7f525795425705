"""The checks of a device spec's fields, one per kind of field (part of :mod:`remat.target.devices`): numbers of bytes
and FLOP/s, seconds, efficiencies by operator class, the compute capability. Each returns the field's value as the
spec holds it or raises :class:`~remat.errors.InvalidInputError` naming the device, the field and what to give."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from remat.errors import InvalidInputError


def check_whole(name: str, field: str, value: Any) -> int | None:
    unit = "bytes" if field == "memory_bytes" else "FLOP/s" if "flops" in field else "bytes/s"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInputError(f"device {name!r}: {field} must be a number of {unit}, got {value!r}: give it "
                                f"as a number (e.g. 989.5e12)" + ("" if field == "memory_bytes" else
                                                                  ", or None where unknown"))
    if not math.isfinite(value) or value <= 0:
        raise InvalidInputError(f"device {name!r}: {field} must be positive, got {value!r}: give the device's "
                                f"{unit}" + (" (torch.cuda.get_device_properties(0).total_memory)"
                                             if field == "memory_bytes" else ", or None where unknown"))
    if field == "memory_bytes" and value != int(value):
        raise InvalidInputError(f"device {name!r}: memory_bytes must be a whole number of bytes, got {value!r}")
    return int(round(value))


#: the operator classes of the time model's efficiency table (remat.costs.device_time.op_class)
EFFICIENCY_CLASSES = ("matmul", "conv", "attention", "pointwise", "transcendental", "reduction", "foreach")
#: host seconds per operator (remat.costs.device_time.HostCosts)
HOST_SECONDS = ("host_forward_op_s", "host_backward_op_s")
#: every field in seconds
SECONDS = HOST_SECONDS + ("shortest_kernel_s",)


def check_efficiency(name: str, value: Any) -> tuple[tuple[str, float | None, float | None], ...]:
    """``value`` as ``(class, compute, memory)`` triples: given so, or as ``{class: {"compute": c, "memory": m}}``."""
    if isinstance(value, Mapping):
        rows = []
        for cls, fractions in value.items():
            if not isinstance(fractions, Mapping) or not fractions or set(fractions) - {"compute", "memory"}:
                raise InvalidInputError(f"device {name!r}: efficiency.{cls} must be an object of \"compute\" and/or "
                                        f"\"memory\" (fractions of the peak FLOP/s and bandwidth), got {fractions!r}")
            rows.append((cls, fractions.get("compute"), fractions.get("memory")))
        value = rows
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise InvalidInputError(f"device {name!r}: efficiency must map operator classes to fractions, e.g. "
                                f"{{\"matmul\": {{\"compute\": 0.8}}}}, got {value!r}")
    out = []
    for row in value:
        if not isinstance(row, (tuple, list)) or len(row) != 3:
            raise InvalidInputError(f"device {name!r}: an efficiency is (class, compute, memory), got {row!r}")
        cls, *fractions = row
        if cls not in EFFICIENCY_CLASSES:
            raise InvalidInputError(f"device {name!r}: efficiency of {cls!r}: not an operator class; the classes are "
                                    f"{', '.join(EFFICIENCY_CLASSES)}")
        for what, f in zip(("compute", "memory"), fractions):
            if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f)
                                  or f <= 0):
                raise InvalidInputError(f"device {name!r}: efficiency.{cls}.{what} must be a positive fraction of the "
                                        f"peak (e.g. 0.8), got {f!r}")
        out.append((cls, *(None if f is None else float(f) for f in fractions)))
    if len({r[0] for r in out}) != len(out):
        raise InvalidInputError(f"device {name!r}: efficiency names a class twice: {[r[0] for r in out]}")
    return tuple(out)


def check_seconds(name: str, field: str, value: Any) -> float | None:
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value <= 0):
        raise InvalidInputError(f"device {name!r}: {field} must be a positive "
                                f"number of seconds{' per operator' if 'op_s' in field else ''} (e.g. 2.47e-05), got "
                                f"{value!r}, or None for the time model's figure")
    return float(value)




def check_capability(name: str, value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise InvalidInputError(f"device {name!r}: compute_capability must be [major, minor] as torch reports it "
                                f"(torch.cuda.get_devicecheck_capability(), e.g. [8, 6]), got {value!r}")
    return value[0], value[1]
