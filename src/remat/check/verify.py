"""Prove it: the equivalence check (one plain and one checkpointed training step, compared exactly).

Measuring real steps (peak memory, step time) is ``remat.runtime.measure``'s."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from remat._compat import tree_flatten, tree_map, uncompiled
from remat.runtime.compiled import CompiledLoop, compiled_loop
from remat.errors import EquivalenceError
from remat.runtime.measure import LossFn, checked_loss, default_loss, input_tensors, model_device, run_step, split_inputs
from remat.costs.unit_costs import parse_region
from remat.solve.plan import Plan
from remat.rewrite import checkpoint_plan, checkpointed_modules, parse_unit, remove_checkpointing
from remat.runtime.state import fresh_grads, preserved, restore, take_snapshot


#: Note [Compiled tolerance]
#: ~~~~~~~~~~~~~~~~~~~~~~~~~~
#: A compiled checkpointed step is another program than the compiled plain step: inductor fuses and reduces
#: in other orders, so the two differ by rounding even when they compute the same function with the same random
#: numbers (a U-Net's gradients 1.9e-09 apart, 4e-07 of their largest value). A
#: compiled model is therefore compared within rtol 1e-4 of each tensor's largest magnitude (atol 1e-7 for
#: tensors of zeros): 250 times those differences, and four orders of magnitude below what other dropout
#: masks make (1.4e-02 on gradients of largest value 8e-03). Eager steps are compared exactly.
COMPILED_RTOL = 1e-4
COMPILED_ATOL = 1e-7


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


@dataclass(frozen=True)
class EquivalenceReport:
    """Largest absolute difference per compared tensor between a plain and a checkpointed step."""

    #: name -> max |plain - checkpointed| ("loss", "output[i]", "grad:<param>", "input_grad[i]", "buffer:<name>")
    max_abs_diff: dict[str, float]
    #: names whose values differ beyond the tolerance, or whose presence/shape differs
    mismatched: tuple[str, ...]
    #: the units checkpointed in the model checked
    checkpointed: tuple[str, ...]
    #: the relative tolerance the comparison used
    rtol: float
    #: the absolute tolerance the comparison used
    atol: float
    #: differences that are not numbers: missing gradients, buffers of other shapes, outputs of another structure
    problems: tuple[str, ...] = field(default_factory=tuple)
    #: how both steps ran: "eager", or the compiled loop (``remat.runtime.compiled.CompiledLoop``) both were compiled as
    compiled: str = "eager"
    #: where the steps differ: whether the checkpointed step's gradient is its own loss's (Note [Is the
    #: gradient its own loss's?]); None when they agree
    slope: SlopeCheck | None = None

    @property
    def equal(self) -> bool:
        return not self.mismatched and not self.problems

    def worst(self, k: int = 5) -> list[tuple[str, float]]:
        return sorted(self.max_abs_diff.items(), key=lambda kv: -kv[1])[:k]

    def __str__(self) -> str:
        head = "equivalent" if self.equal else f"NOT equivalent ({len(self.mismatched)} mismatches)"
        tol = "exact" if self.rtol == 0 and self.atol == 0 else f"rtol={self.rtol}, atol={self.atol}"
        how = "" if self.compiled == "eager" else f"; both steps compiled ({self.compiled})"
        lines = [f"remat equivalence check: {head}; {len(self.max_abs_diff)} tensors compared ({tol}), "
                 f"{len(self.checkpointed)} checkpointed units{how}"]
        for name, d in self.worst():
            flag = "  <-- differs" if name in self.mismatched else ""
            lines.append(f"  {name:<48} max |diff| = {d:.3e}{flag}")
        lines += [f"  problem: {p}" for p in self.problems]
        if self.slope is not None:
            lines.append(f"  {self.slope}")
            if self.slope.consistent and "loss" in self.mismatched:
                lines.append("  so the checkpointed forward computed another loss (other random numbers?) and its "
                             "gradient is right for it")
        return "\n".join(lines)


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


def _diff(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.shape != y.shape:
        return float("inf")
    if x.numel() == 0:
        return 0.0
    if not (x.is_floating_point() or x.is_complex()):
        return float((x != y).any().item())
    d = (x.double() - y.double()).abs()
    d = torch.nan_to_num(d, nan=0.0) if torch.equal(x.isnan(), y.isnan()) else d
    return float(d.max().item())


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


@dataclass(frozen=True)
class _Taken:
    """One step's results, copied: what :func:`compare_steps` compares."""

    loss: torch.Tensor
    outputs: list[torch.Tensor]
    input_grads: list[torch.Tensor | None]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def _take(call: Callable[..., Any], module: nn.Module, args: tuple, kwargs: dict, loss_fn: LossFn, seed: int,
          device: torch.device, *, input_grads: bool = True, output_alive: bool = True,
          host: bool = False) -> _Taken:
    """One step of ``call`` (``module``'s forward, maybe compiled), its gradients and buffers copied out.
    ``input_grads``: differentiate floating-point inputs too (copies of them); else the inputs as given, as the
    loop passes them (a compiled step is then the loop's program). ``host``: every tensor copied to host memory
    (kept through planning without holding the device's)."""
    loss, out, inputs = _run(call, args, kwargs, loss_fn, seed, device, input_grads=input_grads,
                             output_alive=output_alive)

    def kept(t: torch.Tensor | None, copy: bool = True) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.detach()
        return t.to("cpu", copy=True) if host else t.clone() if copy else t

    return _Taken(kept(loss, False), [kept(t, False) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)],
                  [kept(t.grad, False) for t in inputs], {n: kept(p.grad) for n, p in module.named_parameters()},
                  {n: kept(b) for n, b in module.named_buffers()})


