"""Planning for a compiled step (Note [Compiled steps] in remat.solve.calibrated): the calibration and the
check loop on synthetic profiles, with a stand-in for the compiled step's meter. No torch, milliseconds."""

from __future__ import annotations

import pytest

from remat.errors import InfeasibleBudgetError
from remat.solve import UNDER_COMPILE, Planner
from remat.solve.calibrated import PeakCalibration, plan_compiled
from remat.solve.synthetic import random_chain_profile

MiB = 2**20


def test_calibration_interpolates_between_measured_plans_and_keeps_the_offset_outside():
    cal = PeakCalibration(((100, 130), (200, 190), (300, 250)))
    assert cal.predict(150) == 160 and cal.predict(250) == 220
    assert cal.predict(50) == 80 and cal.predict(400) == 350  # the nearest point's offset
    assert cal.eager_target(250) == 300 and cal.eager_target(260) == 310
    assert cal.eager_target(160) == 150  # on the first segment
    assert cal.eager_target(129) is None  # below every measured plan


def test_calibration_searches_from_the_top_when_the_compiled_peak_is_not_monotone():
    # a plan at eager 200 measured over a plan at eager 300 (compile's peak is not monotone in the plan)
    cal = PeakCalibration(((100, 120), (200, 260), (300, 250)))
    assert cal.eager_target(255) == 305  # past the last point, whose offset holds
    # 240: not on the segment 200-300 (both ends measured over it), on 100-200 where the line meets it
    assert cal.eager_target(240) == 185 and cal.predict(185) == 239
    assert PeakCalibration(((100, 120), (100, 140))).points == ((100, 140),)


class CompiledStand:
    """A compiled step that holds 1.3x the eager saved activations above the fixed memory, and counts the
    plans it measured."""

    def __init__(self, planner: Planner, factor: float = 1.3) -> None:
        self.planner, self.factor, self.measured = planner, factor, []

    def __call__(self, plan) -> int:
        self.measured.append(plan.checkpointed)
        fixed = self.planner.profile.fixed_bytes
        return fixed + int(self.factor * (self.planner.model.peak_bytes(plan.checkpointed) - fixed))


def planner() -> Planner:
    return Planner(random_chain_profile(8, seed=3), granularity="block")


def test_every_plan_measures_within_the_budget_and_is_predicted_before_it_is_measured():
    p = planner()
    meter = CompiledStand(p)
    lo = min(meter(p.least_memory()), meter(p.every_nth_block(1)))
    hi, every_c = meter(p.no_checkpointing()), meter(p.every_nth_block(1))
    meter.measured.clear()
    for f in (0.0, 0.2, 0.5, 0.8):
        budget = int(lo + f * (hi - lo))
        plan = plan_compiled(p, budget, meter, loop="stand-in")
        assert plan.checked_peak_bytes <= budget, (f, plan.checked_peak_bytes, budget)
        assert plan.checked_peak_bytes == meter(plan)
        assert plan.compiled == "stand-in"
        if budget >= every_c:
            # above every block's compiled peak the least-memory plan is not compiled: the least peak is the
            # eager prediction, and the plan says so
            assert plan.min_peak_bytes == p.min_peak_bytes and "least peak: the eager prediction" in plan.notes[-1]
        else:
            assert plan.min_peak_bytes == lo
        assert UNDER_COMPILE not in plan.notes and "planned for the compiled step" in plan.notes[-1]
        # the eager plan for this budget would measure over it: the compiled plan is a tighter one
        eager = p.plan_for_budget(budget)
        assert meter(eager) > budget or eager.checkpointed == plan.checkpointed


