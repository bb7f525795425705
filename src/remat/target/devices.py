"""Specifications of training accelerators, for planning a training step on a GPU that is not the one here.

A planner that predicts a step's memory (and later its time) on, say, eight H100s while it runs on a laptop
needs the target's numbers: how much memory the framework can use, how fast it computes in each dtype, how fast
it reads its own memory and talks to its neighbours. :class:`DeviceSpec` holds them, :data:`KNOWN` holds the
built-in ones (A100 40/80GB, H100 SXM 80GB, the 96GB HBM2e H100 of torchtitan's benchmarks, H100 PCIe, H200,
B200, L4, MI300X); :func:`remat.target.spec_file.device_spec` turns a name, an alias, a JSON file or a spec into
one. No torch: it imports the standard library, remat.errors and the field checks of remat.target.spec_fields, so
torch-free code can read it.

Where the figures come from. Each number carries its sources, ``(field, document, note)``: the vendor's
datasheet, confirmed against a stored copy of it or of a page quoting it where one was found, and a note that
says so where it was not. The table is ``devices.json`` beside this module.

The rules the figures follow:

* **Dense, not sparse.** NVIDIA's datasheets print tensor-core FLOP/s "with sparsity" (2:4 structured, marked
  ``*``): those are halved here. ``fp32_flops_per_s`` is the plain (non-tensor) FP32 rate; ``tf32``, ``bf16``,
  ``fp16`` and ``fp8`` are dense tensor-core (matrix-core) rates. ``None``: unknown or not supported (no FP8
  on an A100).
* **Memory is what torch reports.** ``memory_bytes`` is ``torch.cuda.get_device_properties(0).total_memory``
  on that device where a report of it was found (it moves by well under 1% with the driver: e.g. 79.2 GiB on
  an "80GB" H100, not 80e9 bytes). Where none was found it is the marketed figure, GB x 10^9, and the note
  says so: on the HBM parts checked that is below what torch reports (80e9 against 85.0e9 on the H100), but
  not always (24e9 against 23.6e9 on the L4's GDDR6).
* **Bandwidths in bytes per second.** ``hbm_bytes_per_s``: the device memory's peak (GDDR6 on the L4).
  ``link_bytes_per_s``: the intra-node link per GPU (NVLink, Infinity Fabric, PCIe where there is nothing
  else), **both directions together** as vendors quote it: one direction is half. ``link_kind`` says which
  link and anything a collective's time depends on (a direct mesh gives one peer a seventh of it).
  ``host_link_bytes_per_s``: the link to host memory (PCIe), **one direction**, where offloaded activations go
  (remat.costs.offload): the link's nominal rate. ``device_to_host_bytes_per_s`` and
  ``host_to_device_bytes_per_s``: what a copy between device memory and *pinned* host memory was measured to
  move on that device, each way; ``None`` where not measured (remat.costs.offload.link_from_spec says what is
  used then).

A device not in the table: give its spec, as ``DeviceSpec(name="my-gpu", memory_bytes=...)`` or a JSON file of
the same fields (only ``name`` and ``memory_bytes`` are required; a file may derive from a built-in device,
``"base": "h200"``, and give only what differs: remat.target.spec_file); ``device_spec("cpu")`` /
:func:`cpu_spec` name this machine. ``remat calibrate`` measures the GPU here into such a file: the per-class
``efficiency`` and ``host_forward_op_s``, ``host_backward_op_s``, which the built-in specs leave to the time
model's own figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Any

from remat.errors import InvalidInputError
from remat.target.spec_fields import (  # noqa: F401 (the constants are read from here too)
    EFFICIENCY_CLASSES, SECONDS, check_capability, check_efficiency, check_seconds, check_whole,
)

__all__ = ["DeviceSpec", "KNOWN", "ALIASES", "spec_key", "builtin_documents", "how_to", "cpu_spec", "generation_of"]

#: the rates, each ``None`` where unknown: FLOP/s per dtype (dense), then bytes/s
RATES = ("fp32_flops_per_s", "tf32_flops_per_s", "bf16_flops_per_s", "fp16_flops_per_s", "fp8_flops_per_s",
         "hbm_bytes_per_s", "link_bytes_per_s", "host_link_bytes_per_s", "device_to_host_bytes_per_s",
         "host_to_device_bytes_per_s")
NUMBERS = ("memory_bytes",) + RATES

_HOW_TO = """To plan for a device that is not built in, give its spec where the name goes: a JSON file (its path)

    {"name": "my-gpu", "memory_bytes": 85045477376, "bf16_flops_per_s": 989.5e12, "hbm_bytes_per_s": 3.35e12}

