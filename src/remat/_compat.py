"""Private torch APIs remat relies on, in one place.

Each entry names the torch versions it was checked on: CI runs the suite on every release in ``CHECKED_ON``
(``.ci/run``), so each entry was run on those; 2.11 is the lent GPU's image; an entry used only for compiled steps
(from ``COMPILED_FLOOR`` on) says so. When a new torch moves one of them, it breaks here with a message that says
which, instead of deep inside a stage.
"""

from __future__ import annotations

import contextlib
import functools
import types
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import _guards  # checked on 2.8, 2.11, 2.13, 2.15
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: F401 - checked on 2.8, 2.11, 2.13, 2.15
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 - checked on 2.8, 2.11, 2.13, 2.15
from torch.utils._pytree import tree_flatten, tree_map  # noqa: F401 - checked on 2.8, 2.11, 2.13, 2.15
from torch.utils._pytree import keystr as _keystr, tree_flatten_with_path as _tree_flatten_with_path

#: the torch releases remat's suite runs on in CI (``.ci/run``: scripts/test.sh on 2.13, scripts/torch-leg.sh on
#: the others), so every entry below was run on each; an entry says where it was also checked (2.11: the lent
#: GPU's image) or where it needs more than the floor. Named in remat's report of its own failures.
CHECKED_ON = ("2.8", "2.13", "2.15")

#: the least torch remat supports (pyproject.toml's ``torch>=``; README); features that need a later one check
#: with :func:`require_torch`
TORCH_FLOOR = (2, 8)

#: the least torch on which remat plans a torch.compile'd step (remat.runtime.compiled.compiled_loop); why older ones fail
COMPILED_FLOOR = (2, 13)
COMPILED_FLOOR_WHY = ("on torch 2.8-2.12 torch's selective checkpointing under torch.compile fails on remat's plans: "
                      "'Tensor cached during selective activation checkpoint has been mutated'")