def test_the_compiled_prediction_comes_from_other_plans_measurements():
    """A stand-in whose compiled peak is linear in the eager one: the calibration through the anchors predicts
    any other plan exactly, before it is measured."""
    p = planner()
    meter = CompiledStand(p)
    lo, hi = meter(p.least_memory()), meter(p.no_checkpointing())
    plan = plan_compiled(p, (lo + hi) // 2, meter, loop="stand-in")
    assert plan.checkpointed not in {p.least_memory().checkpointed, (), p.every_nth_block(1).checkpointed}
    assert abs(plan.predicted_peak_bytes - plan.checked_peak_bytes) <= 0.005 * plan.checked_peak_bytes


def test_a_budget_the_compiled_step_meets_without_checkpointing_costs_one_compile():
    p = planner()
    meter = CompiledStand(p, factor=0.5)  # compiled code holds half: fits where eager would not
    budget = p.baseline_peak_bytes - 1
    plan = plan_compiled(p, budget, meter, loop="stand-in")
    assert plan.checkpointed == () and plan.solver_status == "fits" and meter.measured == [()]


def test_a_budget_below_the_least_compiled_peak_is_refused_with_it():
    p = planner()
    meter = CompiledStand(p)
    least = min(meter(p.least_memory()), meter(p.every_nth_block(1)))
    with pytest.raises(InfeasibleBudgetError, match="measured on compiled steps") as e:
        plan_compiled(p, least - 1, meter, loop="stand-in")
    assert e.value.min_feasible_bytes == least
    assert plan_compiled(p, least, meter, loop="stand-in").checked_peak_bytes == least


class CurvedStand(CompiledStand):
    """A compiled step whose peak bends below the line through the anchors (compiled code that saves less in
    the middle of the range than at its ends, as measured on the built-in GPT)."""

    def __call__(self, plan) -> int:
        self.measured.append(plan.checkpointed)
        fixed = self.planner.profile.fixed_bytes
        lo, hi = self.planner.min_peak_bytes - fixed, self.planner.baseline_peak_bytes - fixed
        x = (self.planner.model.peak_bytes(plan.checkpointed) - fixed - lo) / max(hi - lo, 1)
        return fixed + int(lo + (hi - lo) * x ** 1.5)


def test_slack_buys_a_cheaper_plan_and_the_compiles_are_bounded(monkeypatch):
    import remat.solve.calibrated as calibrated

    p = planner()
    meter = CurvedStand(p)
    lo, hi = meter(p.least_memory()), meter(p.no_checkpointing())
    budget = (lo + hi) // 2
    meter.measured.clear()
    plan = plan_compiled(p, budget, meter, loop="stand-in")
    assert plan.checked_peak_bytes <= budget
    assert len(meter.measured) <= 3 + calibrated.REFINE_STEPS
    # the first plan solved (no refinement) fits with slack: refining found a cheaper one that also fits
    monkeypatch.setattr(calibrated, "REFINE_STEPS", 1)
    first = plan_compiled(p, budget, CurvedStand(p), loop="stand-in")
    assert budget - first.checked_peak_bytes > calibrated.CLOSE_ENOUGH * budget
    assert plan.predicted_recompute_s < first.predicted_recompute_s


def test_above_every_blocks_compiled_peak_the_least_memory_plan_is_not_compiled():
    """Each compile is the cost of compiled planning: a budget between every block's compiled peak and no
    checkpointing needs neither the least-memory plan nor its promise (Note [Compiled steps])."""
    p = Planner(random_chain_profile(8, seed=3, nested=True), granularity="block")  # least below every block
    meter = CompiledStand(p)
    every, hi = meter(p.every_nth_block(1)), meter(p.no_checkpointing())
    assert meter(p.least_memory()) < every
    meter.measured.clear()
    plan_compiled(p, (every + hi) // 2, meter, loop="stand-in")
    assert p.least_memory().checkpointed not in meter.measured
    assert meter.measured[:2] == [(), p.every_nth_block(1).checkpointed]
    meter.measured.clear()
    plan_compiled(p, every - 1, meter, loop="stand-in")  # below it: the least-memory plan is the promise
    assert p.least_memory().checkpointed in meter.measured


class ProgramStand(CurvedStand):
    """A compiled step whose peak bends (as :class:`CurvedStand`) and whose compiled program says so: each reading
    carries the program's figure, the peak less a constant (what runs outside the compiled graphs), or, for one
    plan, ``off_by`` more than that."""

    def __init__(self, planner: Planner, odd: tuple[str, ...] = (), off_by: int = 0) -> None:
        super().__init__(planner)
        self.odd, self.off_by = odd, off_by

    def __call__(self, plan):
        from remat.solve.calibrated import CompiledReading

        peak = super().__call__(plan)
        return CompiledReading(peak, peak - 4096 + (self.off_by if plan.checkpointed == self.odd else 0))


def test_a_compiled_program_predicts_a_plan_without_its_own_measured_step():
    """Issue #22: where the compiled program can be read, a plan's prediction interpolates in the program's
    figure between the other plans measured (Note [Compiled programs]): exact where the program says what the
    step holds, though the peak is not linear in the eager one; and made without the plan's own measured
    step: a program reading off by 10 KiB for the returned plan moves its prediction, not its measured peak."""
    p = planner()
    lo, hi = CurvedStand(p)(p.least_memory()), CurvedStand(p)(p.no_checkpointing())
    budget = (lo + hi) // 2
    plan = plan_compiled(p, budget, ProgramStand(p), loop="stand-in")
    assert plan.checkpointed not in {p.least_memory().checkpointed, (), p.every_nth_block(1).checkpointed}
    assert plan.predicted_peak_bytes == plan.checked_peak_bytes
    assert "from its compiled program's allocations, calibrated on" in plan.notes[-1]
    # by the eager peak the same plan is predicted off the curve (the calibration cannot follow the bend)
    by_eager = plan_compiled(p, budget, CurvedStand(p), loop="stand-in")
    assert by_eager.checkpointed == plan.checkpointed and by_eager.predicted_peak_bytes != by_eager.checked_peak_bytes
    odd = plan_compiled(p, budget, ProgramStand(p, odd=plan.checkpointed, off_by=10240), loop="stand-in")
    assert odd.checked_peak_bytes == plan.checked_peak_bytes
    assert odd.predicted_peak_bytes == plan.checked_peak_bytes + 10240


def random_planner(random_units: int = 8) -> Planner:
    """:func:`planner` whose first ``random_units`` units run dropout (``UnitCost.draws_random``)."""
    import dataclasses

    profile = random_chain_profile(8, seed=3)
    units = tuple(dataclasses.replace(u, draws_random=i < random_units) for i, u in enumerate(profile.units))
    return Planner(dataclasses.replace(profile, units=units), granularity="block")


class TwoPrograms(CompiledStand):
    """A compiled step whose random operators' kept outputs cost ``kept`` bytes per checkpointed unit that draws
    random numbers (Note [Two programs per plan]); recomputed they cost nothing, and are proved where ``proves``
    says so (``proved``: the stand-in for the compiled comparison)."""

    def __init__(self, planner: Planner, kept: int, proves=lambda plan: True) -> None:
        super().__init__(planner)
        self.kept, self.proves, self.variants = kept, proves, []

    def __call__(self, plan) -> int:
        self.variants.append(plan.variant)
        random = sum(self.planner.profile.unit(u).draws_random for u in plan.checkpointed)
        return super().__call__(plan) + (self.kept * random if plan.compiled_random == "keep" else 0)

    def proved(self, plan) -> bool:
        assert plan.variant in self.variants, "a plan is proved by its own measured step"
        return self.proves(plan)


def test_recomputed_random_operators_lower_the_least_compiled_peak_where_proved():
    """Issue #48: every block kept measures over every block recomputed; recomputing is proved, so the least
    peak is the recomputing program's, a budget equal to it gets a plan, and every plan after the anchors is
    solved and measured recomputing (one more compile than keeping alone)."""
    p = random_planner()
    meter = TwoPrograms(p, kept=4 * MiB)
    recomputed = min(CompiledStand(p)(p.least_memory()), CompiledStand(p)(p.every_nth_block(1)))
    kept_least = min(meter(p.least_memory()), meter(p.every_nth_block(1)))
    assert recomputed < kept_least
    meter.variants.clear()
    plan = plan_compiled(p, recomputed, meter, loop="stand-in", proved=meter.proved)
    assert plan.checked_peak_bytes <= recomputed
    assert plan.compiled_random == "recompute" and "random operators recomputed" in plan.notes[-1]
    every = p.every_nth_block(1).checkpointed
    assert meter.variants[:3] == [((), "keep"), (every, "keep"), (every, "recompute")]
    assert all(r == "recompute" for units, r in meter.variants[3:])
    with pytest.raises(InfeasibleBudgetError) as e:
        plan_compiled(p, recomputed - 1, meter, loop="stand-in", proved=meter.proved)
    assert e.value.min_feasible_bytes == recomputed
    # where it cannot be proved (None: a distributed loop), nothing is recomputed and the budget is refused
    with pytest.raises(InfeasibleBudgetError) as e:
        plan_compiled(p, recomputed, TwoPrograms(p, kept=4 * MiB), loop="stand-in")
    assert e.value.min_feasible_bytes == kept_least


def test_recomputing_random_operators_is_refused_where_its_step_is_not_the_plain_compiled_steps():
    """The proof decides: a recomputing program that drew other numbers is not taken, though it measured less;
    the plan keeps random operators' outputs and says why and what recomputing measured."""
    p = random_planner()
    meter = TwoPrograms(p, kept=4 * MiB, proves=lambda plan: False)
    kept_least = min(meter(p.least_memory()), meter(p.every_nth_block(1)))
    plan = plan_compiled(p, kept_least, meter, loop="stand-in", proved=meter.proved)
    assert plan.compiled_random == "keep" and plan.min_peak_bytes == kept_least
    assert "drew other numbers than the plain compiled step" in plan.notes[-1], plan.notes
    assert "with them recomputed" in plan.notes[-1]


def test_a_later_recomputing_plan_not_proved_is_measured_again_keeping():
    """Every block's recomputing step is proved, a later plan's is not: that plan is measured again with random
    operators kept, the search keeps them from then on, and the plan returned is within the budget."""
    p = random_planner()
    every = p.every_nth_block(1).checkpointed
    meter = TwoPrograms(p, kept=MiB // 2, proves=lambda plan: plan.checkpointed == every)
    lo, hi = CompiledStand(p)(p.least_memory()), meter(p.no_checkpointing())
    budget = (lo + hi) // 2
    meter.variants.clear()
    plan = plan_compiled(p, budget, meter, loop="stand-in", proved=meter.proved)
    assert plan.checked_peak_bytes <= budget and plan.compiled_random == "keep"
    refused = [units for units, r in meter.variants if r == "recompute" and units != every]
    assert refused and all((units, "keep") in meter.variants for units in refused)


def test_units_without_random_operators_compile_once():
    """No unit draws random numbers: one program per plan, as before (no second compile of every block)."""
    p = random_planner(random_units=0)
    meter = TwoPrograms(p, kept=4 * MiB)
    plan_compiled(p, min(meter(p.least_memory()), meter(p.every_nth_block(1))), meter, loop="stand-in",
                  proved=meter.proved)
    assert all(r == "keep" for _, r in meter.variants)