or, in Python,

    DeviceSpec(name="my-gpu", memory_bytes=85_045_477_376, bf16_flops_per_s=989.5e12, hbm_bytes_per_s=3.35e12)

or derived from a built-in device, giving only what differs: {"base": "h200", "name": "my-h200", "hbm_bytes_per_s": 4.0e12}
(remat calibrate writes such a file from measurements on the GPU here). Only name and memory_bytes are required: memory_bytes as torch.cuda.get_device_properties(0).total_memory reports
it on that device (or the marketed GB x 10^9 if you cannot run it there); FLOP/s are dense (half a datasheet's
"with sparsity" figure), bandwidths in bytes/s. Other fields: {fields}."""


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: its memory as the framework sees it, its dense FLOP/s per dtype, its memory and link
    bandwidths (both directions together), each number's ``sources`` as ``(field, document, note)``.

    Numbers are whole (a float such as ``989.5e12`` is rounded to one); every one but ``memory_bytes`` may be
    ``None`` where unknown. ``str(spec)`` reads e.g. "NVIDIA H100 SXM 80GB (79.2 GiB)"."""

    name: str
    memory_bytes: int
    title: str = ""
    vendor: str = ""
    fp32_flops_per_s: int | None = None
    tf32_flops_per_s: int | None = None
    bf16_flops_per_s: int | None = None
    fp16_flops_per_s: int | None = None
    fp8_flops_per_s: int | None = None
    hbm_bytes_per_s: int | None = None
    link_bytes_per_s: int | None = None
    link_kind: str = ""
    #: the link to the host's memory, **one direction** (what offloading copies over: PCIe's rate from its
    #: generation and lanes where nothing measured is published)
    host_link_bytes_per_s: int | None = None
    #: a copy from device memory to pinned host memory, as measured on this device (bytes/s; None: not measured)
    device_to_host_bytes_per_s: int | None = None
    #: a copy from pinned host memory to device memory, as measured on this device (bytes/s; None: not measured)
    host_to_device_bytes_per_s: int | None = None
    #: the GPU's architecture ("ampere", "ada", "hopper", "blackwell"): the time model's efficiencies, torch's
    #: kernel and workspace choices per generation; "": read from the name (:data:`GENERATION`)
    generation: str = ""
    #: the GPU's compute capability ``(major, minor)`` where known (``remat calibrate`` writes it; JSON ``[8, 6]``):
    #: torch's attention kernel rules read it (an sm 8.6 GPU is "ampere" but not an A100); None: the generation's
    compute_capability: tuple[int, int] | None = None
    #: per operator class, the fractions of this spec's peaks (FLOP/s, memory bandwidth) its kernels were measured
    #: to reach here, ``(class, compute, memory)``, None for the time model's own figure (``remat calibrate``;
    #: JSON: ``{"matmul": {"compute": 0.8}}``); empty: the time model's table (remat.costs.device_time)
    efficiency: tuple[tuple[str, float | None, float | None], ...] = ()
    #: host seconds per forward and per backward operator below the model's own work, measured on this device's
    #: host (``remat calibrate``; remat.costs.device_time.HostCosts, Note [Host time decomposed] in
    #: remat.costs.host_time); None: the time model's (the H200's host)
    host_forward_op_s: float | None = None
    host_backward_op_s: float | None = None
    #: seconds of the shortest kernel, the time model's floor for any operator (``remat calibrate``: one-element
    #: kernels replayed from a CUDA graph); None: the time model's (torchao's 2 us on an H100)
    shortest_kernel_s: float | None = None
    sources: tuple[tuple[str, str, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise InvalidInputError(f"DeviceSpec.name must be a non-empty string naming the device (e.g. "
                                    f"\"my-gpu\"), got {self.name!r}")
        for field in ("title", "vendor", "link_kind"):
            if not isinstance(getattr(self, field), str):
                raise InvalidInputError(f"device {self.name!r}: {field} must be a string, got "
                                        f"{getattr(self, field)!r}")
        if self.memory_bytes is None:
            raise InvalidInputError(
                f"device {self.name!r}: memory_bytes is required: the device's memory in bytes, as "
                f"torch.cuda.get_device_properties(0).total_memory reports it there (or GB x 10^9)")
        for field in NUMBERS:
            object.__setattr__(self, field, check_whole(self.name, field, getattr(self, field)))
        if not isinstance(self.generation, str):
            raise InvalidInputError(f"device {self.name!r}: generation must be a string such as \"hopper\", got "
                                    f"{self.generation!r}")
        object.__setattr__(self, "compute_capability", check_capability(self.name, self.compute_capability))
        object.__setattr__(self, "efficiency", check_efficiency(self.name, self.efficiency))
        for field in SECONDS:
            object.__setattr__(self, field, check_seconds(self.name, field, getattr(self, field)))
        object.__setattr__(self, "sources", _sources(self.name, self.sources))

    def describe(self) -> str:
        """E.g. "NVIDIA H100 SXM 80GB (79.2 GiB)": the title (or name) and the memory torch sees, in GiB."""
        return f"{self.title or self.name} ({self.memory_bytes / 2**30:.1f} GiB)"

    __str__ = describe

    def sources_of(self, field: str) -> tuple[tuple[str, str], ...]:
        """The ``(document, note)`` pairs given for ``field``."""
        return tuple((doc, note) for f, doc, note in self.sources if f == field)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values (``sources`` as lists); :meth:`from_dict` reads it back."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["efficiency"] = {cls: {k: v for k, v in (("compute", c), ("memory", m)) if v is not None}
                             for cls, c, m in self.efficiency}
        out["sources"] = [list(s) for s in self.sources]
        if self.compute_capability is not None:
            out["compute_capability"] = list(self.compute_capability)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceSpec:
        """A spec from a mapping of its fields (as :meth:`to_dict` gives, or a JSON object): ``name`` and
        ``memory_bytes`` required, the rest optional; ``sources`` as ``[field, document, note]`` lists or
        ``{"field", "source", "note"}`` objects."""
        if not isinstance(d, Mapping):
            raise InvalidInputError(f"a device spec must be a mapping of its fields, got {type(d).__name__}.\n"
                                    + how_to())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise InvalidInputError(f"device spec {d.get('name', '?')!r}: unknown field(s) {unknown}; the fields "
                                    f"are {', '.join(f.name for f in dataclasses.fields(cls))}")
        missing = [k for k in ("name", "memory_bytes") if d.get(k) is None]
        if missing:
            raise InvalidInputError(f"device spec {d.get('name', '?')!r} lacks {' and '.join(missing)}.\n"
                                    + how_to())
        return cls(**dict(d))


def _sources(name: str, sources: Any) -> tuple[tuple[str, str, str], ...]:
    known = {f.name for f in dataclasses.fields(DeviceSpec)} | {f"efficiency.{c}" for c in EFFICIENCY_CLASSES}
    if isinstance(sources, (str, Mapping)) or not hasattr(sources, "__iter__"):
        raise InvalidInputError(f"device {name!r}: sources must be a list of (field, document, note), got "
                                f"{sources!r}")
    out = []
    for s in sources:
        entry = (s.get("field"), s.get("source"), s.get("note", "")) if isinstance(s, Mapping) else tuple(s)
        if len(entry) != 3 or not all(isinstance(x, str) for x in entry) or entry[0] not in known:
            raise InvalidInputError(f"device {name!r}: each source must be (field, document, note), three "
                                    f"strings with field one of the spec's fields; got {s!r}")
        out.append(entry)
    return tuple(out)


def how_to() -> str:
    """How to describe a device that is not built in (for error messages)."""
    fields = [f.name for f in dataclasses.fields(DeviceSpec) if f.name not in ("name", "memory_bytes")]
    return _HOW_TO.replace("{fields}", ", ".join(fields))


def spec_key(name: str) -> str:
    """A device name as the table's aliases are keyed: lower case, ``_`` and spaces as ``-``."""
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def _load_builtin() -> tuple[dict[str, DeviceSpec], dict[str, str]]:
    """The table in devices.json: specs by name, and every alias (the names included) to its name."""
    data = json.loads(resources.files(__package__).joinpath("devices.json").read_text(encoding="utf-8"))
    docs = data["documents"]

    def expand(text: str) -> str:
        return re.sub(r"doc:([a-z0-9-]+)", lambda m: docs.get(m.group(1), m.group(0)), text)

    table: dict[str, DeviceSpec] = {}
    aliases: dict[str, str] = {}
    for entry in data["devices"]:
        entry = dict(entry)
        for alias in [entry["name"], *entry.pop("aliases", ())]:
            aliases[spec_key(alias)] = entry["name"]
        entry["sources"] = [[f, expand(doc), expand(note)] for f, doc, note in entry["sources"]]
        table[entry["name"]] = DeviceSpec.from_dict(entry)
    return table, aliases


_TABLE, _ALIASES = _load_builtin()
#: every built-in name and alias (keyed by :func:`spec_key`) to its name in the table
ALIASES: Mapping[str, str] = MappingProxyType(_ALIASES)


def builtin_documents() -> dict[str, str]:
    """The built-in table's documents by key (what its sources' ``doc:KEY`` name)."""
    return dict(json.loads(resources.files(__package__).joinpath("devices.json").read_text(encoding="utf-8"))
                ["documents"])

#: the built-in specs by name, in the table's order
KNOWN: Mapping[str, DeviceSpec] = MappingProxyType(_TABLE)


#: the architecture of the built-in devices by name prefix: it selects "attention@<generation>" in the time
#: model's efficiency table and torch's BLAS workspace size (remat.target.workspace)
GENERATION = {"a100": "ampere", "h100": "hopper", "h200": "hopper", "b200": "blackwell", "l4": "ada",
              "mi300x": "cdna3"}


def generation_of(spec: DeviceSpec) -> str:
    """The GPU generation of a device: its spec's ``generation``, else a built-in's by name ("hopper", ...), else
    ""."""
    if spec.generation:
        return spec.generation
    return next((g for prefix, g in GENERATION.items() if spec.name.startswith(prefix)), "")


def _physical_memory() -> int | None:
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def cpu_spec(memory_bytes: int | None = None) -> DeviceSpec:
    """This machine, named ``"cpu"``: ``memory_bytes`` as the caller gives it (default: the machine's physical
    memory, from ``os.sysconf``); FLOP/s and bandwidths unknown (``None``)."""
    source = "given by the caller"
    if memory_bytes is None:
        memory_bytes, source = _physical_memory(), "os.sysconf: SC_PHYS_PAGES x SC_PAGE_SIZE"
        if memory_bytes is None:
            raise InvalidInputError("cpu_spec: this machine's memory could not be read (os.sysconf); give it: "
                                    "cpu_spec(memory_bytes=...)")
    return DeviceSpec(name="cpu", memory_bytes=memory_bytes, title=f"CPU ({platform.machine() or 'this machine'})",
                      sources=(("memory_bytes", source, "this machine's memory; its FLOP/s are not known here"),))
