"""One max_batch search (Note [Max batch] in remat.sweeps.sizing), and what it reports.

In: a plain model (uncompiled, no checkpointing), a budget in bytes, ``sized(n)`` giving the batch of size ``n``
with its loss function, the optimizer whose state counts, the strategy ("ilp" or a hand rule), the granularity,
the size step and bound, and the sizes to profile for real. Out: a :class:`BatchSizeReport` (the largest and the
fastest size with their plans, one :class:`SizeRow` per size tried), from :meth:`_Search.run`; the model's state
is the caller's to keep (:func:`remat.sweeps.sizing.max_batch_of` runs the search under ``preserved``)."""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from remat.api import peak_with_plan, plan_checked, stage
from remat.api.hand_rules import faster_of, timing_off
from remat.api.margins import rules_to_time
from remat.api.source import profile_step
from remat.capture import ModelGraph, capture
from remat.costs.unit_costs import Profile, is_selective
from remat.errors import InfeasibleBudgetError, InvalidInputError, RematError, UnsupportedError
from remat.costs.extrapolate import ProfileFit
from remat.runtime.measure import LossFn, model_device, split_inputs
from remat.solve.plan import GiB, Plan, fmt_bytes
from remat.solve import Planner
from remat.check.steps import time_plans_in_place

#: max_batch's logger (the search logs the sizes that cannot run under the name it had in remat.sweeps.sizing)
log = logging.getLogger("remat.sweeps.sizing")


@dataclass(frozen=True)
class SizeRow:
    """One size tried. Samples per second are ``size / step time`` (for ``dim="seq"``: positions per second
    per sequence of the batch)."""

    #: the batch size (or sequence length, for dim="seq") of this row
    size: int
    #: its plan fits the budget (measured when ``measured_peak_bytes`` is set, else predicted)
    fits: bool
    #: the plan for this size (None when nothing fits)
    plan: Plan | None
    #: the least peak any plan reaches at this size (bytes): measured on real steps where ``least_peak_measured``,
    #: else predicted (Note [Least peak is a promise] in remat.api.checking)
    least_peak_bytes: int
    #: the plan's peak, measured on one real step (optimizer predicted); None when not run
    measured_peak_bytes: int | None = None
    #: size / the plan's predicted step time
    predicted_samples_per_s: float | None = None
    #: from the median of timed real steps (forward and backward; the optimizer step as profiled)
    measured_samples_per_s: float | None = None
    #: "profiled" (real profile at this size) or "fitted" (Note [Profiles by size])
    source: str = "fitted"
    #: why a size could not be tried (make_batch failed, max_size), or ""
    why: str = ""
    #: ``least_peak_bytes`` was measured on real steps (else predicted)
    least_peak_measured: bool = False

    @property
    def predicted_peak_bytes(self) -> int | None:
        return None if self.plan is None else self.plan.predicted_peak_bytes


@dataclass(frozen=True)
class BatchSizeReport:
    """What :func:`max_batch` found. ``max_plan``/``best_plan`` are ready for ``remat.apply_plan``."""

    #: "batch" or "seq": the size that was grown
    dim: str
    #: the budget searched under (bytes)
    budget_bytes: int
    #: "ilp" (remat's plans), "every_block" or "none" (a hand rule at every size)
    strategy: str
    #: the largest size whose plan fits, confirmed on a real step
    max_size: int
    #: the plan at max_size (apply it with remat.apply_plan on a model of that size)
    max_plan: Plan
    #: the size with the most measured samples per second among those timed
    best_size: int
    #: the plan at best_size
    best_plan: Plan
    #: every size tried, smallest first
    rows: tuple[SizeRow, ...]
    #: how the search went (sizes fitted, refused, checked)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def row(self, size: int) -> SizeRow:
        return next(r for r in self.rows if r.size == size)

    def __str__(self) -> str:
        unit = "samples/s" if self.dim == "batch" else "positions/s"
        lines = [f"remat max_batch ({self.strategy}, {self.dim}): budget {fmt_bytes(self.budget_bytes)}; largest "
                 f"{self.dim} that fits: {self.max_size}; fastest: {self.best_size}",
                 f"  {'size':>6}  {'fits':<5} {'units':>5} {'predicted peak':>15} {'measured peak':>14} "
                 f"{'least peak':>13} {'pred ' + unit:>15} {'meas ' + unit:>15}  source"]
        for r in self.rows:
            def num(v):
                return "-" if v is None else f"{v:,.1f}"
            lines.append(
                f"  {r.size:>6}  {'yes' if r.fits else 'no':<5} {'-' if r.plan is None else len(r.plan.checkpointed):>5} "
                f"{fmt_bytes(r.predicted_peak_bytes):>15} {fmt_bytes(r.measured_peak_bytes):>14} "
                f"{(fmt_bytes(r.least_peak_bytes) if r.least_peak_bytes else '-') + (' m' if r.least_peak_measured else ''):>13} "
                f"{num(r.predicted_samples_per_s):>15} "
                f"{num(r.measured_samples_per_s):>15}  {r.source}{'; ' + r.why if r.why else ''}")
        lines.append("  least peak: the least any plan reaches at that size; m: measured on real steps, else predicted")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


