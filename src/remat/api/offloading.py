"""Whether a plan may offload activations to host memory, and over what link (issue #50): ``offload=`` of
:func:`remat.optimize_checkpointing` resolved against where the step runs.

In: the user's ``offload`` (False, True or "auto"), the device or target, the loop. Out: the
:class:`~remat.costs.offload.HostLink` the planner offers offloading over (None: not offered), with a note.
"""

from __future__ import annotations

from typing import Any

import torch

from remat.costs.offload import HostLink, link_from_spec
from remat.errors import InvalidInputError, UnsupportedError

#: what ``offload=`` takes
OFFLOAD_CHOICES = (False, True, "auto")


def host_link(offload: Any, *, device: torch.device, target: Any = None, compiled: str = "",
              tensor_parallel: bool = False) -> tuple[HostLink | None, tuple[str, ...]]:
    """The link offloading runs over where the step runs, or None, with what the plan's notes say (Note [Offload
    in the memory model] in remat.costs.offload). ``offload=True`` where it cannot be planned raises, saying why;
    "auto" offers it where it can and says where not."""
    if offload not in OFFLOAD_CHOICES or (offload is not True and offload is not False and offload != "auto"):
        raise InvalidInputError(f"offload takes False (keep or recompute only), True (offload where it pays) or "
                                f"'auto' (offer offloading where there is a GPU's host link to plan for), got "
                                f"{offload!r}")
    if offload is False:
        return None, ()
    why = None
    if compiled:
        why = (f"the loop compiles the model ({compiled}), and no torch release remat was checked on (2.8, 2.13, "
               "2.15) offloads a compiled step's activations from a checkpoint policy: CheckpointPolicy."
               "MUST_CPU_OFFLOAD is declared, but AOTAutograd's partitioner does not read it, and torch's compiled "
               "offloading pass (torch._functorch._activation_offloading, from 2.13, behind "
               "torch._functorch.config.enable_activation_offloading) moves only graph nodes marked "
               "'should_offload', which nothing in torch marks. Plan the eager step, or offload=False")
    if why is None and (tensor_parallel or getattr(target, "tp", 1) > 1):
        why = ("the model is tensor parallel: its saved activations are DTensors, which the offloading hooks leave "
               "where they are (Note [Offloaded units] in remat.rewrite.offload); plan with offload=False")
    spec = getattr(target, "spec", None)
    if why is None and spec is None and device.type == "cuda":
        from remat.target.spec_file import device_spec

        try:
            spec = device_spec(torch.cuda.get_device_name(device))
        except InvalidInputError:
            why = (f"this GPU ({torch.cuda.get_device_name(device)}) is not in remat's device table, so its host "
                   "link is not known: plan with target=Target(device=DeviceSpec(..., host_link_bytes_per_s=...))")
    if why is None and (spec is None or spec.name == "cpu"):
        why = ("the step runs on a CPU, whose activations are in host memory already: offloading frees nothing "
               "there. Plan for a GPU target to plan offloading (target=Target(device=...) in Python, --device on the "
               "command line)")
    if why is None and not (spec.host_link_bytes_per_s or spec.device_to_host_bytes_per_s
                            or spec.host_to_device_bytes_per_s):
        why = (f"device {spec.name!r} does not give its host link: add host_link_bytes_per_s (bytes/s, one "
               "direction) to its spec, or the measured pinned copy rates device_to_host_bytes_per_s and "
               "host_to_device_bytes_per_s")
    if why is not None:
        if offload is True:
            raise UnsupportedError(f"cannot plan offloading: {why}")
        return None, (f"offloading not offered: {why}",)
    from remat.target.devices import KNOWN

    host = getattr(target, "host_memory_bytes", None)
    # each direction's measured pinned rate; where the device's were not measured, the H200's share of its nominal
    # rate carried (docs/offload.md: measured on the H200 2026-12-04)
    link = link_from_spec(spec, host_bytes=host, carried_from=KNOWN["h200"])
    return link, (f"offloading offered over {link.source} (predicted: copies out hidden behind the forward after "
                  "each unit's, a copy back behind the backward of the offloaded unit after it, else waited for: "
                  "Note [Exposed copies] in remat.costs.offload; host memory "
                  f"{'unlimited' if host is None else f'{host / 2**30:.1f} GiB'})",)
