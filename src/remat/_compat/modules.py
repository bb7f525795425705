"""Modules and torch.compile: compiled calls set by ``Module.compile()``, what ``torch.compile`` wraps and was
made with, Lightning's compiled modules (part of remat._compat: see its docstring)."""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, Iterator

import torch


def compiled_call(m: torch.nn.Module) -> Callable | None:
    """The call ``m.compile()`` set on module ``m`` (``Module._compiled_call_impl``; checked on 2.8, 2.11, 2.13, 2.15), None
    where it was not compiled in place."""
    return m.__dict__.get("_compiled_call_impl")


def set_compiled_call(m: torch.nn.Module, impl: Callable | None, *, absent: bool = False) -> None:
    """Make ``impl`` module ``m``'s compiled call (None: its eager call is in effect). ``absent`` removes the
    attribute instead, as a module never compiled has it (``Module._compiled_call_impl``; checked on 2.8, 2.11, 2.13,
    2.15)."""
    if absent:
        m.__dict__.pop("_compiled_call_impl", None)
    else:
        m._compiled_call_impl = impl


def module_call(m: torch.nn.Module) -> Callable:
    """Module ``m``'s own call, hooks included, that ``m.compile()`` compiles (``Module._call_impl``; checked on
    2.8, 2.11, 2.13, 2.15)."""
    return m._call_impl


