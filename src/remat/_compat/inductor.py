"""Inductor's programs: the sizes of the buffers of each graph inductor compiled, read where it is lowered and kept
next to inductor's cache (Note [Compiled programs] in remat.costs.compiled_memory; part of remat._compat: see its
docstring)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Iterator

import torch

#: the buffer sizes of programs inductor lowered in this process, by the program's key (Note [Compiled programs])
_PROGRAM_SIZES: dict[str, dict[str, int | None]] = {}
#: the version of the sizes kept next to inductor's cache: raised when what is kept changes
_PROGRAM_SIZES_FORMAT = 2


def random_numbers() -> str:
    """Which random numbers inductor's programs draw, as a plan proved under them says it
    (``torch._inductor.config.fallback_random``: checked on torch 2.8, 2.13 and 2.15)."""
    if torch._inductor.config.fallback_random:
        return "eager's random numbers (torch._inductor.config.fallback_random=True)"
    return "inductor's own random numbers (torch._inductor.config.fallback_random=False)"


def _program_sizes_path(key: str):
    from pathlib import Path

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir(), f"remat-programs-{_PROGRAM_SIZES_FORMAT}", f"{key}.json")


def _kept_sizes(key: str | None) -> dict[str, int | None] | None:
    """The sizes kept for the program of ``key``: in this process, else next to inductor's cache."""
    if not key:
        return None
    if key not in _PROGRAM_SIZES:
        path = _program_sizes_path(key)
        if not path.exists():
            return None
        _PROGRAM_SIZES[key] = json.loads(path.read_text())
    return _PROGRAM_SIZES[key]


def _kept_first(candidates: Callable) -> Callable:
    """Inductor's ``FxGraphCache.iterate_over_candidates`` (``candidates``, bound to the class) with the entries
    of one graph whose sizes are kept first (:func:`inductor_programs`)."""

    def kept_first(cls, local, remote_cache, key):  # noqa: ANN001 - inductor's GuardedCache.iterate_over_candidates
        # the entries of one graph with their sizes kept before those without (else in inductor's order): an entry
        # cached by a process that did not read it, found first, would be lowered again on every compile
        entries = list(candidates(local, remote_cache, key))
        entries.sort(key=lambda entry: _kept_sizes(getattr(entry[0], "cache_key", None)) is None)
        yield from entries

    return kept_first


def _lookup_kept(lookup: Any) -> Callable:
    """Inductor's ``FxGraphCache._lookup_graph`` (``lookup``, the staticmethod) that misses a graph whose sizes are
    not kept (:func:`inductor_programs`)."""

    def lookup_kept(*args, **kwargs):
        graph, info = lookup.__func__(*args, **kwargs)
        if graph is not None and _kept_sizes(getattr(graph, "cache_key", None)) is None:
            return None, info  # lowered again, its sizes kept this time
        return graph, info

    return lookup_kept


def _buffer_nbytes(node: Any, hint: Callable[[Any], int]) -> int | None:
    """The bytes of one buffer or input of a lowered graph, symbolic sizes by ``hint``; None where unknown."""
    try:
        layout = node.get_layout()
        size, stride = [hint(s) for s in layout.size], [hint(s) for s in layout.stride]
        elements = (1 + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else 0) + hint(layout.offset)
        return elements * node.get_dtype().itemsize
    except Exception:  # noqa: BLE001 - a layout without a size (NoneLayout, MultiOutputLayout), no hint
        pass
    try:  # a multi-output kernel's: all its outputs, those the program never names too (from its FX node)
        if type(getattr(node, "layout", None)).__name__ != "MultiOutputLayout":
            return None
        origins = [getattr(node, "origin_node", None), *sorted(getattr(node, "origins", ()), key=lambda o: o.name)]
        value = next(o.meta["val"] for o in origins if o is not None and isinstance(o.meta.get("val"), (list, tuple)))
        leaves = torch.utils._pytree.tree_leaves(value)
        return sum(hint(t.untyped_storage().nbytes()) for t in leaves if isinstance(t, torch.Tensor))
    except Exception:  # noqa: BLE001 - no node, no value: unknown
        return None


