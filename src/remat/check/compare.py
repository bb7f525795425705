"""Two training steps taken and compared: the tolerances, the report and the comparison.

In: two steps, each taken by :func:`_take` (one seeded training step of a module's forward, maybe compiled: its
loss, outputs, input gradients, parameter gradients by name and buffers, copied), and the tolerances
(:func:`_tolerance`: exact for eager steps, Note [Compiled tolerance] for compiled ones). Out: an
:class:`EquivalenceReport` (:func:`compare_steps`). Used by :mod:`remat.check.verify` and
:mod:`remat.check.compiled`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from remat._compat import tree_flatten
from remat.runtime.compiled import CompiledLoop
from remat.runtime.measure import LossFn
from remat.check.slope import SlopeCheck, _run


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


def _tolerance(loop: CompiledLoop | None, rtol: float | None, atol: float | None) -> tuple[float, float]:
    """The tolerances given, else exact for an eager step and Note [Compiled tolerance]'s for a compiled one."""
    return (rtol if rtol is not None else 0.0 if loop is None else COMPILED_RTOL,
            atol if atol is not None else 0.0 if loop is None else COMPILED_ATOL)


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
