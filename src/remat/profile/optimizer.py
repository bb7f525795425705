"""Optimizer accounting: what the user's optimizer adds to a step.

Note [Never call the user's optimizer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
remat must learn the optimizer's memory without touching it. The user's optimizer object is
not a safe thing to call or copy: a learning-rate scheduler replaces ``optimizer.step`` on the
*instance* with a wrapper bound (through a weak reference) to that optimizer, so a copy of its
instance attributes steps the user's optimizer on the user's parameters; hooks registered on it
would fire; its state would grow. So remat reads only its class, ``param_groups`` (the
hyperparameters, never the parameters' values) and ``defaults``, and builds *independent*
optimizers of the same class through the class's own constructor, over zero-filled shadow
parameters, one parameter at a time (profiling never holds a second copy of the model). The
shadow step is called through the class (``type(opt).step(opt)``), never through an instance
attribute, and with ``torch.optim``'s global step hooks paused (``remat._compat``). What a step
creates on a shadow is the state the real step creates for that parameter: same class, same
hyperparameters, same shape, dtype and device. So parameters of one group alike in class, dtype, device,
shape, local shard (shape and strides) and, for a DTensor, placements and mesh are stepped once, and the first one's
figures count for each (a GPT-2 small's 148 parameters are 9 shapes: its 450 shadow steps took 1.9 s of planning
under cProfile, issue #60). (Alike by global shape alone, DTensor parameters placed otherwise shared one's figures: the
2 x 2 mesh of tests/slow/test_two_d_mesh.py predicted its plain peak 131,072 bytes above the ranks' measured one.)
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from remat._compat import default_foreach, global_optimizer_hooks_paused, local_tensor
from remat.errors import UnsupportedError
from remat.runtime.measure import Clock, StorageTracker, tensor_bytes

#: optimizers whose step is not a function of (parameters, gradients, state): they cannot be stepped on
#: shadows, and remat does not predict them (class name -> why)
UNSUPPORTED = {
    "LBFGS": "its step re-runs a closure (forward and backward) up to max_iter times and keeps a history "
             "of flat parameter-sized vectors",
    "SparseAdam": "it takes sparse gradients only; remat plans dense training steps",
}


@dataclass(frozen=True)
class OptimizerCost:
    """What an optimizer adds to one training step, in steady state (after its first step)."""

    #: optimizer state on the model's device (moments, momentum buffers, step counters there), bytes
    state_bytes: int
    #: temporaries of one step on top of everything else alive then, bytes
    step_bytes: int
    #: predicted wall time of one step, seconds
    step_s: float
    #: what the accounting covers, e.g. "AdamW" or "none (no optimizer given: ...)"
    label: str


NO_OPTIMIZER = OptimizerCost(0, 0, 0.0, "none (no optimizer given: no optimizer state counted)")


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings, without its parameters (read only; nothing is called)."""
    return {k: v for k, v in group.items() if k != "params"}


