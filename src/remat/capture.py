"""Capture: the model's graph and its candidate units.

Three paths, tried in order, and the one used is recorded (``ModelGraph.capture_path``):

1. ``fx``: ``torch.fx.symbolic_trace`` -- symbolic, cheap; fails on data-dependent control
   flow and on current Hugging Face models.
2. ``export``: non-strict ``torch.export.export`` -- runs the Python code on fake tensors, so
   it handles most Hugging Face models; fails on data-dependent control flow.
3. ``hooks``: no graph; the units and their order come from module hooks while profiling
   runs the model for real. Works for any eager model.

With a graph (fx or export), each module's own forward is also traced to find where it can be cut
into regions (Note [Regions]); ``RegionProgram`` runs such a traced forward with regions handed to
the rewrite.

A *unit* is a submodule, by qualified name, that has children of its own (a block, an
attention or MLP layer): checkpointing a single Linear or activation saves nothing worth
the recompute. Units nest; their forward order is the order their first operator runs.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.fx.node import map_arg

from remat._compat import module_stack
from remat.errors import PlanMismatchError

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
    #: per module whose forward can be cut into regions (Note [Regions]), the submodule calls (qualified
    #: names) its forward can be cut before, in order
    cuts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: per module in ``cuts``, every submodule call of its forward (qualified names), in order
    region_calls: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


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


def capture(model: nn.Module, args: tuple, kwargs: dict[str, Any], *, untraceable: str | None = None,
            no_export: str | None = None) -> ModelGraph:
    """Capture ``model``'s graph on the example inputs. Does not mutate the model. ``untraceable``: why
    tracing must not be tried (a model wrapped by DDP, whose forward keeps its own state); the module-hooks
    path is used. ``no_export``: why torch.export must not be tried (a model sharded by FSDP2 or tensor
    parallelism, whose hooks export would run on fake tensors): torch.fx traces it without its module hooks
    (Note [Tracing without module hooks] in remat.api), and the module-hooks path is used if that fails."""
    possible = set(composite_modules(model))

    def hooks(failures: tuple[str, ...]) -> ModelGraph:
        return ModelGraph("hooks", tuple(sorted(possible, key=list(dict(model.named_modules())).index)), failures)

    if untraceable is not None:
        return hooks((f"not traced: {untraceable}",))
    failures: list[str] = []
    try:
        if no_export is None:
            gm = torch.fx.symbolic_trace(model)
        else:
            gm = torch.fx.GraphModule(model, _WithoutModuleHooks().trace(model))
        units = tuple(_units_from_graph(gm, possible))
        return ModelGraph("fx", units, **all_cuts(model, units))
    except Exception as e:  # noqa: BLE001 - any tracing failure sends us to the next path
        failures.append(f"fx.symbolic_trace: {type(e).__name__}: {_first_line(e)}")
        if no_export is not None:
            log.info("torch.fx failed (%s); recording units with module hooks (torch.export not tried: %s)",
                     _first_line(e), no_export)
            return hooks((*failures, f"torch.export not tried: {no_export}"))
        log.info("torch.fx.symbolic_trace failed (%s); trying torch.export (non-strict)", _first_line(e))
    try:
        # torch.export prints the partial graph of a failed export to stderr: keep it out of the user's log
        with quiet_loggers("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export"), \
                contextlib.redirect_stderr(io.StringIO()):
            ep = torch.export.export(model, args, kwargs, strict=False)
        units = tuple(_units_from_graph(ep.graph_module, possible))
        return ModelGraph("export", units, tuple(failures), **all_cuts(model, units))
    except Exception as e:  # noqa: BLE001
        failures.append(f"torch.export(strict=False): {type(e).__name__}: {_first_line(e)}")
        log.info("torch.export failed (%s); recording units with module hooks instead", _first_line(e))
    return hooks(tuple(failures))


class _WithoutModuleHooks(torch.fx.Tracer):
    """Traces each module's own forward, not its hooks (FSDP2's parameter gathers, a tensor-parallel plan's
    redistributions: Note [Tracing without module hooks] in remat.api)."""

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        return super().call_module(m, m.forward, args, kwargs)


# -- regions -----------------------------------------------------------------------------------

class _CallsAsLeaves(torch.fx.Tracer):
    """Traces one module's own forward: every submodule it calls stays a single ``call_module`` node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def trace_forward(module: nn.Module) -> torch.fx.Graph | None:
    """``module``'s own forward as an fx graph whose submodule calls are leaves (Note [Regions]), or None
    when it cannot be traced. Traced in the module's current training mode (the graph fixes it)."""
    try:
        with quiet_loggers("torch.fx"):
            return _CallsAsLeaves().trace(module)
    except Exception as e:  # noqa: BLE001 - any tracing failure: the module offers no regions
        log.debug("no regions for %s: %s: %s", type(module).__name__, type(e).__name__, _first_line(e))
        return None


