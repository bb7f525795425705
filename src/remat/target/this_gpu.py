"""The GPU here as remat's device table knows it, for checking a prediction on it (:mod:`remat.sweeps.accuracy`):
its spec (torch's name of it matched against the table's names and aliases, else its compute capability; its
memory as torch reports it), a line naming it with torch, CUDA and the driver, and the error for a machine without
CUDA.

In: torch's view of the GPU (``torch.cuda.get_device_properties``) or a name, capability and memory given. Out: a
:class:`~remat.target.devices.DeviceSpec` and how it was found.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess

import torch

from remat.errors import InvalidInputError, UnsupportedError
from remat.target.devices import ALIASES, KNOWN, DeviceSpec
from remat.target.spec_file import device_spec

#: a table device whose rates stand for a GPU of this compute capability when its name is not in the table
BY_CAPABILITY = {(8, 0): "a100-80gb", (9, 0): "h100-80gb", (10, 0): "b200", (8, 9): "l4"}


def cuda_required(what: str = "remat accuracy", does: str = "runs the plans for real on") -> UnsupportedError:
    """The error for a command that needs the CUDA GPU here, on a machine without CUDA."""
    return UnsupportedError(
        f"{what} {does} a CUDA GPU, and torch here ({torch.__version__}) sees none "
        f"(torch.cuda.is_available() is False). On this machine, predict for a GPU that is not here instead: "
        f"remat tradeoff TARGET --device h100-80gb (or remat plan ... --device GPU, or --device FILE, a spec of your "
        f"own: docs/targets.md), and run {what} where the GPU is")


def named_in_table(gpu_name: str) -> tuple[DeviceSpec, str] | None:
    """The table's entry torch's name of a GPU is (a name or alias), else the one whose name or alias is the
    longest part of it ("NVIDIA H200 NVL" holds "h200"), and how it was found; None for neither (never by compute
    capability alone here: an RTX 4090 is no L4)."""
    try:
        spec = device_spec(gpu_name)
        return spec, f"torch's name {gpu_name!r} is the table's {spec.name}"
    except InvalidInputError:
        pass
    key = re.sub(r"[\s_]+", "-", gpu_name.strip().lower())
    inside = sorted((a for a in ALIASES if re.search(rf"(^|-){re.escape(a)}($|-)", key)), key=len, reverse=True)
    if not inside:
        return None
    spec = KNOWN[ALIASES[inside[0]]]
    return spec, f"torch's name {gpu_name!r} holds the table's {spec.name} ({inside[0]!r})"


def spec_here(device: torch.device | str | None = None) -> tuple[DeviceSpec, str]:
    """This GPU's spec and how it was found: the table's entry whose name or alias is torch's name of the GPU
    (``torch.cuda.get_device_name``), else whose key is part of it (e.g. "NVIDIA H200 NVL" -> h200), else the
    entry of the same compute capability (:data:`BY_CAPABILITY`); its memory replaced by what torch reports here
    (``total_memory``) where the two differ. Raises :class:`UnsupportedError` without CUDA and
    :class:`InvalidInputError` for a GPU nothing in the table stands for."""
    if not torch.cuda.is_available():
        raise cuda_required()
    device = torch.device(device or "cuda")
    props = torch.cuda.get_device_properties(device)
    return match_spec(props.name, (props.major, props.minor), props.total_memory)


def match_spec(gpu_name: str, capability: tuple[int, int], total_memory_bytes: int) -> tuple[DeviceSpec, str]:
    """:func:`spec_here` for a GPU described by torch's name, its compute capability and ``total_memory``."""
    spec, how = named_in_table(gpu_name) or (None, "")
    if spec is None and capability in BY_CAPABILITY:
        spec = KNOWN[BY_CAPABILITY[capability]]
        how = (f"{gpu_name!r} is not in the table; its compute capability {capability[0]}.{capability[1]} is the "
               f"table's {spec.name}'s, whose rates stand for it")
    if spec is None:
        raise InvalidInputError(
            f"the GPU here, {gpu_name!r} (compute capability {capability[0]}.{capability[1]}), is not in remat's "
            f"device table ({', '.join(KNOWN)}): give its spec with --device FILE (a JSON file with name, memory_bytes "
            f"{total_memory_bytes}, bf16_flops_per_s, hbm_bytes_per_s; docs/targets.md)")
    if spec.memory_bytes != total_memory_bytes:
        how += (f"; memory as torch reports it here, {total_memory_bytes:,} bytes (the table's "
                f"{spec.memory_bytes:,})")
        spec = dataclasses.replace(spec, memory_bytes=total_memory_bytes)
    return spec, how


def driver_version() -> str:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it, "" where it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def describe_device(device: torch.device) -> str:
    """E.g. "NVIDIA H200 (cuda:0), torch 2.11.0+cu130, CUDA 13.0, driver 580.159.04"; "cpu, torch ..." on a CPU."""
    if device.type != "cuda":
        return f"{device}, torch {torch.__version__}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (f"{torch.cuda.get_device_name(index)} (cuda:{index}), torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, driver {driver_version() or 'unknown'}")