def check_equivalence(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    reference: nn.Module | None = None,
    seed: int = 0,
    rtol: float | None = None,
    atol: float | None = None,
) -> EquivalenceReport:
    """Run one training step (forward, loss, backward) of a plain copy and of the checkpointed
    model with the same seed and inputs, and compare loss, outputs, every parameter gradient by
    name, input gradients and buffers. Exact by default (``rtol=atol=0``) for an eager model; a model
    that runs compiled (wrapped by ``torch.compile``, or blocks compiled in place with ``Module.compile()``)
    runs both steps compiled as it is, and is compared within ``COMPILED_RTOL``/``COMPILED_ATOL`` by default
    (Note [Compiled tolerance]). Where the steps differ, the report also says whether the checkpointed step's
    gradient is the slope of its own loss (Note [Is the gradient its own loss's?]).

    ``model`` is not modified (both runs use deep copies); ``reference`` is the plain model to
    compare against (default: a copy of ``model`` with remat's checkpointing removed).
    """
    loss_fn = loss_fn or default_loss
    args, kwargs = split_inputs(example_inputs)
    inner = uncompiled(model)
    loop = compiled_loop(model, inner, None)
    rtol, atol = _tolerance(loop, rtol, atol)
    device = model_device(inner)
    ckpt = copy.deepcopy(inner)
    plain = copy.deepcopy(uncompiled(reference) if reference is not None else inner)
    remove_checkpointing(plain)
    for m in (ckpt, plain):
        m.zero_grad(set_to_none=True)
    with _compiled_as(loop, plain) as call:
        taken_p = _take(call, plain, args, kwargs, loss_fn, seed, device)
    with _compiled_as(loop, ckpt) as call:
        taken_c = _take(call, ckpt, args, kwargs, loss_fn, seed, device)
        report = compare_steps(taken_p, taken_c, rtol=rtol, atol=atol, checkpointed=tuple(checkpointed_modules(model)),
                               compiled="eager" if loop is None else str(loop))
        if not report.equal:
            report = dataclasses.replace(report, slope=slope_check(call, ckpt, args, kwargs, loss_fn, seed=seed,
                                                                   grads=taken_c.grads))
    return report