def graph_cuts(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Note [Regions]
    ~~~~~~~~~~~~~~~~~
    A *region* of a module is a stretch of its own forward between two submodule calls
    (``up.2[conv1:conv2]``: from the call of ``conv1`` up to the call of ``conv2``; ``up.2[conv2:]``: from
    ``conv2`` to the end), checkpointed as one piece: units smaller than a module, for blocks whose
    forward is not an ``nn.Sequential`` (a conv block's halves, with the functional ReLUs between its
    layers). A forward can be cut before a submodule call when exactly one
    value computed so far is used from there on and that call takes it: the region's only input. remat
    offers regions for a module that takes one argument, runs each submodule at most once, and traces with
    ``torch.fx`` (its submodule calls as leaves). A pre-norm transformer block cuts before each layer norm,
    where the residual stream is the one value alive: ``h.2[ln_1:ln_2]`` is the layer norm, the attention
    and the residual add, checkpointed as one (its attention, a unit of its own, can nest inside it). Those
    regions were measured up to 0.6% above their prediction until a recomputation's growth stopped counting
    a free the plain forward makes as the region starts (Note [Growth of a recomputation] in remat.costs.effects).
    Blocks that take more than one argument (Hugging Face's, with masks and caches) offer none. Regions
    are not offered inside another unit (a block's MLP): plans
    nest two levels deep, and on the 24-block GPT the MLPs' regions added 288 variables and took op-level
    solves from 0.71-1.53 s to 1.61-2.53 s without lowering any peak (``benchmarks/scale/solve_scaling.py
    --gpt 24``). The rewrite (``remat.rewrite.RegionForward``) runs the traced graph, each chosen region
    under checkpoint. The graph fixes what tracing evaluated in
    Python (the training flag passed to a functional dropout, a branch on an attribute), so the rewrite
    traces again whenever the module's training mode differs from the trace's, and runs the module's own
    forward when it is called with other arguments than one.

    The cut points of ``graph``, in order: each call node a region can start or end before, with the one
    value that flows across it."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op == "call_module"]
    if len(placeholders) != 1 or len({n.target for n in calls}) != len(calls):
        return []
    position = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((position[u] for u in n.users), default=-1) for n in nodes}
    cuts = []
    for c in calls:
        k = position[c]
        live = [n for n in nodes[:k] if n.op not in ("get_attr", "output") and last_use[n] >= k]
        if len(live) == 1 and live[0] in c.all_input_nodes:
            cuts.append((c, live[0]))
    return cuts


def all_cuts(model: nn.Module, units: tuple[str, ...] | list[str]) -> dict[str, dict[str, tuple[str, ...]]]:
    """``ModelGraph.cuts`` and ``.region_calls``: per unit among ``units`` inside no other (not the root, not an
    ``nn.Sequential``, whose runs of children are segments) that has at least two
    cut points, the qualified names of the submodules called at them, and of all the submodules it calls."""
    out, calls = {}, {}
    for name, m in model.named_modules():
        if name not in units or unit_parent(name, units) is not None or \
                isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) or \
                "forward" in m.__dict__:  # tracing sees the class's forward, not one set on the instance
            continue
        graph = trace_forward(m)
        if graph is None:
            continue  # not traceable: no regions
        cuts = graph_cuts(graph)
        if len(cuts) >= 2 and not all(str(c.target).isdigit() for c, _ in cuts):
            out[name] = tuple(f"{name}.{c.target}" for c, _ in cuts)
            calls[name] = tuple(f"{name}.{n.target}" for n in graph.nodes if n.op == "call_module")
    return {"cuts": out, "region_calls": calls}


class RegionProgram:
    """A module's traced forward (Note [Regions]), run node by node as the forward runs (each value dropped
    after its last use, as ``torch.fx.Interpreter`` does), with each of ``regions`` handed to a caller's
    function (``remat.rewrite.RegionForward``: under checkpoint). Traced in the module's current training
    mode. Raises PlanMismatchError for a region the forward cannot be cut into."""

    def __init__(self, module: nn.Module, regions: tuple[tuple[str, str | None], ...]) -> None:
        self.module = module
        graph = trace_forward(module)
        cuts = {} if graph is None else {str(c.target): (c, live) for c, live in graph_cuts(graph)}
        nodes = [] if graph is None else list(graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        starts = {}
        for a, b in regions:
            if a not in cuts or (b is not None and b not in cuts):
                raise PlanMismatchError(f"{type(module).__name__} cannot be cut into region [{a}:{b or ''}] (its "
                                        "forward did not trace, or does not pass a single value there): make the "
                                        "plan on this model")
            stop = index[cuts[b][0]] if b is not None else len(nodes) - 1  # the output node
            out = cuts[b][1] if b is not None else nodes[-1].args[0]
            starts[index[cuts[a][0]]] = ((a, b), stop, cuts[a][1], out)
        last_uses: dict = defaultdict(list)
        seen: set = set()
        for n in reversed(nodes):  # as torch.fx.Interpreter(garbage_collect_values=True) frees them
            for v in n.all_input_nodes:
                if v not in seen:
                    seen.add(v)
                    last_uses[n].append(v)
        self.nodes = nodes
        #: node index where a region starts -> (region, index where it stops, its input node, its output)
        self.starts = starts
        #: node -> the values whose last use it is
        self.last_uses = dict(last_uses)

    def _step(self, n, env: dict) -> None:
        args, kwargs = map_arg(n.args, env.__getitem__), map_arg(n.kwargs, env.__getitem__)
        if n.op == "call_module":
            env[n] = self.module.get_submodule(n.target)(*args, **kwargs)
        elif n.op == "call_function":
            env[n] = n.target(*args, **kwargs)
        elif n.op == "call_method":
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        elif n.op == "get_attr":
            obj = self.module
            for part in str(n.target).split("."):
                obj = getattr(obj, part)
            env[n] = obj
        for v in self.last_uses.get(n, ()):
            env.pop(v, None)

    def run(self, x, call_region: Callable):
        """The forward on ``x``; each region runs as ``call_region(region, fn, input, its submodules)``,
        which must return ``fn(input)``."""
        env: dict = {}
        i, nodes = 0, self.nodes
        while True:
            n = nodes[i]
            if i in self.starts:
                region, stop, inp, out = self.starts[i]

                def region_fn(v, lo=i, hi=stop, inp=inp, out=out,
                              attrs={k: w for k, w in env.items() if k.op == "get_attr"}):
                    local = {**attrs, inp: v}
                    for node in nodes[lo:hi]:
                        self._step(node, local)
                    return map_arg(out, local.__getitem__)

                submodules = [self.module.get_submodule(node.target) for node in nodes[i:stop]
                              if node.op == "call_module"]
                result = call_region(region, region_fn, env[inp], submodules)
                if region[1] is None:
                    return result
                env[out] = result
                for node in nodes[i:stop]:  # what the region's nodes were the last users of
                    for v in self.last_uses.get(node, ()):
                        if v is not out:
                            env.pop(v, None)
                i = stop
                continue
            if n.op == "placeholder":
                env[n] = x
            elif n.op == "output":
                return map_arg(n.args[0], env.__getitem__)
            else:
                self._step(n, env)
            i += 1


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
