"""Prove it: the equivalence check (one plain and one checkpointed training step, compared exactly).

Measuring real steps (peak memory, step time) is ``remat.measure``'s."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat._compat import tree_flatten, tree_map
from remat.errors import EquivalenceError
from remat.measure import LossFn, default_loss, input_tensors, model_device, run_step, split_inputs
from remat.rewrite import checkpointed_modules, remove_checkpointing


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
        step = run_step(model, a, k, loss_fn)
    return step.loss, step.output, input_tensors(a, k)


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
    #: the relative tolerance the comparison used
    rtol: float = 0.0,
    #: the absolute tolerance the comparison used
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
