"""The compiled step's peak as a function of the eager prediction or of the compiled program's allocations,
fitted on measured plans (no torch).

Note [Compiled steps]
~~~~~~~~~~~~~~~~~~~~~
Under ``torch.compile`` the step is another program: AOTAutograd's partitioner decides what the compiled
forward saves (it recomputes cheap pointwise operators of its own and saves what checkpointed regions
must not recompute), inductor fuses kernels and reuses buffers. On the built-in GPT (CPU) compiled peaks
were 0.87-1.23x remat's eager prediction, above it for plans that checkpoint much (the compiled backward
of a checkpointed block holds its recomputed region and the gradients at once) and below it for plans that
checkpoint little (fused kernels save less). The eager memory model cannot say this; a compiled step can.

So for a compiled loop remat measures compiled steps (the allocator on CUDA, the profiler's
allocator-level memory events on CPU, remat.runtime.compiled) and uses the eager simulator only to *order* plans:

* anchors are measured first: no checkpointing (a budget above its compiled peak needs no plan), "every
  block", and, for a budget below every block's compiled peak, the least-memory plan (the lower of the two
  is then the least peak remat promises, as in Note [Least peak is a promise] in remat.api; above it the
  least-memory plan is not compiled and the plan's least peak is the eager prediction, said in its notes);
* the ILP's targets are found by interpolating, in the plan's eager predicted peak, between the measured
  plans next to it (:class:`PeakCalibration`, piecewise linear; past the last point the offset of the
  nearest point);
* a plan's reported prediction is made without its own measured step: where inductor's programs for the
  step can be read (a whole model compiled as one forward and one backward graph: Note [Compiled programs] in
  remat.costs.compiled_memory; blocks compiled one by one, composed with the eager code between them: Note [Blocks
  compiled one by one] there), interpolating in what its compiled programs allocate, between the other plans
  measured with theirs; else in its eager peak, as the targets are. The eager peak orders plans but is not
  what the compiled step holds (on the conv net of tests/slow/test_inductor.py compiled whole, plans of eager
  peaks 1,437,512 and 1,568,576 bytes measured 1,361,872 and 1,362,000 compiled; the eager-peak interpolation
  was 11.5% under to 6.1% over there, the program's allocations -1.4% to +0.3%);
* the ILP is solved for the eager target whose calibrated compiled peak is the budget and the plan is
  measured compiled; its point joins the calibration, and while the last plan was over the budget, or
  within it with more than 2% to spare (a cheaper plan may fit), the target is solved again (at most
  REFINE_STEPS plans per budget). The cheapest plan measured within the budget is returned with its
  prediction (made without its own measured step) and its measured peak.

Every returned plan's compiled peak is measured; the cost is one compile per measured plan (counted in
the plan's notes). Reading a plan's programs costs nothing more where inductor finds them in its cache with
their sizes kept by remat; one cached without them is lowered again (remat.costs.compiled_memory).

Note [Two programs per plan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under compile a checkpointed unit that runs dropout has two programs: its random operators' outputs kept (Note
[Random operators under compile] in remat.rewrite: nothing drawn again, safe by construction) or recomputed, as
torch's own checkpoint has them (``run_and_save_rng_state`` in the forward, ``run_with_rng_state`` in the
backward). Which holds less is the compiler's business: on benchmarks/plans/compiled.py's GPT (4 x 128, dropout 0.1,
batch 8 x 128, AdamW) every block measured 37.44 MiB kept and 33.62 recomputed with ``fallback_random`` (where
``native_dropout`` is one kernel whose kept output is the dropped-out activation), 37.55 kept and 37.78 recomputed
with inductor's own random numbers (benchmarks/plans/compiled_least.py). Which one is exact is the program's too:
recomputed, the U-Net of tests/slow/test_compiled_dropout.py drew other masks than the plain compiled step with its
tests' units checkpointed (its dropout ran on the convolution's channels-last buffer), the GPT drew the same.
So both are candidates, and the proof decides: where the units of "every block" draw random
numbers, both of its programs are compiled and measured, and each compiled step is compared with the plain compiled
step as it is measured (Note [Compiled plans are proved] in remat.check.compiled: the same compile, nothing more);
the recomputing program is taken only where its step equals the plain compiled step (loss, outputs, gradients,
buffers) and it measured less. The search then solves and measures every later plan that way; a later plan whose
recomputing step is not proved is measured again with its random operators kept, and the search keeps them from
then on. Each plan says which program it is and what every block measured with the other (``Plan.compiled_random``
and its notes), and the proof's note names the random-number setting it was proved under (inductor's own or
``fallback_random``): another setting is another program, not proved. A loop that cannot be proved in one process
(distributed) keeps random operators' outputs, as before. Cost: one more compile per search where every block
draws random numbers.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from remat.errors import InternalError, InvalidInputError
from remat.solve.plan import Plan, fmt_bytes

if TYPE_CHECKING:
    from remat.solve import Planner

#: the note on every eager plan that checkpoints something (Note [Compiled steps]);
#: figures from benchmarks/plans/compiled.py (GPT, CPU)
UNDER_COMPILE = ("planned for the eager step: if your loop compiles the model, plan with compile=True (or a dict of "
                 "its torch.compile settings): compiled peaks were 0.87-1.23x the eager prediction on the built-in GPT")


@dataclass(frozen=True)
class PeakCalibration:
    """Measured compiled peaks of plans, against their eager predicted peaks (bytes)."""

    #: (eager predicted peak bytes, compiled measured peak bytes) of each measured plan, by eager peak
    points: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise InvalidInputError("a calibration needs at least one measured plan (points is empty)")
        merged: dict[int, int] = {}
        for eager, compiled in self.points:  # two plans with one eager peak: the larger compiled peak
            merged[eager] = max(compiled, merged.get(eager, compiled))
        object.__setattr__(self, "points", tuple(sorted(merged.items())))

    def predict(self, eager_bytes: int) -> int:
        """The compiled peak (bytes) of a plan whose eager predicted peak is ``eager_bytes``."""
        pts = self.points
        if eager_bytes <= pts[0][0]:
            return eager_bytes + pts[0][1] - pts[0][0]
        if eager_bytes >= pts[-1][0]:
            return eager_bytes + pts[-1][1] - pts[-1][0]
        for (e0, c0), (e1, c1) in zip(pts, pts[1:]):
            if e0 <= eager_bytes <= e1:
                return round(c0 + (c1 - c0) * (eager_bytes - e0) / (e1 - e0))
        raise InternalError(f"no segment of the calibration's points {pts} holds {eager_bytes}", stage="solve")

    def eager_target(self, budget_bytes: int) -> int | None:
        """The largest eager predicted peak (bytes) whose calibrated compiled peak is within ``budget_bytes``,
        searched from the top; None when no eager peak at or above the first point's fits."""
        pts = self.points
        last_e, last_c = pts[-1]
        if last_c <= budget_bytes:  # past the last point the offset is constant
            return last_e + (budget_bytes - last_c)
        for (e0, c0), (e1, c1) in reversed(list(zip(pts, pts[1:]))):
            if min(c0, c1) > budget_bytes:
                continue
            if c1 <= budget_bytes:
                return e1
            # c0 <= budget < c1: the point on the segment where the line meets the budget
            return e0 + (budget_bytes - c0) * (e1 - e0) // (c1 - c0)
        return None


