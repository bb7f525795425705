"""Note [Compiled plans are proved]: the compiled-step comparison of a plan for a compiled loop.

In: the model (uncompiled), a plan, the inputs as the loop passes them, the loss function and the compiled loop
(``remat.runtime.compiled.CompiledLoop``); or, for :class:`CompiledComparison`, the compiled steps remat already
runs to measure each plan. Out: an ``EquivalenceReport`` (:mod:`remat.check.compare`) of the plan's compiled step
against the plain compiled step, with the slope check (:mod:`remat.check.slope`) where they differ; the model as
before. Used by ``remat.api`` before ``optimize_checkpointing`` returns a plan for a compiled loop."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from remat.runtime.compiled import CompiledLoop
from remat.runtime.measure import LossFn, model_device
from remat.solve.plan import Plan
from remat.rewrite import checkpoint_plan, remove_checkpointing
from remat.runtime.state import fresh_grads, preserved, restore
from remat.check.compare import EquivalenceReport, _Taken, _take, _tolerance, compare_steps
from remat.check.slope import slope_check


class CompiledComparison:
    """Note [Compiled plans are proved], without compiles of its own: remat compiles each plan it measures for a
    compiled loop (``remat.api.checked_reading``), and that step, seeded, is also the step compared. The plain
    step (no checkpointing, measured first) is kept; each later plan's step is compared with it as it runs and
    only the report is kept (no tensors)."""

    def __init__(self, loop: CompiledLoop, *, seed: int = 0) -> None:
        self.loop = loop
        self.seed = seed
        self.plain: _Taken | None = None
        #: the report of each plan compared, by ``Plan.variant``
        self.reports: dict[tuple[tuple[str, ...], str], EquivalenceReport] = {}

    def proved(self, plan: Plan) -> bool:
        """Whether ``plan``'s compiled step, run by :meth:`step`, equalled the plain compiled step."""
        report = self.reports.get(plan.variant)
        return report is not None and report.equal

    def step(self, variant: tuple[tuple[str, ...], str], call: Callable[..., Any], module: nn.Module, args: tuple,
             kwargs: dict, loss_fn: LossFn, *, output_alive: bool) -> None:
        """One training step of ``call`` (``module`` checkpointed as ``variant``, a ``Plan.variant``, compiled as the
        loop compiles it), seeded; kept (no checkpointing) or compared with the plain one. Leaves ``module``'s
        gradients set."""
        units = variant[0]
        taken = _take(call, module, args, kwargs, loss_fn, self.seed, model_device(module), input_grads=False,
                      output_alive=output_alive, host=True)
        if not units:
            self.plain = taken
        elif self.plain is not None:
            rtol, atol = _tolerance(self.loop, None, None)
            self.reports[variant] = compare_steps(self.plain, taken, rtol=rtol, atol=atol, checkpointed=units,
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
