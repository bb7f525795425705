"""The names of units and plan variables, made and parsed (no torch).

In: module names, segment and region bounds, selective options and nested choices. Out: the unit names
remat uses everywhere (``h.3``, ``blocks[0:4]``, ``up.2[conv1:conv2]``, ``h.3@ops2``), the plan variable
of a nested choice (``h.3/h.3.mlp``) and the parts of any such name back; re-exported by
``remat.costs.unit_costs``.
"""

from __future__ import annotations

import re


#: separates a module's name from a selective policy in a unit name (``h.3@ops2``; Note [Selective
#: checkpointing] in remat.rewrite)
SELECTIVE = "@ops"


def op_key(op: str, k: int) -> str:
    """The name of the ``k``-th call (from 0) of overload ``op`` within a unit's forward, as a selective
    policy names the operators it keeps: ``op_key("aten.addmm.default", 1) == "aten.addmm.default#1"``."""
    return f"{op}#{k}"


def nest_key(outer: str, inner: str) -> str:
    """The name of the choice "checkpoint ``inner`` inside checkpointed ``outer``" (Note [Nested
    checkpoints] in remat.costs.memory_rows): ``nest_key("h.3", "h.3.mlp") == "h.3/h.3.mlp"``."""
    return f"{outer}/{inner}"


def inner_unit(variable: str) -> str:
    """The unit a plan variable checkpoints: ``inner_unit("h.3/h.3.mlp") == "h.3.mlp"``, ``"h.3"`` for ``"h.3"``."""
    return variable.rpartition("/")[2]


_SEGMENT = re.compile(r"^(?P<container>.*)\[(?P<start>\d+):(?P<stop>\d+)\]$")
_REGION = re.compile(r"^(?P<module>.*)\[(?P<start>[^\[\]:]+):(?P<stop>[^\[\]:]*)\]$")


def segment_name(container: str, start: int, stop: int) -> str:
    """The unit name of children ``start:stop`` of the Sequential ``container`` (``blocks[0:4]``)."""
    return f"{container}[{start}:{stop}]"


def parse_segment(name: str) -> tuple[str, tuple[int, int]] | None:
    """``"blocks[0:2]"`` -> ``("blocks", (0, 2))``; None for any other name."""
    m = _SEGMENT.match(name)
    return None if m is None else (m["container"], (int(m["start"]), int(m["stop"])))


def region_name(module: str, start: str, stop: str | None) -> str:
    """The unit name of the region of ``module``'s forward from the call of its submodule ``start`` up to
    the call of ``stop`` (None: to the end); both relative to ``module`` (Note [Regions] in remat.capture):
    ``region_name("up.2", "conv2", None) == "up.2[conv2:]"``."""
    return f"{module}[{start}:{stop or ''}]"


def parse_region(name: str) -> tuple[str, str, str | None] | None:
    """``"up.2[conv1:conv2]"`` -> ``("up.2", "conv1", "conv2")``, ``"up.2[conv2:]"`` -> ``("up.2", "conv2",
    None)``; None for any other name (a segment's bounds are numbers)."""
    if parse_segment(name) is not None:
        return None
    m = _REGION.match(name)
    return None if m is None else (m["module"], m["start"], m["stop"] or None)


def is_selective(name: str) -> bool:
    """Whether unit ``name`` is a selective (op-level) unit, e.g. ``h.3@ops2``."""
    return SELECTIVE in name