@dataclass(frozen=True)
class CompiledReading:
    """One compiled step of a plan, measured (Note [Compiled steps])."""

    #: the step's measured peak (bytes)
    peak_bytes: int
    #: what the compiled program says of it, before it ran: the simulated rise of its forward and backward
    #: (``remat.costs.compiled_memory.step_program_bytes``, Note [Compiled programs]); None where not read
    program_bytes: int | None = None


#: Note [Compiled steps]: plans solved and measured per budget after the anchors, at most; a plan measured
#: within the budget with more than CLOSE_ENOUGH of it to spare is followed by a cheaper one solved for the
#: calibration refined by it
REFINE_STEPS = 4
CLOSE_ENOUGH = 0.02


Variant = tuple[tuple[str, ...], str]  # Plan.variant: its units, and what they do with random operators


def plan_compiled(planner: "Planner", budget_bytes: int, measure: Callable[[Plan], "int | CompiledReading"], *,
                  agree: Callable[[Plan], Plan] = lambda plan: plan, loop: str = "",
                  measured: dict[Variant, int] | None = None, programs: dict[Variant, int | None] | None = None,
                  proved: Callable[[Plan], bool] | None = None) -> Plan:
    """The least-recompute plan whose *compiled* step measures within ``budget_bytes`` (Note [Compiled
    steps]). ``measure(plan)``: one compiled step with ``plan`` (one compile), its measured peak (bytes) or a
    :class:`CompiledReading`; ``agree``: every rank's copy of rank 0's plan (distributed); ``loop``: how the
    loop compiles, for the notes; ``measured``, ``programs``: the compiled peaks and program readings of plans
    measured already, by ``Plan.variant`` (shared by several budgets, and filled in); ``proved(plan)``: whether the
    compiled step of a plan just measured computed what the plain compiled step computes, which lets random
    operators be recomputed (Note [Two programs per plan]; None: they are kept). Each returned plan has
    ``predicted_peak_bytes`` = its compiled prediction, made without its own measured step (for an anchor, its
    measured peak: it was measured to calibrate), ``checked_peak_bytes`` = its measured peak,
    ``min_peak_bytes`` = the least measured compiled peak (the eager prediction, said in the notes, where the
    least-memory plan was not compiled). Raises InfeasibleBudgetError below the least."""
    search = _CompiledSearch(planner, budget_bytes, measure, agree, loop, measured, programs, proved)
    fits = search.fits_without_checkpointing()
    if fits is not None:
        return fits
    anchors = search.anchors()
    best = search.refined()
    if best is not None:
        return search.done(best[0], best[1], "within the budget", best[2])
    every = anchors[0]
    best_anchor = min((p for p in anchors if search.check(p) <= budget_bytes), key=lambda p: p.predicted_recompute_s)
    which = "hand rule every block" if best_anchor.checkpointed == every.checkpointed else "least-memory plan"
    return search.done(best_anchor, search.check(best_anchor),
                       f"the {which} (measured to calibrate): the plans predicted cheaper measured over the budget")