def _keep_program_sizes(graph: Any) -> None:
    """Keep the sizes of the program inductor's ``GraphLowering`` ``graph`` just lowered (its ``name_to_buffer`` and
    ``graph_inputs``), by its ``cache_key``: in this process and next to inductor's cache."""

    # a symbolic size (the CPU RNG state a checkpointed region saves is one) by its hint
    def hint(e: Any) -> int:
        try:
            return int(e)
        except TypeError:
            return int(graph.sizevars.optimization_hint(e))

    sizes = {name: _buffer_nbytes(buf, hint) for name, buf in graph.name_to_buffer.items()}
    for name, value in graph.graph_inputs.items():
        sizes[name] = _buffer_nbytes(getattr(value, "data", value), hint)
    _PROGRAM_SIZES[graph.cache_key] = sizes
    path = _program_sizes_path(graph.cache_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(f".{os.getpid()}.part")
    part.write_text(json.dumps(sizes))
    os.replace(part, path)


def _compile_to_module_keeping(lowered: Callable) -> Callable:
    """Inductor's ``GraphLowering.compile_to_module`` (``lowered``) that keeps the sizes of what it lowers."""

    def compile_to_module(self):  # noqa: ANN001 - inductor's GraphLowering
        module = lowered(self)
        try:
            _keep_program_sizes(self)
        except Exception:  # noqa: BLE001 - a lowering this reader does not know, an unwritable cache: not kept
            pass
        return module

    return compile_to_module


def _call_recorded(run: Callable, called: list) -> Callable:
    """Inductor's ``CompiledFxGraph.__call__`` (``run``) that appends (its source, its kept sizes) to ``called``
    per call, None where they are not known."""

    def call(self, inputs):  # noqa: ANN001 - inductor's CompiledFxGraph
        try:
            sizes, source = _kept_sizes(getattr(self, "cache_key", None)), getattr(self, "source_code", None)
            called.append((source, sizes) if sizes is not None and source else None)
        except Exception:  # noqa: BLE001 - unreadable: a call of unknown sizes
            called.append(None)
        return run(self, inputs)

    return call


@contextlib.contextmanager
def inductor_programs() -> Iterator[list[tuple[str, dict[str, int | None]] | None]]:
    """Within the block, each call of a graph inductor compiled (``CompiledFxGraph.__call__``, which
    AOTAutograd's runtime calls per forward and backward) appends (its wrapper's source, the bytes of each of its
    buffers and inputs by name) to the list yielded, in the order run (Note [Compiled programs] in
    remat.costs.compiled_memory): a graph that runs twice, twice (two blocks of one shape share it); None for one
    whose sizes are not known. Sizes are read where a graph is lowered
    (``GraphLowering.compile_to_module``: its ``name_to_buffer`` and ``graph_inputs``) and kept by the
    program's key (``GraphLowering.cache_key``, a hash of its source) in this process and next to inductor's
    cache (``remat-programs-2/<key>.json`` in its cache directory), so a graph inductor loads from its cache,
    which is not lowered again, is read too (by its ``cache_key``, with its ``source_code``). Of a graph's entries, those with their sizes kept are tried first
    (``FxGraphCache.iterate_over_candidates``; inductor reads them in name order and takes the first whose
    guards pass); a graph whose only entry was cached without its sizes kept (by a process that did not read it)
    is a miss within the block (``FxGraphCache._lookup_graph``), so it is lowered again and its sizes kept.
    A symbolic size counts by its hint; a multi-output kernel's buffer, without a layout of its own, counts all
    its outputs (its FX node's value), also those the program never names. Compiled steps only: checked on 2.13, 2.15."""
    import torch._inductor.codecache as codecache
    import torch._inductor.graph as inductor_graph
    import torch._inductor.output_code as output_code

    called: list[tuple[str, dict[str, int | None]] | None] = []
    lowered = inductor_graph.GraphLowering.compile_to_module
    run = output_code.CompiledFxGraph.__call__
    lookup = codecache.FxGraphCache.__dict__["_lookup_graph"]
    own_candidates = codecache.FxGraphCache.__dict__.get("iterate_over_candidates")  # (else GuardedCache's)
    candidates = codecache.FxGraphCache.iterate_over_candidates  # (bound to the class: a classmethod)

    inductor_graph.GraphLowering.compile_to_module = _compile_to_module_keeping(lowered)
    output_code.CompiledFxGraph.__call__ = _call_recorded(run, called)
    codecache.FxGraphCache._lookup_graph = staticmethod(_lookup_kept(lookup))
    codecache.FxGraphCache.iterate_over_candidates = classmethod(_kept_first(candidates))
    try:
        yield called
    finally:
        inductor_graph.GraphLowering.compile_to_module = lowered
        output_code.CompiledFxGraph.__call__ = run
        codecache.FxGraphCache._lookup_graph = lookup
        if own_candidates is not None:
            codecache.FxGraphCache.iterate_over_candidates = own_candidates
        else:
            del codecache.FxGraphCache.iterate_over_candidates