def torch_release(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of the running torch, or of ``version`` (``"2.15.0+cu132"`` -> ``(2, 15)``)."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def require_torch(feature: str, least: tuple[int, int], why: str = "") -> None:
    """Refuse ``feature`` (UnsupportedError) on a torch older than ``least``, naming both versions and what to do;
    ``why`` says what the older torch lacks."""
    if torch_release() < least:
        from remat.errors import UnsupportedError

        need = f"{least[0]}.{least[1]}"
        raise UnsupportedError(
            f"{feature} needs torch >= {need}; this is torch {torch.__version__}" + (f" ({why})" if why else "") +
            f". Upgrade torch (pip install 'torch>={need}'), or plan without it.")


def default_foreach(params: list[torch.Tensor], differentiable: bool) -> bool:
    """Whether ``torch.optim`` picks its foreach (multi-tensor) implementation for ``params`` when a
    group leaves ``foreach`` and ``fused`` unset. ``torch.optim.optimizer._default_to_fused_or_foreach``
    (checked on 2.8, 2.11, 2.13, 2.15)."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # a torch that moved it: assume the per-tensor loop (its temporaries are the smaller)
        return False
    return bool(_default_to_fused_or_foreach(params, differentiable, False)[1])


@contextlib.contextmanager
def global_optimizer_hooks_paused() -> Iterator[None]:
    """Run ``torch.optim`` steps without the hooks registered for *every* optimizer
    (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook``): remat's own
    steps on shadow copies must not reach the user's hooks. ``_global_optimizer_pre_hooks`` and
    ``_global_optimizer_post_hooks`` (checked on 2.8, 2.11, 2.13, 2.15)."""
    import torch.optim.optimizer as optim_module

    tables = [getattr(optim_module, n, None) for n in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")]
    saved = [dict(t) if t is not None else None for t in tables]
    for t in tables:
        if t is not None:
            t.clear()
    try:
        yield
    finally:
        for t, s in zip(tables, saved):
            if t is not None:
                t.clear()
                t.update(s)


@contextlib.contextmanager
def outside_dispatch_modes() -> Iterator[None]:
    """Run a few operators unseen by the active ``TorchDispatchMode``s, e.g. selective checkpointing's
    caching mode during a recomputation, which refuses operators the forward did not run.
    ``torch.utils._python_dispatch._disable_current_modes`` (checked on 2.8, 2.11, 2.13, 2.15)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield




def storage_key(t: torch.Tensor) -> int:
    """An identity for the storage behind ``t``, equal for views and aliases and stable while it lives:
    ``UntypedStorage._cdata`` (checked on 2.8, 2.11, 2.13, 2.15)."""
    return local_tensor(t).untyped_storage()._cdata


def untyped_storage_key(st: torch.UntypedStorage) -> int:
    """The identity :func:`storage_key` gives a tensor, for the storage itself: ``UntypedStorage._cdata``
    (checked on 2.8, 2.11, 2.13, 2.15)."""
    return st._cdata


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


def fake_mode() -> FakeTensorMode:
    """A FakeTensorMode that lets real tensors (constants a model creates) mix with fake ones
    (``torch._subclasses.fake_tensor``, checked on 2.8, 2.11, 2.13, 2.15)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def flop_count(func, args: tuple, kwargs: dict, out) -> int:
    """Floating-point operations of one operator call by ``torch.utils.flop_counter``'s formulas; 0 for
    operators without one (``flop_registry`` keyed by ``OpOverload._overloadpacket``, checked on 2.8, 2.11, 2.13,
    2.15)."""
    from torch.utils.flop_counter import flop_registry

    count = flop_registry.get(func._overloadpacket)
    if count is None:
        return 0
    try:
        return int(count(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a FLOP formula that does not fit these arguments
        return 0


def written_arguments(func, args: tuple, kwargs: dict) -> list:
    """The arguments operator ``func`` writes to in place, by its schema (``OpOverload._schema``'s
    ``alias_info.is_write``, checked on 2.8, 2.11, 2.13, 2.15)."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(args[i] if i < len(args) else kwargs.get(a.name))
    return out


def argument(func, args: tuple, kwargs: dict, name: str, missing=None):
    """The value of operator ``func``'s argument ``name`` in this call (its default when not passed),
    or ``missing`` when it has no such argument (``OpOverload._schema``, checked on 2.8, 2.11, 2.13, 2.15)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return kwargs.get(name, args[i] if i < len(args) else a.default_value)
    return missing


def module_stack(node: torch.fx.Node) -> list[str]:
    """Qualified names of the modules an fx/export graph node ran inside, outermost first: the
    ``nn_module_stack`` node metadata that fx tracing and torch.export write (checked on 2.8, 2.11, 2.13, 2.15)."""
    stack = node.meta.get("nn_module_stack") or {}
    names = [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]
    if node.op == "call_module":
        names.append(str(node.target))
    return names


# -- distributed ----------------------------------------------------------------------------------
#: whether each class seen is DTensor or a subclass (these run on every operator a tracker sees: no import,
#: no issubclass per call)
_IS_DTENSOR: dict[type, bool] = {torch.Tensor: False, torch.nn.Parameter: False, FakeTensor: False}


def is_dtensor_class(cls: type) -> bool:
    """Whether ``cls`` is ``torch.distributed.tensor.DTensor`` (or a subclass) (checked on 2.8, 2.11, 2.13, 2.15)."""
    known = _IS_DTENSOR.get(cls)
    if known is not None:
        return known
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    known = _IS_DTENSOR[cls] = isinstance(cls, type) and issubclass(cls, DTensor)
    return known


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's memory: a DTensor's local shard (``DTensor._local_tensor``, read
    without dispatching an operator; checked on 2.8, 2.11, 2.13, 2.15), any other tensor itself."""
    return t._local_tensor if is_dtensor_class(type(t)) else t


def active_fake_mode():
    """The FakeTensorMode in effect, or None. DTensor's sharding propagation runs operators on fake tensors
    of its own (they allocate nothing) (``torch._guards.active_fake_mode``, checked on 2.8, 2.11, 2.13, 2.15)."""
    return _guards.active_fake_mode()


@contextlib.contextmanager
def storage_resizes_reported(callback) -> Iterator[None]:
    """Call ``callback(storage, nbytes)`` after every ``UntypedStorage.resize_``: FSDP2 frees and re-allocates
    its all-gather buffers by resizing their storages (``free_storage``/``alloc_storage``), which no
    dispatch mode sees (the same patch as ``torch.distributed._tools.mem_tracker``; checked on 2.8, 2.11, 2.13, 2.15)."""
    original = torch.UntypedStorage.resize_

    def resize_(st, size):
        result = original(st, size)
        callback(st, int(size))
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


@contextlib.contextmanager
def rng_states_reported(callback) -> Iterator[None]:
    """Call ``callback(state)`` with every tensor ``torch.get_rng_state()`` returns: the CPU RNG state that
    ``torch.utils.checkpoint`` saves per checkpointed call (5 KB) is made outside the dispatcher, where no
    dispatch mode sees it (``torch.get_rng_state`` patched for the duration; checked on 2.8, 2.11, 2.13, 2.15)."""
    original = torch.get_rng_state

    def get_rng_state():
        state = original()
        callback(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def fsdp_modules(model: torch.nn.Module) -> list[tuple[str, bool]]:
    """The modules ``fully_shard`` manages, by qualified name, with whether each reshards its parameters
    after forward (``FSDPModule._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info``; checked on
    2.8, 2.11, 2.13, 2.15)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    out = []
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            out.append((name, group is not None and group.post_forward_mesh_info is not None))
    return out


def default_store():
    """The key-value store of the default process group (``distributed_c10d._get_default_store``, checked
    on 2.8, 2.11, 2.13, 2.15)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(model)`` wraps (``OptimizedModule._orig_mod``; checked on 2.8, 2.11, 2.13, 2.15), or
    ``model`` itself. remat profiles and rewrites that module; the compiled wrapper recompiles on its next
    call (its guards see the new ``forward`` attributes), so plans work however the user compiled."""
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model


def profiler_memory_peak(work: Callable[[], object], device: torch.device) -> int:
    """The most bytes allocated on ``device`` while ``work()`` runs, above what was allocated when it began
    (:func:`profiler_memory_trace`)."""
    return profiler_memory_trace(work, device)[0]


class ProfilerSession:
    """The profiler's allocator-level memory events on ``device`` between ``__enter__`` and ``__exit__``
    (``torch.profiler.profile(profile_memory=True)``, read from ``prof.profiler.kineto_results``; checked on
    2.8, 2.11, 2.13, 2.15): ``peak_bytes``, the most allocated above what was allocated when it began, and ``marked``,
    the bytes allocated above that when each :meth:`mark` was made. It sees what compiled kernels and code
    outside the dispatcher allocate, which a dispatch-level tracker cannot. Frees of memory allocated before
    it started are not reported: allocate what the work frees inside it, or :meth:`follow` it (its free is
    then marked where it happens)."""

    def __init__(self, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.device = torch.device(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof = profile(activities=activities, profile_memory=True)
        self.peak_bytes = 0
        self.marked: dict[str, int] = {}
        self._followed: list[weakref.ref] = []

    def __enter__(self) -> "ProfilerSession":
        with _stderr_silenced():  # kineto logs "profiler_start"/"profiler_stop" lines to fd 2 (torch 2.13)
            self._prof.__enter__()
        return self

    @staticmethod
    def mark(label: str) -> None:
        from torch.profiler import record_function

        with record_function(f"remat::mark::{label}"):
            pass

    def follow(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Count ``nbytes`` (a storage alive before the session began, e.g. the previous step's gradients
        a framework frees during its step) as freed where ``storage`` dies: a mark in the profiler's own
        timeline, made by a weak reference's callback where the last reference goes (the profiler reports
        no free of memory it did not see allocated)."""
        from torch.profiler import record_function

        def freed(_ref) -> None:
            with record_function(f"remat::freed::{nbytes}"):
                pass

        self._followed.append(weakref.ref(storage, freed))

    def __exit__(self, *exc) -> None:
        with _stderr_silenced():
            self._prof.__exit__(*exc)
        self._followed.clear()  # frees after the session are not its
        events = []
        labels: dict[int, str] = {}
        for e in self._prof.profiler.kineto_results.events():
            if e.name() == "[memory]" and e.device_type().name.lower() == self.device.type:
                events.append((e.start_ns(), 0, e.nbytes()))
            elif e.name().startswith("remat::mark::"):
                labels[len(events)] = e.name().removeprefix("remat::mark::")
                events.append((e.start_ns(), 1, 0))
            elif e.name().startswith("remat::freed::"):
                events.append((e.start_ns(), 0, -int(e.name().removeprefix("remat::freed::"))))
        run = 0
        for i in sorted(range(len(events)), key=lambda i: events[i][:2]):
            run += events[i][2]
            self.peak_bytes = max(self.peak_bytes, run)
            if i in labels:
                self.marked[labels[i]] = run


def profiler_memory_trace(work: Callable[[Callable[[str], None]], object] | Callable[[], object],
                          device: torch.device, *, marks: bool = False) -> tuple[int, dict[str, int]]:
    """The most bytes allocated on ``device`` while ``work()`` runs, above what was allocated when it began
    (:class:`ProfilerSession`). With ``marks``, ``work(mark)`` is given a function ``mark(label)``; the
    second result maps each label to the bytes allocated (above the start) when it was marked."""
    with ProfilerSession(device) as session:
        work(session.mark) if marks else work()
    return session.peak_bytes, session.marked


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null within the block (C++ logging that Python cannot turn off)."""
    import os
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (an embedded interpreter): nothing to silence
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


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


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    """The leaves of a pytree with their paths written as code (``[1]``, ``['logits']``); a tree whose
    node types have no keys (a container registered without them) gives ``<leaf i>``."""
    try:
        return [(_keystr(path), leaf) for path, leaf in _tree_flatten_with_path(tree)[0]]
    except Exception:  # noqa: BLE001 - a node type registered without flatten_with_keys
        return [(f" <leaf {i}>", leaf) for i, leaf in enumerate(tree_flatten(tree)[0])]


#: the buffer sizes of programs inductor lowered in this process, by the program's key (Note [Compiled programs])
_PROGRAM_SIZES: dict[str, dict[str, int | None]] = {}
#: the version of the sizes kept next to inductor's cache: raised when what is kept changes
_PROGRAM_SIZES_FORMAT = 2


def _program_sizes_path(key: str):
    from pathlib import Path

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir(), f"remat-programs-{_PROGRAM_SIZES_FORMAT}", f"{key}.json")


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
    import json
    import os

    import torch._inductor.codecache as codecache
    import torch._inductor.graph as inductor_graph
    import torch._inductor.output_code as output_code

    called: list[tuple[str, dict[str, int | None]] | None] = []
    lowered = inductor_graph.GraphLowering.compile_to_module
    run = output_code.CompiledFxGraph.__call__
    lookup = codecache.FxGraphCache.__dict__["_lookup_graph"]
    own_candidates = codecache.FxGraphCache.__dict__.get("iterate_over_candidates")  # (else GuardedCache's)
    candidates = codecache.FxGraphCache.iterate_over_candidates  # (bound to the class: a classmethod)

    def kept(key: str | None) -> dict[str, int | None] | None:
        """The sizes kept for the program of ``key``: in this process, else next to inductor's cache."""
        if not key:
            return None
        if key not in _PROGRAM_SIZES:
            path = _program_sizes_path(key)
            if not path.exists():
                return None
            _PROGRAM_SIZES[key] = json.loads(path.read_text())
        return _PROGRAM_SIZES[key]

    def kept_first(cls, local, remote_cache, key):  # noqa: ANN001 - inductor's GuardedCache.iterate_over_candidates
        # the entries of one graph with their sizes kept before those without (else in inductor's order): an entry
        # cached by a process that did not read it, found first, would be lowered again on every compile
        entries = list(candidates(local, remote_cache, key))
        entries.sort(key=lambda entry: kept(getattr(entry[0], "cache_key", None)) is None)
        yield from entries

    def lookup_kept(*args, **kwargs):
        graph, info = lookup.__func__(*args, **kwargs)
        if graph is not None and kept(getattr(graph, "cache_key", None)) is None:
            return None, info  # lowered again, its sizes kept this time
        return graph, info

    def nbytes(node: Any, hint: Callable[[Any], int]) -> int | None:
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

    def compile_to_module(self):  # noqa: ANN001 - inductor's GraphLowering
        module = lowered(self)
        try:
            # a symbolic size (the CPU RNG state a checkpointed region saves is one) by its hint
            def hint(e: Any) -> int:
                try:
                    return int(e)
                except TypeError:
                    return int(self.sizevars.optimization_hint(e))

            sizes = {name: nbytes(buf, hint) for name, buf in self.name_to_buffer.items()}
            for name, value in self.graph_inputs.items():
                sizes[name] = nbytes(getattr(value, "data", value), hint)
            _PROGRAM_SIZES[self.cache_key] = sizes
            path = _program_sizes_path(self.cache_key)
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(f".{os.getpid()}.part")
            part.write_text(json.dumps(sizes))
            os.replace(part, path)
        except Exception:  # noqa: BLE001 - a lowering this reader does not know, an unwritable cache: not kept
            pass
        return module

    def call(self, inputs):  # noqa: ANN001 - inductor's CompiledFxGraph
        try:
            sizes, source = kept(getattr(self, "cache_key", None)), getattr(self, "source_code", None)
            called.append((source, sizes) if sizes is not None and source else None)
        except Exception:  # noqa: BLE001 - unreadable: a call of unknown sizes
            called.append(None)
        return run(self, inputs)

    inductor_graph.GraphLowering.compile_to_module = compile_to_module
    output_code.CompiledFxGraph.__call__ = call
    codecache.FxGraphCache._lookup_graph = staticmethod(lookup_kept)
    codecache.FxGraphCache.iterate_over_candidates = classmethod(kept_first)
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