class _CompiledSearch:
    """The state of one :func:`plan_compiled`: the plans measured compiled (shared across budgets), the anchors and
    the least peak, what random operators do (Note [Two programs per plan]), and its steps."""

    def __init__(self, planner: "Planner", budget_bytes: int, measure: Callable[[Plan], "int | CompiledReading"],
                 agree: Callable[[Plan], Plan], loop: str, measured: dict[Variant, int] | None,
                 programs: dict[Variant, int | None] | None, proved: Callable[[Plan], bool] | None) -> None:
        self.planner, self.budget_bytes, self.measure, self.agree, self.loop = planner, budget_bytes, measure, agree, loop
        self.proved = proved
        self.t0 = time.perf_counter()
        self.measured = {} if measured is None else measured
        self.programs = {} if programs is None else programs
        self.before = len(self.measured)
        self.least_note = ""  # set where the least peak reported is not measured compiled
        self.least = planner.min_peak_bytes
        self.least_measured = False  # the least peak measured compiled, not the eager prediction
        self.none = agree(planner.no_checkpointing())
        #: what the plans solved from now on do with random operators (Note [Two programs per plan])
        self.random = "keep"
        #: every block's two programs, measured: (kept, recomputed, recomputed proved); None where not both run
        self.every_block: tuple[int, int, bool] | None = None
        #: plans whose recomputed random operators were not proved (measured again with them kept)
        self.refused: list[Plan] = []

    def check(self, plan: Plan) -> int:
        measured = self.measured
        if plan.variant not in measured:
            reading = self.measure(plan)
            reading = reading if isinstance(reading, CompiledReading) else CompiledReading(reading)
            measured[plan.variant], self.programs[plan.variant] = reading.peak_bytes, reading.program_bytes
        return measured[plan.variant]

    def variant(self, plan: Plan) -> Plan:
        """``plan`` with random operators as this search has them now (kept where its units draw none)."""
        if self.random == "recompute" and self.planner.draws_random(plan.checkpointed):
            return dataclasses.replace(plan, compiled_random="recompute")
        return plan

    def proven(self, plan: Plan) -> Plan:
        """``plan`` measured; where it recomputes random operators and its step was not proved, its other program
        (random operators kept), measured, and the search keeps them from now on."""
        self.check(plan)
        if plan.compiled_random != "recompute" or self.proved is None or self.proved(plan):
            return plan
        self.refused.append(plan)
        self.random = "keep"
        kept = dataclasses.replace(plan, compiled_random="keep")
        self.check(kept)
        return kept

    def predict(self, plan: Plan, calibration: "PeakCalibration") -> tuple[int, str]:
        """The plan's compiled peak as predicted without its own measured step, and how: from its compiled
        program, calibrated on the other plans measured with theirs (Note [Compiled programs] in
        remat.costs.compiled_memory), else from its eager peak, calibrated on the plans measured so far."""
        programs, measured = self.programs, self.measured
        own = programs.get(plan.variant)
        others = tuple((programs[v], peak) for v, peak in measured.items()
                       if v != plan.variant and programs.get(v) is not None)
        if own is not None and others:
            return PeakCalibration(others).predict(own), (
                f"from its compiled program's allocations, calibrated on {len(others)} other measured plans")
        return calibration.predict(plan.predicted_peak_bytes), "from its eager peak, calibrated on the plans measured"

    def done(self, plan: Plan, predicted: int, why: str, how: str = "measured to calibrate") -> Plan:
        peak = self.check(plan)
        compiles = len(self.measured) - self.before
        note = (f"planned for the compiled step ({self.loop}){self.least_note}: compiled peak predicted "
                f"{fmt_bytes(predicted)} ({how}), "
                f"measured {fmt_bytes(peak)} on a compiled step, {why}; {compiles} plan{'' if compiles == 1 else 's'} "
                f"compiled and measured in {time.perf_counter() - self.t0:.1f} s (Note [Compiled steps] in "
                "remat.solve.calibrated)")
        random = self.random_note(plan)
        return dataclasses.replace(
            plan, budget_bytes=self.budget_bytes, predicted_peak_bytes=predicted, checked_peak_bytes=peak,
            baseline_peak_bytes=self.check(self.none), min_peak_bytes=self.least, min_peak_checked=self.least_measured,
            compiled=self.loop,
            notes=tuple(n for n in plan.notes if n != UNDER_COMPILE) + (note,) + ((random,) if random else ()))

    def random_note(self, plan: Plan) -> str:
        """What the plan does with random operators and what the other program measured (Note [Two programs per
        plan]); "" where its units draw none."""
        if not self.planner.draws_random(plan.checkpointed):
            return ""
        where = " (Note [Two programs per plan] in remat.solve.calibrated)"
        if self.every_block is None:
            return ("random operators' outputs kept in the checkpointed units (Note [Random operators under compile] "
                    "in remat.rewrite): " + ("recomputing them was not tried (no proof on compiled steps here: a "
                                             "distributed loop)" if self.proved is None else
                                             "every block's program with them recomputed was not measured") + where)
        kept, again, ok = self.every_block
        figures = f"every block measured {fmt_bytes(kept)} with them kept, {fmt_bytes(again)} with them recomputed"
        if plan.compiled_random == "recompute":
            return ("random operators recomputed in the checkpointed units, as torch's checkpoint does: this plan's "
                    f"compiled step computed the plain compiled step's loss and gradients with them so ({figures})"
                    + where)
        if not ok:
            why = "recomputing them drew other numbers than the plain compiled step" + (
                "" if again < kept else ", and measured no less")
        elif self.refused:
            why = (f"recomputing them drew other numbers than the plain compiled step in {len(self.refused)} plan"
                   f"{'' if len(self.refused) == 1 else 's'} solved for this budget")
        else:
            why = "recomputing them measured no less"
        return f"random operators' outputs kept in the checkpointed units: {why} ({figures})" + where

    def fits_without_checkpointing(self) -> Plan | None:
        """The plan without checkpointing, where its compiled step fits the budget (the anchors are not needed:
        the least peak stays the eager prediction); None otherwise."""
        none = self.none
        if self.check(none) > self.budget_bytes:
            return None
        return self.done(dataclasses.replace(
            none, strategy="ilp" if self.planner.granularity == "block" else "ilp-op", solver_status="fits",
            notes=("the compiled step fits the budget without checkpointing (least peak: the eager prediction, "
                   "not measured compiled)",)), self.check(none), "within the budget (measured: no checkpointing)")

    def every_block_anchor(self) -> Plan:
        """Every block checkpointed, measured compiled; where its units draw random numbers and plans can be
        proved, both of its programs, and the search recomputes random operators from now on where that was proved
        and measured less (Note [Two programs per plan])."""
        every = self.agree(self.planner.every_nth_block(1))
        if self.proved is None or not self.planner.draws_random(every.checkpointed):
            return every
        again = dataclasses.replace(every, compiled_random="recompute")
        kept_peak, again_peak = self.check(every), self.check(again)
        ok = self.proved(again)
        self.every_block = (kept_peak, again_peak, ok)
        if ok and again_peak < kept_peak:
            self.random = "recompute"
            return again
        return every

    def anchors(self) -> list[Plan]:
        """Every block checkpointed, and the least-memory plan where the budget needs it, measured compiled; the
        least peak set (raises InfeasibleBudgetError below the least measured)."""
        planner, budget_bytes = self.planner, self.budget_bytes
        every = self.every_block_anchor()
        anchors = [every]
        least_plan = self.variant(self.agree(planner.least_memory()))
        if budget_bytes < self.check(every) or least_plan.variant in self.measured:
            # the least-memory plan is measured only where the budget is below every block's compiled peak (or it
            # was measured already): above it, the interpolation between every block and no checkpointing serves
            anchors.append(self.proven(least_plan))
            self.least, self.least_measured = min(self.check(p) for p in anchors), True
            if budget_bytes < self.least:
                raise planner.infeasible(budget_bytes, least_bytes=self.least, compiled=self.loop)
        else:  # a promise remat did not measure: the least peak is the eager prediction, and the plan says so
            self.least = planner.min_peak_bytes
            self.least_note = (" (least peak: the eager prediction, the least-memory plan not compiled: the budget is "
                               "above every block's compiled peak)")
        return anchors

    def calibration(self) -> PeakCalibration:
        """Eager against compiled peaks of the plans measured so far with random operators as the search has them
        now (those of earlier budgets too, when ``measured`` is shared)."""
        planner = self.planner
        return PeakCalibration(tuple(
            (planner.model.peak_bytes(units), peak) for (units, random), peak in self.measured.items()
            if random == self.random or not planner.draws_random(units)))

    def refined(self) -> tuple[Plan, int, str] | None:
        """The cheapest plan measured within the budget while the calibration of eager against compiled peaks is
        refined (at most REFINE_STEPS compiles), with its prediction and how it was made; None when none fits."""
        planner, budget_bytes, measured = self.planner, self.budget_bytes, self.measured
        calibration = self.calibration()
        best: tuple[Plan, int, str] | None = None  # the cheapest plan measured within the budget, its prediction
        target = None
        for _ in range(REFINE_STEPS):
            new_target = calibration.eager_target(budget_bytes)
            if new_target is None or new_target == target or new_target < planner.min_peak_bytes:
                break
            target = new_target
            plan = self.variant(self.agree(planner.plan_for_budget(target)))
            seen = plan.variant in measured
            plan = self.proven(plan)
            peak = self.check(plan)
            predicted, how = self.predict(plan, calibration)
            if peak <= budget_bytes and (best is None or plan.predicted_recompute_s < best[0].predicted_recompute_s):
                best = (plan, predicted, how)
            if seen or (peak <= budget_bytes and budget_bytes - peak <= CLOSE_ENOUGH * budget_bytes):
                break  # nothing new to learn, or too little slack left to buy a cheaper plan with
            calibration = self.calibration()  # with this plan's point (of the program the search now measures)
        return best