def independent_copy(optimizer: torch.optim.Optimizer, hp: dict[str, Any],
                     params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``params`` with the settings ``hp``, built by the
    class's constructor (Note [Never call the user's optimizer]). Keys of ``hp`` the constructor does
    not take (``initial_lr``, ``max_lr`` from schedulers) are left out. Shares nothing with
    ``optimizer``."""
    cls = type(optimizer)
    if cls.__name__ in UNSUPPORTED and cls.__module__.startswith("torch.optim"):
        raise UnsupportedError(
            f"remat cannot predict the memory of torch.optim.{cls.__name__}: {UNSUPPORTED[cls.__name__]}. Pass "
            "optimizer=None and lower budget_gb by the optimizer's state yourself."
        )
    try:
        accepted = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        accepted = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in hp.items() if takes_any or k in accepted}
    for k, v in kwargs.items():  # a tensor learning rate (or beta) must not be shared with the user's group
        if isinstance(v, torch.Tensor):
            kwargs[k] = v.detach().clone()
    try:
        return cls(params, **kwargs)
    except Exception as e:  # noqa: BLE001 - a constructor whose arguments are not its group's keys
        raise UnsupportedError(
            f"remat cannot build a copy of optimizer {cls.__name__} to measure its state: "
            f"{cls.__name__}(params, **group settings) failed ({type(e).__name__}: {e}). remat never steps your "
            f"own optimizer (Note [Never call the user's optimizer]); give {cls.__name__} a constructor that "
            "accepts its param_groups' keys, or pass optimizer=None and lower budget_gb by its state."
        ) from e


def _step(opt: torch.optim.Optimizer) -> None:
    """One step of a shadow optimizer, through its class (never an instance attribute)."""
    type(opt).step(opt)


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]


def _shadow_step(optimizer: torch.optim.Optimizer, hp: dict[str, Any], p: torch.Tensor,
                 like: dict[int, torch.Tensor] | None, device: torch.device, clock: Clock) -> tuple[int, int, float]:
    """One parameter's optimizer cost, on a shadow like ``p`` stepped by an independent copy of ``optimizer`` with the
    group's settings ``hp``: its state's bytes, its step's temporaries (bytes) and the step's seconds."""
    cls = type(optimizer)
    shadow = torch.zeros_like(p).requires_grad_(True)
    shadow.grad = torch.zeros_like(p)
    opt = independent_copy(optimizer, hp, [shadow])
    try:
        _step(opt)
    except Exception as e:  # noqa: BLE001
        raise UnsupportedError(
            f"cannot account for optimizer {cls.__name__}: a step of an independent copy on a "
            f"zero-filled parameter of shape {tuple(p.shape)} failed ({type(e).__name__}: {e}); "
            "pass optimizer=None to leave its state out of the budget"
        ) from e
    state = tensor_bytes(_state_tensors(opt), device)
    with StorageTracker(device, ignore=[shadow, shadow.grad, *_state_tensors(opt)], count_fake=like is not None) as tr:
        _step(opt)
    return state, tr.peak_bytes, clock.time(functools.partial(_step, opt))


def optimizer_costs(optimizer: torch.optim.Optimizer | None, device: torch.device, *,
                    like: dict[int, torch.Tensor] | None = None, foreach: bool | None = None) -> OptimizerCost:
    """The steady-state cost of ``optimizer`` on ``device``, measured on shadow copies (Note [Never
    call the user's optimizer]): one step creates a parameter's state, a second step is tracked for
    its temporaries and timed. ``like``: for a modelled target (remat.target), the fake tensor standing for
    each parameter (by ``id``): shadows are made like it, under the FakeTensorMode the caller holds, and
    their bytes counted as that target's allocator counts them (``foreach``: the target's default when the
    group does not say; the time is then meaningless and the caller's to replace). Temporaries add up across parameters when the optimizer runs its
    foreach/fused implementation, and are the largest single parameter's otherwise. Time: the
    per-parameter step times, less the fixed cost of a step call (timed on a one-element shadow) paid
    once per parameter instead of once.

    Reads ``optimizer``'s class, ``param_groups`` settings and parameter shapes; calls nothing on it
    and changes nothing."""
    if optimizer is None:
        return NO_OPTIMIZER
    cls = type(optimizer)
    state_bytes = 0
    temps: list[int] = []
    total_s = 0.0
    multi = False
    first_hp: dict[str, Any] | None = None
    first_param: torch.Tensor | None = None
    clock = Clock(device)
    with global_optimizer_hooks_paused(), torch.no_grad():
        for group in optimizer.param_groups:
            hp = hyperparameters(group)
            trainable = [p for p in group["params"] if p.requires_grad]
            if not trainable:
                continue
            if first_hp is None:
                first_hp, first_param = hp, trainable[0]
            if foreach is not None and hp.get("foreach") is None and not hp.get("fused"):
                hp["foreach"] = foreach
            if hp.get("fused"):
                multi = True
            elif hp.get("foreach") is None:
                multi = multi or default_foreach(trainable, bool(hp.get("differentiable")))
            else:
                multi = multi or bool(hp.get("foreach"))
            seen: dict[tuple, tuple[int, int, float]] = {}  # a group's parameters alike step alike
            for p in trainable:
                p = like[id(p)] if like is not None else p
                local = local_tensor(p)  # a DTensor's shard: its placements decide the bytes of its state
                alike = (type(p), p.dtype, p.device, tuple(p.shape), tuple(local.shape), tuple(local.stride()),
                         str(getattr(p, "placements", "")), id(getattr(p, "device_mesh", None)))
                if alike not in seen:
                    seen[alike] = _shadow_step(optimizer, hp, p, like, device, clock)
                state, temp, seconds = seen[alike]
                state_bytes += state
                temps.append(temp)
                total_s += seconds
        temp = sum(temps) if multi else max(temps, default=0)
        if len(temps) > 1 and first_hp is not None:
            total_s = max(total_s - (len(temps) - 1) * _call_overhead_s(optimizer, first_hp, first_param, device),
                          total_s / len(temps))
    return OptimizerCost(state_bytes, temp, total_s, cls.__name__)


def _call_overhead_s(optimizer: torch.optim.Optimizer, hp: dict[str, Any], like: torch.Tensor,
                     device: torch.device) -> float:
    """Seconds of one step call of an independent copy over a single element shaped like ``like``
    (same number of dimensions: Muon takes matrices only): the step's fixed cost."""
    tiny = torch.zeros((1,) * max(like.dim(), 1), device=device, dtype=like.dtype, requires_grad=True)
    tiny.grad = torch.zeros_like(tiny)
    opt = independent_copy(optimizer, hp, [tiny])
    _step(opt)
    clock = Clock(device)
    return min(clock.time(lambda: _step(opt)) for _ in range(5))