def lightning_compiled(module: Any) -> tuple[Callable, Callable, Any] | None:
    """For a LightningModule that ``trainer.fit(torch.compile(module))`` unwrapped and compiled in place, its
    original ``forward`` and ``training_step`` and the Dynamo context it was compiled with; None when it was not
    (Lightning's private ``_compiler_ctx``: ``{"compiler": "dynamo", "dynamo_ctx": ..., "original_forward": ...,
    "original_training_step": ...}``, checked on Lightning 2.6)."""
    ctx = getattr(module, "_compiler_ctx", None)
    if isinstance(ctx, dict) and ctx.get("compiler") == "dynamo":
        return ctx["original_forward"], ctx["original_training_step"], ctx["dynamo_ctx"]
    return None


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(model)`` wraps (``OptimizedModule._orig_mod``; checked on 2.8, 2.11, 2.13, 2.15), or
    ``model`` itself. remat profiles and rewrites that module; the compiled wrapper recompiles on its next
    call (its guards see the new ``forward`` attributes), so plans work however the user compiled."""
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model


def compile_fn(fn, settings: dict):
    """``torch.compile(fn, **settings)`` in a compile region of its own (``isolate_recompiles=True``, torch
    2.13; compiled steps only: checked on 2.13, 2.15) with a recompile limit of 64 (``recompile_limit``): remat's checks compile plans
    the loop will never run, and must not count against the limit of the user's own compiled code (past it,
    Dynamo silently runs the frame eagerly). On a torch without these options, the plain compile."""
    import inspect

    params = inspect.signature(torch.compile).parameters
    extra = {k: v for k, v in (("isolate_recompiles", True), ("recompile_limit", 64)) if k in params}
    return torch.compile(fn, **settings, **extra)


def cacheable_context_fn(context_fn: functools.partial, key: str) -> functools.partial:
    """``context_fn`` (a checkpoint's selective policy, passed under torch.compile) marked with ``key`` as its
    ``cache_hash``, which AOTAutograd's cache takes as what identifies the policy; without it the cache is
    bypassed for every graph holding the checkpoint, and each compile of a plan traces it again (the tests' GPT
    with AdamW: 9.6 s per warm ``optimize_checkpointing`` against 2.6 s; compiled steps only: checked on 2.13, 2.15, where the attribute is
    read by ``autograd_cache._get_context_fn_cache_hash``; elsewhere it is an unread attribute). ``key`` must
    change whenever the policy would decide otherwise. Returns ``context_fn``."""
    context_fn.cache_hash = key
    return context_fn


def compile_settings(compiled: Any) -> dict | None:
    """The ``torch.compile`` keyword arguments ``compiled`` was made with: a model ``torch.compile`` wraps (an
    ``OptimizedModule``), a module's ``_compiled_call_impl`` (``Module.compile()``) or Dynamo's context itself
    (Lightning keeps it in ``_compiler_ctx``). ``backend`` (a registered
    name, else the callable; left out for inductor, the default), ``options`` (inductor's configuration, which a
    ``mode`` expands into), ``fullgraph``, ``dynamic``; None where they cannot be read. Read from Dynamo's
    ``OptimizeContext`` (``OptimizedModule.dynamo_ctx``, or the compiled function's closure): ``fullgraph``,
    ``_dynamic``, and ``callback._torchdynamo_orig_backend._torchdynamo_orig_backend``, the backend wrapper with
    its ``_compiler_name`` and, for inductor, ``config`` (compiled steps only: checked on 2.13, 2.15)."""
    try:
        from torch._dynamo.backends.registry import list_backends
        from torch._dynamo.eval_frame import OptimizeContext

        ctx = compiled if isinstance(compiled, OptimizeContext) else getattr(compiled, "dynamo_ctx", None)
        if ctx is None:
            cells = []
            for cell in getattr(compiled, "__closure__", None) or ():
                try:
                    cells.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
            ctx = next((c for c in cells if isinstance(c, OptimizeContext)), None)
        if not isinstance(ctx, OptimizeContext):
            return None
        backend = ctx.callback._torchdynamo_orig_backend._torchdynamo_orig_backend
        name = getattr(backend, "_compiler_name", None)
        config = getattr(backend, "config", None)
        out: dict = {}
        if isinstance(config, dict):  # inductor's wrapper
            if config:
                out["options"] = dict(config)
        elif isinstance(name, str) and name in list_backends(exclude_tags=()):
            out["backend"] = name
        else:
            fn = getattr(backend, "compiler_fn", None)
            if not callable(fn):
                return None
            out["backend"] = fn
        if ctx.fullgraph:
            out["fullgraph"] = True
        if ctx._dynamic is not None:
            out["dynamic"] = ctx._dynamic
        return out
    except (AttributeError, ImportError, TypeError):
        return None


@functools.cache
def _module_compile_skips_torch_modules() -> bool:
    """Whether ``Module.compile()`` of one of torch.nn's own modules captures no frame in this torch: Dynamo
    skips the top frame ``Module._call_impl`` (it leaves it out of ``wrap_inline``) and the module's forward
    (torch.nn's files are in its skip rules), so the backend is never called (pytorch#150915; seen on 2.13).
    Found out once per process on a ``nn.ReLU`` with a backend that only counts: a torch that fixes it
    captures the frame, and then every compiled block counts as compiled."""
    graphs: list = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    try:
        with torch.no_grad():
            torch.compile(torch.nn.ReLU()._call_impl, backend=counting)(torch.ones(1))
    except Exception:  # noqa: BLE001 - Dynamo unavailable here: take Module.compile() at its word
        return False
    return not graphs


def _unwrapped_forward(m: torch.nn.Module) -> Callable:
    """``m``'s forward as the user's model has it: remat's checkpointed forwards (callables with ``previous``
    and ``unit_names``, remat.rewrite) looked through."""
    f = m.__dict__.get("forward")
    while f is not None and hasattr(f, "previous") and hasattr(f, "unit_names"):
        f = f.previous
    return f if f is not None else types.MethodType(type(m).forward, m)


def module_compile_compiles_nothing(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` compiles nothing in this torch: Dynamo captures no frame of ``module``'s own
    (:func:`_module_compile_skips_torch_modules`) and none under it, because every forward in its subtree is one
    Dynamo's trace rules skip (torch.nn's modules: ``trace_rules.check``, checked on 2.13, 2.15) and no module hooks (a
    hook is a frame Dynamo would capture) are registered. A module of the user's own class, or one with a
    submodule of one, compiles its frames: False."""
    if not _module_compile_skips_torch_modules():
        return False
    from torch._dynamo import trace_rules
    from torch.nn.modules import module as module_module

    if any(getattr(module_module, n, None) for n in (
            "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
            "_global_backward_pre_hooks")):
        return False
    for m in module.modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return False
        try:
            if not trace_rules.check(_unwrapped_forward(m)):
                return False
        except Exception:  # noqa: BLE001 - a forward Dynamo cannot place (no source file): assume it compiles
            return False
    return True


def compiled_submodules(model: torch.nn.Module) -> list[str]:
    """Qualified names of the submodules compiled in place with ``Module.compile()`` (their
    ``_compiled_call_impl`` is set; checked on 2.8, 2.11, 2.13, 2.15), outermost only."""
    out: list[str] = []
    for name, m in model.named_modules():
        if compiled_call(m) is not None and not any(
                name.startswith(o + ".") or o == "" for o in out):
            out.append(name)
    return out


@contextlib.contextmanager
def submodules_called(model: torch.nn.Module, names: list[str], call: Callable | None) -> Iterator[None]:
    """Within the block, the submodules ``names`` (compiled in place by ``Module.compile()``) run
    ``call(module)`` as their compiled call: ``None`` runs them eagerly (for profiling: a dispatch-level
    recorder must see their operators); afterwards their own compiled calls are back
    (``Module._compiled_call_impl``; checked on 2.8, 2.11, 2.13, 2.15)."""
    mods = dict(model.named_modules())
    saved = [(mods[n], mods[n]._compiled_call_impl) for n in names]
    try:
        for m, _ in saved:
            m._compiled_call_impl = None if call is None else call(m)
        yield
    finally:
        for m, impl in saved:
            m._compiled_call_impl = impl