class CompiledComparison:
    """Note [Compiled plans are proved], without compiles of its own: remat compiles each plan it measures for a
    compiled loop (``remat.api.checked_reading``), and that step, seeded, is also the step compared. The plain
    step (no checkpointing, measured first) is kept; each later plan's step is compared with it as it runs and
    only the report is kept (no tensors)."""

    def __init__(self, loop: CompiledLoop, *, seed: int = 0) -> None:
        self.loop = loop
        self.seed = seed
        self.plain: _Taken | None = None
        #: the report of each plan compared, by its units
        self.reports: dict[tuple[str, ...], EquivalenceReport] = {}

    def step(self, units: tuple[str, ...], call: Callable[..., Any], module: nn.Module, args: tuple, kwargs: dict,
             loss_fn: LossFn, *, output_alive: bool) -> None:
        """One training step of ``call`` (``module`` checkpointed as ``units``, compiled as the loop compiles
        it), seeded; kept (no checkpointing) or compared with the plain one. Leaves ``module``'s gradients set."""
        taken = _take(call, module, args, kwargs, loss_fn, self.seed, model_device(module), input_grads=False,
                      output_alive=output_alive, host=True)
        if not units:
            self.plain = taken
        elif self.plain is not None:
            rtol, atol = _tolerance(self.loop, None, None)
            self.reports[units] = compare_steps(self.plain, taken, rtol=rtol, atol=atol, checkpointed=units,
                                                compiled=str(self.loop))


def check_compiled_plan(model: nn.Module, plan: Plan, args: tuple, kwargs: dict, loss_fn: LossFn,
                        loop: CompiledLoop, *, seed: int = 0, deterministic: bool = False) -> EquivalenceReport:
    """Note [Compiled plans are proved]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Under torch.compile the checkpointed step is a program AOTAutograd and inductor make, not remat: what
    it recomputes and which random numbers it draws are theirs to decide (Note [Random operators under
    compile] in remat.rewrite). So before ``optimize_checkpointing`` returns a plan for a compiled loop it runs
    one step of the plain model and one of the planned model, both compiled as the loop compiles them, with the
    same seed, and compares losses, outputs, gradients and buffers (:func:`compare_steps`, Note [Compiled
    tolerance]): the steps that compiled the two plans to measure them (:class:`CompiledComparison`), else two
    of its own; the inputs as the loop passes them, so that the programs compared are the loop's. Where they
    differ, :func:`slope_check` says whether the planned gradient is its own loss's.

    Inductor orders random kernels that read no activation (dropout masks drawn on fresh tensors) as it
    schedules each program, and the planned program is another than the plain one: they may draw the same
    numbers in another order (seen on a U-Net with inductor's own random numbers: the plain program drew its
    five masks in the order 1, 4, 5, 2, 3). So where the two differ and the planned gradient is its own loss's,
    both steps are compared again with every module in eval mode (``deterministic``: dropout off, BatchNorm on
    its running statistics): equal there, the planned step computes the plain step's function, on other random
    numbers. In place, on ``model`` (uncompiled; without checkpointing before and after): its parameters,
    gradients, buffers, training flags and the RNG are as before when it returns."""
    device = model_device(model)
    rtol, atol = _tolerance(loop, None, None)
    modes = [(m, m.training) for m in model.modules()]
    with preserved(model) as snap, fresh_grads(model.parameters()), _restored(modes):
        if deterministic:
            model.eval()
        remove_checkpointing(model)
        with loop.step(model) as call:
            taken_p = _take(call, model, args, kwargs, loss_fn, seed, device, input_grads=False)
        restore(snap)
        for p in model.parameters():
            p.grad = None
        checkpoint_plan(model, plan)
        try:
            with loop.step(model) as call:
                taken_c = _take(call, model, args, kwargs, loss_fn, seed, device, input_grads=False)
                report = compare_steps(taken_p, taken_c, rtol=rtol, atol=atol, checkpointed=plan.checkpointed,
                                       compiled=str(loop))
                if not report.equal:
                    with torch.no_grad():  # the buffers the plain step started from; the plan stays applied
                        for b, v in snap.buffers:
                            b.copy_(v)
                    report = dataclasses.replace(report, slope=slope_check(
                        call, model, args, kwargs, loss_fn, seed=seed, grads=taken_c.grads, input_grads=False))
        finally:
            remove_checkpointing(model)
    return report


