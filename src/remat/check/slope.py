"""Note [Is the gradient its own loss's?]: the slope check, and the seeded steps the equivalence check runs.

In: what runs a model's forward (``call``: the module, or its compiled forward), the model, its inputs, the loss
function and a seed (optionally the gradients of a step already run). Out: a :class:`SlopeCheck` (the loss's slope
along each direction from the gradient and from central differences of the loss), and ``_run``'s one seeded
training step (loss, output, input tensors) for :mod:`remat.check.compare`. Used by :mod:`remat.check.verify`
and :mod:`remat.check.compiled` where two steps differ."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from remat._compat import tree_map
from remat.runtime.measure import LossFn, checked_loss, input_tensors, model_device, run_step
from remat.costs.unit_costs import parse_region
from remat.rewrite import checkpointed_modules, parse_unit
from remat.runtime.state import fresh_grads, preserved, restore, take_snapshot


@dataclass(frozen=True)
class SlopeCheck:
    """Note [Is the gradient its own loss's?]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A checkpointed step can differ from the plain one in two ways that call for different remedies: its forward
    computed something else (other dropout masks: the step is another sample of the same training, and its
    gradient is right for it), or its recomputation did (masks drawn again otherwise than in the forward: the
    gradient belongs to no loss the forward computed, and training is silently wrong). The second shows
    without any reference: the loss's slope along a direction ``v``, from the gradient (``grad . v``), against
    the slope of the loss itself, from central differences of the same checkpointed forward with the same seed
    (``(L(p + h v) - L(p - h v)) / 2h``). The directions: the whole gradient, and for each checkpointed unit
    the gradient of its parameter with the largest one (a recomputation that computes otherwise shows first
    in the gradients of the unit's own parameters; a random direction's slope is too small to difference in
    float32). ``h`` moves the loss by 1e-4 of its value; rounding and curvature then keep a consistent step's
    two slopes within a few per cent, where other masks in the recomputation put them tens of per cent apart
    (figures in tests/integration/test_equivalence_slope.py)."""

    #: what each direction is: "gradient" (all of it), or a parameter's name (its own gradient)
    directions: tuple[str, ...]
    #: the loss's slope along each direction as the gradient gives it (loss units per unit step)
    from_gradient: tuple[float, ...]
    #: the same slopes from central differences of the loss itself
    from_loss: tuple[float, ...]
    #: how far apart the two may be, relative to the larger
    rtol: float = 0.05

    @property
    def consistent(self) -> bool:
        return all(abs(a - b) <= self.rtol * max(abs(a), abs(b), 1e-12)
                   for a, b in zip(self.from_gradient, self.from_loss))

    def __str__(self) -> str:
        pairs = ", ".join(f"{d}: {a:.4g} from the gradient, {b:.4g} from the loss"
                          for d, a, b in zip(self.directions, self.from_gradient, self.from_loss))
        verdict = "the gradient is the slope of the step's own loss" if self.consistent else \
            "the gradient is NOT the slope of the step's own loss: the recomputation computed otherwise than the forward"
        return f"{verdict} ({pairs}; within {self.rtol:.0%})"


def _prepare_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Fresh leaf copies; floating-point inputs require grad so their gradients are compared too."""
    def f(t):
        if isinstance(t, torch.Tensor):
            c = t.detach().clone()
            return c.requires_grad_(True) if c.is_floating_point() else c
        return t
    return tree_map(f, args), tree_map(f, kwargs)


def _forked_rng(device: torch.device):
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _run(call: Callable[..., Any], args, kwargs, loss_fn: LossFn, seed: int, device: torch.device, *,
         input_grads: bool = True, output_alive: bool = True):
    with _forked_rng(device):
        torch.manual_seed(seed)
        a, k = _prepare_inputs(args, kwargs) if input_grads else (args, kwargs)
        step = run_step(call, a, k, loss_fn, output_alive=output_alive)
    return step.loss, step.output, input_tensors(a, k) if input_grads else []


def _unit_prefix(unit: str) -> str:
    """The module a unit's parameters live under: ``h.3@ops2`` -> ``h.3``, ``blocks[0:2]`` -> ``blocks``,
    ``up.2[conv1:conv2]`` -> ``up.2``."""
    region = parse_region(unit)
    return region[0] if region is not None else parse_unit(unit)[0]


def slope_check(call: Callable[..., Any], model: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, *,
                seed: int = 0, grads: dict[str, torch.Tensor] | None = None, max_units: int = 4,
                input_grads: bool = True) -> SlopeCheck:
    """Note [Is the gradient its own loss's?]: the loss's slope along the gradient, and along the gradient of
    the parameter with the largest gradient in each of (at most ``max_units``) checkpointed units, from the
    gradient of one step of ``call`` (``model``'s forward, maybe compiled) and from central differences of its
    loss, every forward with ``seed``. ``grads``: that step's parameter gradients by name, if it has run (else
    it runs here); ``input_grads``: whether that step differentiated its inputs (the forwards here take them
    alike, so that a compiled forward is the same program). ``model``'s parameters, gradients, buffers and the
    RNG are as before when it returns."""
    device = model_device(model)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with preserved(model), fresh_grads(params.values()):
        if grads is None:
            _run(call, args, kwargs, loss_fn, seed, device, input_grads=input_grads)
            grads = {n: p.grad for n, p in params.items()}
        g = {n: grads[n].detach().double() for n in params if grads.get(n) is not None}
        norms = {n: float(t.norm()) for n, t in g.items()}
        g_norm = sum(v * v for v in norms.values()) ** 0.5
        directions: dict[str, dict[str, torch.Tensor]] = {"gradient": {n: t / max(g_norm, 1e-30)
                                                                        for n, t in g.items()}}
        for unit in checkpointed_modules(model)[:max_units]:
            prefix = _unit_prefix(unit)
            inside = [n for n in g if prefix == "" or n.startswith(prefix + ".")]
            if inside and max(norms[n] for n in inside) > 0:
                n = max(inside, key=norms.__getitem__)
                directions.setdefault(n, {n: g[n] / norms[n]})
        snap = take_snapshot(model)
        start = {n: params[n].detach().clone() for n in g}

        def loss_at(v: dict[str, torch.Tensor], h: float) -> float:
            restore(snap)
            with torch.no_grad():
                for n, d in v.items():
                    params[n].copy_(start[n].double().add(d, alpha=h).to(start[n].dtype))
            with _forked_rng(device):
                torch.manual_seed(seed)
                a, k = _prepare_inputs(args, kwargs) if input_grads else (args, kwargs)
                loss = float(checked_loss(loss_fn, call(*a, **k)).detach().double())
            with torch.no_grad():
                for n in v:
                    params[n].copy_(start[n])
            return loss

        base = abs(loss_at({}, 0.0))
        from_gradient, from_loss = [], []
        for v in directions.values():  # unit vectors along gradients: the slope is the gradient's norm
            slope = sum(float((g[n] * d).sum()) for n, d in v.items())
            h = 1e-4 * max(base, 1e-6) / max(abs(slope), 1e-12)  # moves the loss by 1e-4 of its value
            from_gradient.append(slope)
            from_loss.append((loss_at(v, h) - loss_at(v, -h)) / (2 * h))
        restore(snap)
    return SlopeCheck(tuple(directions), tuple(from_gradient), tuple(from_loss))
