"""Prove it: the equivalence check (one plain and one checkpointed training step, compared exactly).

Measuring real steps (peak memory, step time) is ``remat.runtime.measure``'s.

In: a (maybe compiled) checkpointed model, example inputs, the loss function, optionally the plain reference.
Out: an ``EquivalenceReport`` (:func:`check_equivalence`), or :class:`EquivalenceError` (:func:`assert_equivalent`).
The parts: :mod:`remat.check.slope` (Note [Is the gradient its own loss's?] and the seeded steps),
:mod:`remat.check.compare` (steps taken and compared, Note [Compiled tolerance]) and :mod:`remat.check.compiled`
(Note [Compiled plans are proved]); import their names from them."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

from torch import nn

from remat._compat import uncompiled
from remat.runtime.compiled import CompiledLoop, compiled_loop
from remat.errors import EquivalenceError
from remat.runtime.measure import LossFn, default_loss, model_device, split_inputs
from remat.rewrite import checkpointed_modules, remove_checkpointing
from remat.check.slope import slope_check
from remat.check.compare import EquivalenceReport, _take, _tolerance, compare_steps


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


def _compiled_as(loop: CompiledLoop | None, module: nn.Module):
    """A context giving what runs ``module``'s forward: compiled as ``loop`` compiles it, or ``module``."""
    return loop.step(module) if loop is not None else contextlib.nullcontext(module)


def assert_equivalent(model: nn.Module, example_inputs: Any, **kwargs: Any) -> EquivalenceReport:
    """:func:`check_equivalence`, raising :class:`EquivalenceError` with the report when it fails."""
    report = check_equivalence(model, example_inputs, **kwargs)
    if not report.equal:
        raise EquivalenceError(
            str(report) + "\nRe-run with rtol/atol to allow for nondeterministic kernels, or compare "
            "report.max_abs_diff per tensor for detail."
        )
    return report