@contextlib.contextmanager
def _restored(modes: list[tuple[nn.Module, bool]]):
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _tolerance(loop: CompiledLoop | None, rtol: float | None, atol: float | None) -> tuple[float, float]:
    """The tolerances given, else exact for an eager step and Note [Compiled tolerance]'s for a compiled one."""
    return (rtol if rtol is not None else 0.0 if loop is None else COMPILED_RTOL,
            atol if atol is not None else 0.0 if loop is None else COMPILED_ATOL)


def _compiled_as(loop: CompiledLoop | None, module: nn.Module):
    """A context giving what runs ``module``'s forward: compiled as ``loop`` compiles it, or ``module``."""
    return loop.step(module) if loop is not None else contextlib.nullcontext(module)


def compare_steps(plain: _Taken, ckpt: _Taken, *, rtol: float, atol: float, checkpointed: tuple[str, ...],
                  compiled: str = "eager") -> EquivalenceReport:
    """Compare two steps taken: loss, outputs, parameter gradients by name, input gradients, buffers."""
    diffs: dict[str, float] = {}
    bad: list[str] = []
    #: differences that are not numbers: missing gradients, buffers of other shapes, outputs of another structure
    problems: list[str] = []

    def cmp(name: str, x: torch.Tensor | None, y: torch.Tensor | None) -> None:
        if x is None and y is None:
            return
        if x is None or y is None:
            diffs[name] = float("inf")
            bad.append(name)
            return
        d = _diff(x.detach(), y.detach())
        diffs[name] = d
        scale = float(x.detach().double().abs().max().item()) if x.numel() and x.is_floating_point() else 0.0
        if d > atol + rtol * scale:
            bad.append(name)

    cmp("loss", plain.loss, ckpt.loss)
    if len(plain.outputs) != len(ckpt.outputs):
        problems.append(f"outputs differ in structure: {len(plain.outputs)} vs {len(ckpt.outputs)} tensors")
    for i, (x, y) in enumerate(zip(plain.outputs, ckpt.outputs)):
        cmp(f"output[{i}]", x, y)
    if plain.grads.keys() != ckpt.grads.keys():
        problems.append("parameter names differ between the plain and the checkpointed model")
    for name in plain.grads.keys() & ckpt.grads.keys():
        cmp(f"grad:{name}", plain.grads[name], ckpt.grads[name])
    for i, (x, y) in enumerate(zip(plain.input_grads, ckpt.input_grads)):
        cmp(f"input_grad[{i}]", x, y)
    for name in plain.buffers.keys() & ckpt.buffers.keys():
        cmp(f"buffer:{name}", plain.buffers[name], ckpt.buffers[name])
    return EquivalenceReport(diffs, tuple(sorted(set(bad))), tuple(checkpointed), rtol, atol, tuple(problems),
                             compiled)


def assert_equivalent(model: nn.Module, example_inputs: Any, **kwargs: Any) -> EquivalenceReport:
    """:func:`check_equivalence`, raising :class:`EquivalenceError` with the report when it fails."""
    report = check_equivalence(model, example_inputs, **kwargs)
    if not report.equal:
        raise EquivalenceError(
            str(report) + "\nRe-run with rtol/atol to allow for nondeterministic kernels, or compare "
            "report.max_abs_diff per tensor for detail."
        )
    return report
