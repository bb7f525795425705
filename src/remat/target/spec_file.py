"""The device a name means (:func:`device_spec`: a built-in name or alias, ``"cpu"``, a spec file, a mapping) and
device spec files: what ``Target(device="my-gpu.json")`` and every ``--device FILE`` read; and what the time model
reads of a spec (its efficiency table, its host's figures). Imports the built-in table (remat.target.devices) and
the time model's figures (remat.costs.device_time); no torch.

A spec file is one JSON object of :class:`~remat.target.devices.DeviceSpec`'s fields, as one entry of the built-in
table (``devices.json``) is, with each figure's sources ``[field, document, note]``. Beside the fields it may hold:

* ``"base"``: a built-in device (name or alias) it derives from: the file gives only what differs, every other
  field is the base's, and each carried figure's note says so ("carried from the base h200: ...");
* ``"documents"``: ``{key: text}`` that sources cite as ``"doc:KEY"`` (the built-in table's documents too);
* ``"aliases"``, ``"about"``: as in the table (a file's aliases name nothing: it is given by its path);
* ``"calibration"``: the raw measurements ``remat calibrate`` wrote it from, kept for the record (not read).

In a file derived from a base, a figure the file gives without a source gets one saying so ("given in this file
without a note"). Every mistake is an
:class:`~remat.errors.InvalidInputError` that names the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from remat.costs.device_time import EFFICIENCY, GPU_HOST, Efficiency, HostCosts
from remat.errors import InvalidInputError
from remat.target.devices import ALIASES, KNOWN, NUMBERS, SECONDS, DeviceSpec, builtin_documents, cpu_spec, \
    generation_of, how_to, spec_key

__all__ = ["device_spec", "load_spec_file", "read_spec_json", "spec_from_mapping", "EXTRA_KEYS"]

#: keys a spec file may hold beside the spec's fields
EXTRA_KEYS = ("base", "documents", "aliases", "about", "calibration")


def device_spec(name_or_spec: DeviceSpec | str | os.PathLike | Mapping[str, Any]) -> DeviceSpec:
    """The spec meant: a :class:`DeviceSpec` as it is; a built-in name or alias (any case; ``_`` or spaces for
    ``-``; torch's device names such as "NVIDIA H100 80GB HBM3" among the aliases); ``"cpu"``: this machine
    (:func:`cpu_spec`); a path to a JSON file of the fields; a mapping of the fields. An unknown name raises
    :class:`InvalidInputError` listing the known names and how to define a device."""
    if isinstance(name_or_spec, DeviceSpec):
        return name_or_spec
    if isinstance(name_or_spec, Mapping):
        return DeviceSpec.from_dict(name_or_spec)
    if isinstance(name_or_spec, os.PathLike):
        return load_spec_file(Path(name_or_spec))
    if not isinstance(name_or_spec, str):
        raise InvalidInputError(f"a device is a name (e.g. \"h100-80gb\"), a JSON file's path or a DeviceSpec, "
                                f"got {type(name_or_spec).__name__}: {name_or_spec!r}")
    key = spec_key(name_or_spec)
    if key == "cpu":
        return cpu_spec()
    if key in ALIASES:
        return KNOWN[ALIASES[key]]
    if name_or_spec.strip().lower().endswith(".json") or os.sep in name_or_spec or Path(name_or_spec).is_file():
        return load_spec_file(Path(name_or_spec))
    by_name: dict[str, list[str]] = {}
    for alias, name in ALIASES.items():
        if alias != name:
            by_name.setdefault(name, []).append(alias)
    listing = "\n".join(f"    {n:<10} {KNOWN[n].describe()}; also {', '.join(by_name.get(n, []))}" for n in KNOWN)
    raise InvalidInputError(f"unknown device {name_or_spec!r}. The known devices (names are case-insensitive):\n"
                            f"{listing}\n    cpu        this machine (cpu_spec)\n" + how_to())


def read_spec_json(path: Path) -> dict[str, Any]:
    """The JSON object in the spec file ``path``, or :class:`InvalidInputError` saying why not."""
    if not path.is_file():
        raise InvalidInputError(f"no device spec file at {path}: give a path to a JSON file of the spec's fields, "
                                f"or a built-in name ({', '.join(KNOWN)}).\n" + how_to())
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidInputError(f"cannot read the device spec {path}: {e}. It must be one JSON object of the "
                                f"spec's fields.\n" + how_to()) from e
    if not isinstance(data, dict):
        raise InvalidInputError(f"{path}: a device spec file holds one JSON object of the spec's fields, got "
                                f"{type(data).__name__}.\n" + how_to())
    return data


def load_spec_file(path: Path | str) -> Any:
    """The :class:`~remat.target.devices.DeviceSpec` in the JSON file ``path`` (module docstring)."""
    path = Path(path)
    data = read_spec_json(path)
    try:
        return spec_from_mapping(data, where=str(path), default_name=path.stem)
    except InvalidInputError as e:
        raise InvalidInputError(f"{path}: {e}") from e


def spec_from_mapping(data: dict[str, Any], *, where: str = "the spec", default_name: str | None = None) -> Any:
    """A spec from a spec file's object (module docstring): its base's fields where it gives none, sources of
    ``doc:KEY`` expanded, a note for every field given without one. ``where`` names the file in notes."""
    data = dict(data)
    extra = {k: data.pop(k) for k in EXTRA_KEYS if k in data}  # not DeviceSpec's fields
    base_name = extra.get("base")
    documents = extra.get("documents") or {}
    if not isinstance(documents, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in documents.items()):
        raise InvalidInputError(f"\"documents\" must be an object of text by key (sources cite them as "
                                f"\"doc:KEY\"), got {documents!r}")
    docs = {**builtin_documents(), **documents}
    sources = data.get("sources", [])
    if not isinstance(sources, list):
        raise InvalidInputError(f"\"sources\" must be a list of [field, document, note], got {sources!r}")

    def expand(text: Any) -> Any:
        return re.sub(r"doc:([A-Za-z0-9_.-]+)", lambda m: docs.get(m.group(1), m.group(0)), text) \
            if isinstance(text, str) else text

    sources = [[expand(x) for x in s] if isinstance(s, (list, tuple)) else s for s in sources]
    fields = {f.name for f in dataclasses.fields(DeviceSpec)}
    given = [k for k in data if k in fields and k not in ("name", "sources")]
    out: dict[str, Any] = {}
    if base_name is not None:
        if not isinstance(base_name, str) or spec_key(base_name) not in ALIASES:
            raise InvalidInputError(f"base {base_name!r} is not a built-in device; the built-in ones: "
                                    f"{', '.join(KNOWN)} (a spec file derives from one of them, or gives every "
                                    f"field itself)")
        base = KNOWN[ALIASES[spec_key(base_name)]]
        out = {k: v for k, v in base.to_dict().items() if k not in ("sources", "efficiency")}
        out["efficiency"] = base.efficiency
        out["generation"] = generation_of(base)  # a built-in's is read from its name, which a file's is not
        out["name"] = default_name or f"{base.name}-derived"
        overridden = set(given) | {s[0].split(".")[0] for s in sources if isinstance(s, (list, tuple)) and s}
        carried = [[f, doc, f"carried from the base {base.name}: {note}"] for f, doc, note in base.sources
                   if f.split(".")[0] not in overridden]
        sources = carried + sources
    elif default_name is not None:
        out["name"] = default_name
    out.update(data)
    # derived from a base: every figure says whether it is the base's or the file's
    noted = {s[0] for s in sources if isinstance(s, (list, tuple)) and s}
    for k in given if base_name is not None else ():
        if data[k] in (None, "", (), [], {}) or k not in NUMBERS + SECONDS + ("efficiency",):
            continue
        if k == "efficiency" and isinstance(data[k], dict):
            sources += [[f"efficiency.{c}", where, "given in this file without a note"] for c in data[k]
                        if f"efficiency.{c}" not in noted and "efficiency" not in noted]
        elif k not in noted:
            sources.append([k, where, "given in this file without a note"])
    out["sources"] = sources
    return DeviceSpec.from_dict(out)


def efficiency_table(spec: Any) -> Any:
    """The time model's efficiency table for ``spec``: each operator class the spec gives (``spec.efficiency``,
    measured by ``remat calibrate``) in place of the table's entries for that class (every generation's), a
    fraction it leaves None the table's; every other class the table's (remat.costs.device_time.EFFICIENCY).
    ``measured_on`` is the spec's name."""
    table = EFFICIENCY
    if not spec.efficiency:
        return table
    generation = generation_of(spec)
    measured = {}
    for cls, compute, memory in spec.efficiency:
        known = table.get(f"{cls}@{generation}") or table.get(cls) or Efficiency(1.0, 1.0, "no figure: peak")
        notes = spec.sources_of(f"efficiency.{cls}")
        measured[cls] = Efficiency(known.compute if compute is None else compute,
                                   known.memory if memory is None else memory,
                                   f"{notes[0][0]}: {notes[0][1]}" if notes else f"given in the spec {spec.name}",
                                   spec.name)
    return MappingProxyType({**{k: v for k, v in table.items() if k.split("@")[0] not in measured}, **measured})


def host_costs_of(spec: Any, default: Any = None) -> Any:
    """The device host's seconds per operator for ``spec``: its ``host_forward_op_s`` and ``host_backward_op_s``
    (measured by ``remat calibrate``) where given, ``default``'s (remat.costs.device_time.GPU_HOST, the H200's
    host) for one it leaves None."""
    default = GPU_HOST if default is None else default
    given = {f: getattr(spec, f"host_{f}") for f in ("forward_op_s", "backward_op_s")}
    if all(v is None for v in given.values()):
        return default
    notes = spec.sources_of("host_forward_op_s") or spec.sources_of("host_backward_op_s")
    return HostCosts(**{f: getattr(default, f) if v is None else v for f, v in given.items()},
                     selective_forward_op_s=default.selective_forward_op_s,
                     selective_recompute_op_s=default.selective_recompute_op_s,
                     source=(f"measured for {spec.name}: {notes[0][0]}" if notes else f"given in the spec {spec.name}")
                     + f"; the rest: {default.source}")
