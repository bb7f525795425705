"""Capture: the model's graph and its candidate units.

Three paths, tried in order, and the one used is recorded (``ModelGraph.capture_path``):

1. ``fx``: ``torch.fx.symbolic_trace`` -- symbolic, cheap; fails on data-dependent control
   flow and on current Hugging Face models.
2. ``export``: non-strict ``torch.export.export`` -- runs the Python code on fake tensors, so
   it handles most Hugging Face models; fails on data-dependent control flow.
3. ``hooks``: no graph; the units and their order come from module hooks while profiling
   runs the model for real. Works for any eager model.

A *unit* is a submodule, by qualified name, that has children of its own (a block, an
attention or MLP layer): checkpointing a single Linear or activation saves nothing worth
the recompute. Units nest; their forward order is the order their first operator runs.
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat._compat import module_stack

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelGraph:
    """The captured structure of a model."""

    #: "fx", "export" or "hooks"
    capture_path: str
    #: candidate units in forward order (for "hooks": in registration order until profiling runs)
    units: tuple[str, ...]
    #: why the earlier capture paths failed (one line each)
    failures: tuple[str, ...] = ()


def unit_parent(unit: str, units: tuple[str, ...] | list[str]) -> str | None:
    best = None
    for u in units:
        if u != unit and unit.startswith(u + ".") and (best is None or len(u) > len(best)):
            best = u
    return best


def composite_modules(model: nn.Module) -> list[str]:
    """Qualified names of the submodules (not the root) that have children: the possible units."""
    return [name for name, m in model.named_modules() if name and any(True for _ in m.children())]


def _nodes(gm: torch.fx.GraphModule):
    """The nodes of ``gm``'s graph in order, with those of the subgraphs its higher-order operators call
    (an autocast region inside the forward, as accelerate's mixed precision wraps it, is one) where they run."""
    for node in gm.graph.nodes:
        for arg in node.args:
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and \
                    isinstance(sub := getattr(gm, str(arg.target), None), torch.fx.GraphModule):
                yield from _nodes(sub)
        yield node


def _units_from_graph(gm: torch.fx.GraphModule, possible: set[str]) -> list[str]:
    """The possible units a graph's nodes ran inside, in order of their first node."""
    return list(dict.fromkeys(n for node in _nodes(gm) for n in module_stack(node) if n in possible))


def capture(model: nn.Module, args: tuple, kwargs: dict[str, Any], *, untraceable: str | None = None) -> ModelGraph:
    """Capture ``model``'s graph on the example inputs. Does not mutate the model. ``untraceable``: why
    tracing must not be tried (a model wrapped by FSDP2 or DDP: tracing runs its hooks on fake tensors,
    which breaks their state); the module-hooks path is used."""
    possible = set(composite_modules(model))
    if untraceable is not None:
        return ModelGraph("hooks", tuple(sorted(possible, key=list(dict(model.named_modules())).index)),
                          (f"not traced: {untraceable}",))
    failures: list[str] = []
    try:
        gm = torch.fx.symbolic_trace(model)
        return ModelGraph("fx", tuple(_units_from_graph(gm, possible)))
    except Exception as e:  # noqa: BLE001 - any tracing failure sends us to the next path
        failures.append(f"fx.symbolic_trace: {type(e).__name__}: {_first_line(e)}")
        log.info("torch.fx.symbolic_trace failed (%s); trying torch.export (non-strict)", _first_line(e))
    try:
        # torch.export prints the partial graph of a failed export to stderr: keep it out of the user's log
        with quiet_loggers("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export"), \
                contextlib.redirect_stderr(io.StringIO()):
            ep = torch.export.export(model, args, kwargs, strict=False)
        return ModelGraph("export", tuple(_units_from_graph(ep.graph_module, possible)), tuple(failures))
    except Exception as e:  # noqa: BLE001
        failures.append(f"torch.export(strict=False): {type(e).__name__}: {_first_line(e)}")
        log.info("torch.export failed (%s); recording units with module hooks instead", _first_line(e))
    return ModelGraph("hooks", tuple(sorted(possible, key=list(dict(model.named_modules())).index)),
                      tuple(failures))


@contextlib.contextmanager
def quiet_loggers(*loggers: str):
    """Silence torch's own warnings (graph dumps) while a capture path is only being tried."""
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in loggers]
    for lg, _ in saved:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in saved:
            lg.setLevel(level)


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0][:200] if s else ""
