"""Compiled plans, after they are checked: the largest reading over ranks, and the plan proved against the plain
compiled step (Note [Compiled plans are proved] in remat.check.compiled).

In: the plan, the model, its inputs and the compiled loop. Out: the plan's note, or EquivalenceError.
"""

from __future__ import annotations

from torch import nn

from remat._compat import random_numbers
from remat.check.compiled import CompiledComparison, check_compiled_plan
from remat.errors import EquivalenceError
from remat.runtime.compiled import CompiledLoop
from remat.runtime.distributed import Ranks
from remat.runtime.measure import LossFn
from remat.solve.calibrated import CompiledReading
from remat.solve.plan import Plan


def proved_compiled(model: nn.Module, plan: Plan, args: tuple, kwargs: dict, loss_fn: LossFn, loop: CompiledLoop,
                    compare: CompiledComparison | None) -> str:
    """Note [Compiled plans are proved] in remat.check.compiled: the plan's compiled step against the plain compiled
    step (as compared while the plan was measured, where it was and agreed; else compiled again here); the
    plan's note on success, EquivalenceError where they differ. ``compare`` None: a distributed loop."""
    if compare is None:
        return ("the compiled planned step was not compared with the plain compiled step (a distributed loop: "
                "Note [Compiled plans are proved] in remat.check.compiled runs in one process)")
    if not plan.checkpointed:
        return "nothing checkpointed: the compiled step is the plain compiled step"
    report = compare.reports.get(plan.variant)
    if report is None or not report.equal:  # (the slope check needs the planned step's gradients: run it again)
        report = check_compiled_plan(model, plan, args, kwargs, loss_fn, loop)
    if report.equal:
        name, diff = report.worst(1)[0] if report.max_abs_diff else ("", 0.0)
        return (f"proved on one compiled step: loss, outputs, gradients and buffers equal the plain compiled "
                f"step's within rtol {report.rtol:g} ({len(report.max_abs_diff)} tensors; largest difference "
                f"{diff:.2e}, {name}), with {random_numbers()}: another setting compiles other programs, not proved "
                "(Note [Compiled plans are proved] in remat.check.compiled)")
    own = report.slope is not None and report.slope.consistent
    alike = check_compiled_plan(model, plan, args, kwargs, loss_fn, loop, deterministic=True) if own else None
    if alike is not None and alike.equal:
        return (f"proved on compiled steps: with every module in eval mode the planned step equals the plain "
                f"compiled step (rtol {alike.rtol:g}, {len(alike.max_abs_diff)} tensors); in training it draws "
                f"other random numbers than the plain compiled step (inductor orders the two programs' random "
                f"kernels as it schedules each; loss {float(report.max_abs_diff.get('loss', 0.0)):.2e} apart), and "
                f"{report.slope} (Note [Compiled plans are proved] in remat.check.compiled)")
    raise EquivalenceError(
        f"{report if alike is None else alike}\nUnder {loop}, the planned step does not compute what the plain "
        f"compiled step computes (checkpointed: {list(plan.checkpointed)}"
        f"{'' if alike is None else ', compared with every module in eval mode'}); the model is as it was. " + (
            "Its gradient is not its own loss's: do not train with this plan. " if not own else "") +
        "Plan the eager step with compile=False, and report this with the printout (Note [Compiled plans are "
        "proved] in remat.check.compiled).")


def ranks_reading(ranks: Ranks | None, reading: CompiledReading) -> CompiledReading:
    """The largest reading over ranks (a program read on some ranks only: none)."""
    if ranks is None:
        return reading
    readings = ranks.gather((reading.peak_bytes, reading.program_bytes))
    programs = [program for _, program in readings]
    return CompiledReading(max(peak for peak, _ in readings), None if None in programs else max(programs))