SizedBatch = Callable[[int], tuple[Any, LossFn]]


class _Search:
    """One max_batch search: profiles, planners and real checks by size, each made at most once."""

    def __init__(self, model: nn.Module, budget_bytes: int, sized: SizedBatch, *, optimizer, dim: str,
                 strategy: str, granularity: str, output_alive: bool, time_limit_s: float | None, step: int,
                 max_size: int, profiles: dict[int, Profile] | None = None) -> None:
        self.model, self.budget_bytes, self.sized = model, budget_bytes, sized
        self.optimizer, self.dim, self.strategy, self.granularity = optimizer, dim, strategy, granularity
        self.output_alive, self.time_limit_s, self.step, self.max_size = output_alive, time_limit_s, step, max_size
        self.device = model_device(model)
        self.graph: ModelGraph | None = None
        self.profiles: dict[int, Profile] = {} if profiles is None else profiles
        self.planners: dict[int, Planner] = {}
        #: size -> (plan that fits or None, least peak bytes), from real steps
        self.checked: dict[int, tuple[Plan | None, int]] = {}
        #: size -> why it cannot be run at all
        self.broken: dict[int, str] = {}
        self.fit: ProfileFit | None = None
        self.notes: list[str] = []

    # -- profiles and plans -----------------------------------------------------------------------
    def batch(self, n: int) -> tuple[tuple, dict, LossFn]:
        inputs, loss_fn = self.sized(n)
        args, kwargs = split_inputs(inputs)
        return args, kwargs, loss_fn

    def profile(self, n: int) -> Profile:
        if n not in self.profiles:
            args, kwargs, loss_fn = self.batch(n)
            if self.graph is None:  # one capture for every size: the units do not depend on the batch
                with stage("profile", self.model, args, kwargs, loss_fn):
                    self.graph = capture(self.model, args, kwargs)
            self.profiles[n] = profile_step(self.model, args, kwargs, loss_fn=loss_fn, optimizer=self.optimizer,
                                             device=self.device, output_alive=self.output_alive, graph=self.graph)
        return self.profiles[n]

    def planner(self, n: int) -> Planner:
        if n not in self.planners:
            real = n in self.profiles or self.fit is None
            profile = self.profile(n) if real else self.fit.at(n)
            self.planners[n] = Planner(profile, granularity=self.granularity, time_limit_s=self.time_limit_s)
        return self.planners[n]

    def predicted(self, n: int) -> Plan | None:
        """The plan for size ``n`` predicted within the budget, or None."""
        pl = self.planner(n)
        if self.strategy == "ilp":
            try:
                return pl.plan_for_budget(self.budget_bytes)
            except InfeasibleBudgetError:
                return None
        plan = self.rule(pl)
        return plan if plan.predicted_peak_bytes <= self.budget_bytes else None

    def rule(self, pl: Planner) -> Plan:
        """The hand rule's plan (strategies other than "ilp")."""
        return pl.every_nth_block(1) if self.strategy == "every_block" else pl.no_checkpointing()

    def least(self, n: int) -> int:
        """The least peak predicted at size ``n`` for this strategy (bytes)."""
        pl = self.planner(n)
        return pl.min_peak_bytes if self.strategy == "ilp" else self.rule(pl).predicted_peak_bytes

    def real(self, n: int) -> bool:
        """Whether size ``n`` fits, checked on real steps with a real profile (cached)."""
        if n in self.broken:
            return False
        if n not in self.checked:
            try:
                args, kwargs, loss_fn = self.batch(n)
                real = self.profile(n)
                if n in self.planners and self.planners[n].profile is not real:
                    del self.planners[n]  # planned on a fitted profile: plan again on the real one
                pl = self.planner(n)
            except RematError as e:
                if not isinstance(e, InvalidInputError):  # remat's own failure, not this size's
                    raise
                self.broken[n] = f"size {n} could not run: {str(e).splitlines()[0][:160]}"
                log.info(self.broken[n])
                return False
            except Exception as e:  # noqa: BLE001 - the user's make_batch or model refuses this size
                self.broken[n] = f"size {n} could not run: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                log.info(self.broken[n])
                return False
            if self.strategy == "ilp":
                try:
                    plan = plan_checked(self.model, args, kwargs, loss_fn, self.device, pl, self.budget_bytes)
                    self.checked[n] = (plan, plan.min_peak_bytes)
                except InfeasibleBudgetError as e:
                    self.checked[n] = (None, e.min_feasible_bytes)
            else:
                plan = self.rule(pl)
                peak = self.measure_peak(plan, n)
                self.checked[n] = (dataclasses.replace(plan, checked_peak_bytes=peak) if peak <= self.budget_bytes
                                   else None, peak)
        return self.checked[n][0] is not None

    def least_measured(self, n: int) -> bool:
        """Whether size ``n``'s least peak was measured: checked for real and, for a plan within the budget, its
        least checked with it (not where the budget was roomy: Note [Least peak is a promise] in remat.api.checking)."""
        if n not in self.checked:
            return False
        plan = self.checked[n][0]
        return plan is None or self.strategy != "ilp" or plan.min_peak_checked

    def measure_peak(self, plan: Plan, n: int) -> int:
        """Peak of one real step at size ``n`` with ``plan`` (optimizer as profiled)."""
        args, kwargs, loss_fn = self.batch(n)
        return peak_with_plan(self.model, plan, args, kwargs, loss_fn, self.device, self.planner(n).profile)

    # -- the search -------------------------------------------------------------------------------
    def _bisect(self, lo: int, hi: int, fits: Callable[[int], bool]) -> tuple[int, int]:
        """Neighbouring sizes (lo fits, hi does not), given that ``lo`` fits and ``hi`` does not."""
        while hi - lo > self.step:
            mid = (lo + hi) // 2 // self.step * self.step
            mid = min(max(mid, lo + self.step), hi - self.step)
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo, hi

    def _grow(self, lo: int, fits: Callable[[int], bool]) -> int:
        """The first size found not to fit, doubling the distance from ``lo`` (which fits)."""
        d = max(self.step, lo)
        while True:
            n = lo + d
            if n > self.max_size:
                self.broken.setdefault(n, f"above max_size={self.max_size}")
                return n
            if not fits(n):
                return n
            lo, d = n, d * 2

    def _fits_predicted(self, n: int) -> bool:
        return n not in self.broken and self.predicted(n) is not None

    def run(self, profile_sizes: tuple[int, ...], *, repeats: int) -> BatchSizeReport:
        for n in profile_sizes:
            self.profile(n)
        try:
            self.fit = ProfileFit({n: self.profiles[n] for n in profile_sizes})
            left_out = [u for u in self.fit.left_out if self.granularity == "op" or not is_selective(u)]
            if left_out:
                self.notes.append(f"{len(left_out)} units change structure between sizes and were left out "
                                  "of fitted profiles (kept in real ones), e.g. " + ", ".join(left_out[:3]))
            kind = "linear" if len(profile_sizes) == 2 else f"degree {len(profile_sizes) - 1}"
            self.notes.append(f"memory and time {kind} in the {self.dim} size, fitted from real profiles at sizes "
                              f"{list(profile_sizes)} (Note [Profiles by size] in remat.costs.extrapolate)")
        except UnsupportedError as e:
            self.notes.append(f"every size profiled for real: {e}")
        first = profile_sizes[0]
        if not self.real(first):
            least = self.checked.get(first, (None, 0))[1]
            raise InfeasibleBudgetError(
                f"even the smallest {self.dim} size profiled, {first}, does not fit budget "
                f"{fmt_bytes(self.budget_bytes)}: its least peak measured {fmt_bytes(least)}"
                f"{' (' + self.broken[first] + ')' if first in self.broken else ''}. Raise budget_gb to at least "
                f"{math.ceil(least / GiB * 1000) / 1000:.3f} or give smaller profile_sizes.",
                budget_bytes=self.budget_bytes, min_feasible_bytes=least)
        # 1. predicted: the largest size whose plan is predicted within the budget
        lo = max([n for n in profile_sizes if self._fits_predicted(n)], default=first)
        lo, _ = self._bisect(lo, self._grow(lo, self._fits_predicted), self._fits_predicted)
        predicted_max = lo
        # 2. real: the answer and the next size up, each on real steps
        if self.real(lo):
            hi = lo + self.step
            if hi <= self.max_size and self.real(hi):
                hi = self._grow(hi, self.real)
                lo, hi = self._bisect(max(n for n in self.checked if self.checked[n][0] and n < hi), hi, self.real)
        else:
            hi = lo
            lo = max(n for n, (plan, _) in self.checked.items() if plan is not None and n < hi)
            lo, hi = self._bisect(lo, hi, self.real)
        if predicted_max != lo:
            self.notes.append(f"predicted largest size {predicted_max}, real steps found {lo}")
        # 3. time one size per doubling and the answer
        ladder = sorted({*(first * 2**k for k in range(64) if first * 2**k < lo), lo})
        rows = [self._row(n, repeats) for n in ladder]
        refused = hi
        rows.append(SizeRow(refused, False, None, self.checked.get(refused, (None, 0))[1],
                            source="profiled" if refused in self.profiles else "fitted",
                            why=self.broken.get(refused, "its least measured peak is over the budget"),
                            least_peak_measured=self.least_measured(refused)))
        timed = [r for r in rows if r.fits and r.measured_samples_per_s is not None]
        best = max(timed, key=lambda r: r.measured_samples_per_s)
        top = next(r for r in rows if r.size == lo)
        return BatchSizeReport(self.dim, self.budget_bytes, self.strategy, lo, top.plan, best.size, best.plan,
                               tuple(rows), tuple(self.notes))

    def _row(self, n: int, repeats: int) -> SizeRow:
        """Size ``n``'s plan with its measured peak and samples per second; real checks where the fitted plan
        measures over the budget."""
        measured = self.least_measured(n)
        if n in self.checked:
            plan, least = self.checked[n]
        else:
            plan, least = self.predicted(n), self.least(n)
            if plan is not None:
                plan = dataclasses.replace(plan, checked_peak_bytes=self.measure_peak(plan, n))
                if plan.checked_peak_bytes > self.budget_bytes:
                    self.real(n)  # a size that cannot run at all stays without a plan
                    plan, least = self.checked.get(n, (None, least))
                    measured = self.least_measured(n)
        source = "profiled" if n in self.profiles else "fitted"
        if plan is None:
            return SizeRow(n, False, None, least, source=source, least_peak_measured=measured)
        plan, step_s = self._timed(plan, n, repeats)
        peak = plan.checked_peak_bytes
        profile = self.planner(n).profile
        return SizeRow(n, peak <= self.budget_bytes, plan, least, peak, n / plan.predicted_step_time_s,
                       n / (step_s + profile.optimizer_s), source, least_peak_measured=measured)

    def _timed(self, plan: Plan, n: int, repeats: int) -> tuple[Plan, float]:
        """The plan of size ``n``'s row and the median seconds of its real forward-and-backward steps, on the model
        itself (restored). An ILP plan is timed beside the hand rules the model cannot tell from it, measured within
        the budget, in the same interleaved rounds (Note [Plans timed beside the hand rules] in remat.api.hand_rules:
        the race is the row's own timing, not one per size tried), and the rule measured faster is the row's plan;
        the notes say so and what the rules' steps cost."""
        started = time.perf_counter()
        near = [] if self.strategy != "ilp" or timing_off() else rules_to_time(
            plan, self.budget_bytes, [self.planner(n).every_nth_block(1), self.planner(n).every_nth_block(2)])
        rules = [dataclasses.replace(r, budget_bytes=self.budget_bytes, checked_peak_bytes=peak) for r in near
                 if (peak := self.measure_peak(r, n)) <= self.budget_bytes]
        args, kwargs, loss_fn = self.batch(n)
        times = time_plans_in_place(self.model, [plan, *rules], args, kwargs, loss_fn, self.device,
                                    output_alive=self.output_alive, rounds=repeats, warmup=1)
        results = faster_of(times[0], list(zip(rules, times[1:])))
        if near:
            self.notes.append(f"size {n}: timed beside {', '.join(r.strategy.replace('_', ' ') for r in near)} (the "
                              f"model cannot tell them apart), {len(rules) * (repeats + 1) + len(near)} steps more, "
                              f"{time.perf_counter() - started:.1f} s of the row's timing (measured)" + (
                                  f"; {results[0].rule.strategy.replace('_', ' ')} measured faster in the median of "
                                  f"{results[0].rounds} pairs ({results[0].paired_s * 1e3:+,.1f} ms): the row's plan"
                                  if results and results[0].rule_faster else "; the ILP's plan kept"))
        if results and results[0].rule_faster:
            return results[0].rule, results[0].rule_s
        return plan, statistics.median(times[0])
