"""Prove it: the equivalence check, and measured peak memory and step time of real steps."""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from remat.api import default_loss, model_device, split_inputs
from remat.errors import EquivalenceError
from remat.measure import StepMeasurement, measure_training_step, new_step, outside_autocast
from remat.rewrite import checkpointed_modules, remove_checkpointing
from remat.state import keeps_rng

LossFn = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class EquivalenceReport:
    """Largest absolute difference per compared tensor between a plain and a checkpointed step."""

    #: name -> max |plain - checkpointed| ("loss", "output[i]", "grad:<param>", "input_grad[i]", "buffer:<name>")
    max_abs_diff: dict[str, float]
    #: names whose values differ beyond the tolerance, or whose presence/shape differs
    mismatched: tuple[str, ...]
    checkpointed: tuple[str, ...]
    rtol: float
    atol: float
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def equal(self) -> bool:
        return not self.mismatched and not self.problems

    def worst(self, k: int = 5) -> list[tuple[str, float]]:
        return sorted(self.max_abs_diff.items(), key=lambda kv: -kv[1])[:k]

    def __str__(self) -> str:
        head = "equivalent" if self.equal else f"NOT equivalent ({len(self.mismatched)} mismatches)"
        tol = "exact" if self.rtol == 0 and self.atol == 0 else f"rtol={self.rtol}, atol={self.atol}"
        lines = [f"remat equivalence check: {head}; {len(self.max_abs_diff)} tensors compared ({tol}), "
                 f"{len(self.checkpointed)} checkpointed units"]
        for name, d in self.worst():
            flag = "  <-- differs" if name in self.mismatched else ""
            lines.append(f"  {name:<48} max |diff| = {d:.3e}{flag}")
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


def _prepare_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Fresh leaf copies; floating-point inputs require grad so their gradients are compared too."""
    def f(t):
        if isinstance(t, torch.Tensor):
            c = t.detach().clone()
            return c.requires_grad_(True) if c.is_floating_point() else c
        return t
    return tree_map(f, args), tree_map(f, kwargs)


def _run(model: nn.Module, args, kwargs, loss_fn: LossFn, seed: int, device: torch.device):
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        a, k = _prepare_inputs(args, kwargs)
        new_step()
        out = model(*a, **k)
        loss = loss_fn(out)
        with outside_autocast():
            loss.backward()
    ins = [t for t in tree_flatten((a, k))[0] if isinstance(t, torch.Tensor)]
    return loss.detach(), out, ins


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


def check_equivalence(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    reference: nn.Module | None = None,
    seed: int = 0,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> EquivalenceReport:
    """Run one training step (forward, loss, backward) of a plain copy and of the checkpointed
    model with the same seed and inputs, and compare loss, outputs, every parameter gradient by
    name, input gradients and buffers. Exact by default (``rtol=atol=0``).

    ``model`` is not modified (both runs use deep copies); ``reference`` is the plain model to
    compare against (default: a copy of ``model`` with remat's checkpointing removed).
    """
    loss_fn = loss_fn or default_loss
    args, kwargs = split_inputs(example_inputs)
    device = model_device(model)
    ckpt = copy.deepcopy(model)
    plain = copy.deepcopy(reference if reference is not None else model)
    remove_checkpointing(plain)
    for m in (ckpt, plain):
        m.zero_grad(set_to_none=True)
    loss_p, out_p, in_p = _run(plain, args, kwargs, loss_fn, seed, device)
    loss_c, out_c, in_c = _run(ckpt, args, kwargs, loss_fn, seed, device)
    diffs: dict[str, float] = {}
    bad: list[str] = []
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

    cmp("loss", loss_p, loss_c)
    op = [t for t in tree_flatten(out_p)[0] if isinstance(t, torch.Tensor)]
    oc = [t for t in tree_flatten(out_c)[0] if isinstance(t, torch.Tensor)]
    if len(op) != len(oc):
        problems.append(f"outputs differ in structure: {len(op)} vs {len(oc)} tensors")
    for i, (x, y) in enumerate(zip(op, oc)):
        cmp(f"output[{i}]", x, y)
    pp, pc = dict(plain.named_parameters()), dict(ckpt.named_parameters())
    if pp.keys() != pc.keys():
        problems.append("parameter names differ between the plain and the checkpointed model")
    for name in pp.keys() & pc.keys():
        cmp(f"grad:{name}", pp[name].grad, pc[name].grad)
    for i, (x, y) in enumerate(zip(in_p, in_c)):
        cmp(f"input_grad[{i}]", x.grad, y.grad)
    bp, bc = dict(plain.named_buffers()), dict(ckpt.named_buffers())
    for name in bp.keys() & bc.keys():
        cmp(f"buffer:{name}", bp[name], bc[name])
    return EquivalenceReport(diffs, tuple(sorted(set(bad))), tuple(checkpointed_modules(model)), rtol, atol,
                             tuple(problems))


def assert_equivalent(model: nn.Module, example_inputs: Any, **kwargs: Any) -> EquivalenceReport:
    """:func:`check_equivalence`, raising :class:`EquivalenceError` with the report when it fails."""
    report = check_equivalence(model, example_inputs, **kwargs)
    if not report.equal:
        raise EquivalenceError(
            str(report) + "\nRe-run with rtol/atol to allow for nondeterministic kernels, or compare "
            "report.max_abs_diff per tensor for detail."
        )
    return report


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, args: tuple, kwargs: dict,
               loss_fn: LossFn, output_alive: bool = True) -> None:
    """One training step as a loop runs it: forward and loss (under the caller's autocast state),
    backward outside autocast (Note [Autocast]), optimizer step, gradients set to None. With
    ``output_alive`` the output stays referenced until the step ends, as in ``out = model(x); loss =
    crit(out, y); ...``; without, it is dropped once the loss is computed (Note [Loop style])."""
    new_step()
    out = model(*args, **kwargs)
    loss = loss_fn(out)
    if not output_alive:
        out = None
    with outside_autocast():
        loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)


@keeps_rng
def measure_step(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    warmup: int = 1,
    repeats: int = 3,
    measure_memory: bool = True,
    output_alive: bool = True,
) -> StepMeasurement:
    """Measured peak memory (whole step) and median step time of real training steps of ``model``.
    ``output_alive``: whether the loop keeps the output until the step ends (Note [Loop style]).

    Trains a deep copy (``model`` is not modified) with ``optimizer_factory(params)`` (None: no
    optimizer step). Steps zero the gradients with ``set_to_none=True`` after the optimizer step,
    as a training loop does, so every measured step starts without gradients.
    """
    loss_fn = loss_fn or default_loss
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    opt = optimizer_factory(m.parameters()) if optimizer_factory else None
    args, kwargs = split_inputs(example_inputs)
    device = model_device(m)

    def step():
        train_step(m, opt, args, kwargs, loss_fn, output_alive)

    def state():
        yield from m.parameters()
        yield from m.buffers()
        if opt is not None:
            for st in opt.state.values():
                yield from (t for t in st.values() if isinstance(t, torch.Tensor))
        yield from (t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))

    return measure_training_step(m, step, device=device, state_tensors=state, warmup=warmup, repeats=repeats,
                                 measure_memory=measure_memory)


@keeps_rng
def warm_up(
    model: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    seconds: float = 3.0,
    max_steps: int = 50,
) -> int:
    """Run training steps on a deep copy of ``model`` until three consecutive step times agree within
    5%, ``seconds`` pass or ``max_steps`` run (see Note [Warm-up] in remat.report). Returns the steps run."""
    loss_fn = loss_fn or default_loss
    m = copy.deepcopy(model)
    opt = optimizer_factory(m.parameters()) if optimizer_factory else None
    args, kwargs = split_inputs(example_inputs)
    device = model_device(m)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_steps and time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        train_step(m, opt, args, kwargs, loss_fn)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        last = times[-3:]
        if len(times) >= 5 and max(last) <= 1.05 * min(last):
            break
    return len(times)


@keeps_rng
def time_interleaved(
    model: nn.Module,
    example_inputs: Any,
    plans: list,
    *,
    loss_fn: LossFn | None = None,
    optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    warmup: int = 2,
    rounds: int = 10,
    seed: int = 0,
    output_alive: bool = True,
) -> list[list[float]]:
    """Step times (seconds) of ``model`` under each plan, timed round-robin: every round runs one
    training step of every plan, in a shuffled order, each plan on its own deep copy with its own
    optimizer. ``model`` itself is not modified. Returns one list of ``rounds`` times per plan."""
    import random

    from remat.api import apply_plan, model_signature

    loss_fn = loss_fn or default_loss
    args, kwargs = split_inputs(example_inputs)
    device = model_device(model)
    copies = []
    for plan in plans:
        m = copy.deepcopy(model)
        remove_checkpointing(m)
        apply_plan(m, dataclasses.replace(plan, model_signature=model_signature(m)))
        m.zero_grad(set_to_none=True)
        copies.append((m, optimizer_factory(m.parameters()) if optimizer_factory else None))

    def step(m, opt) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        train_step(m, opt, args, kwargs, loss_fn, output_alive)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    for _ in range(warmup):
        for m, opt in copies:
            step(m, opt)
    times: list[list[float]] = [[] for _ in copies]
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(range(len(copies)))
        rng.shuffle(order)
        for i in order:
            times[i].append(step(*copies[i]))
    return times
