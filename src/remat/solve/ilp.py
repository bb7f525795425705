"""The ILP: least recompute time such that every predicted-memory row stays within the budget.

Decision variables (one per candidate unit ``u``):
    ``x[u]`` = 1 if ``u`` is checkpointed, else 0.

Constraints:
    ``mem_<row>``   for every row of the memory model (remat.simulate.Row):
                     ``row.const_bytes + sum(row.coef_bytes[u] * x[u]) <= budget_bytes``
    ``overlap_<unit>`` units whose forward spans cover ``unit``'s first operator (nested units,
                     overlapping segments) are never checkpointed together: ``sum(x[v]) <= 1``

Objective: minimise ``sum(cost_s[u] * x[u])``: measured seconds of recompute plus checkpoint's
measured bookkeeping per unit; exactly for small problems, within 1% for large ones (Note [Solver gap]).

The solver's own tolerances are not trusted: the rounded solution is re-checked with the
simulator, and a (rare) violation tightens the budget and solves again.
"""

from __future__ import annotations

import logging
import re
import time
import warnings

import pulp

from remat.simulate import MemoryModel

log = logging.getLogger(__name__)

#: microseconds of recompute per second: keeps the objective's coefficients well scaled for CBC
_US = 1e6
#: objective cost of choosing a unit at all, in microseconds: among equally fast plans, prefer fewer units
_TIE_US = 1e-3


def _name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", s)


#: Note [Solver gap]: models of identical blocks give CBC many symmetric, near-equal solutions to rule
#: out (a 24-block GPT with 72 units took 40-60 s to prove optimality, 0.06-0.2 s to get within 1%:
#: benchmarks/solve_scaling.py --gpt 24). Above
#: EXACT_UNITS candidates the ILP stops within GAP_REL of the best recompute time; 1% of the recompute
#: is far below the noise of the measured costs it optimises. Small problems are solved exactly.
EXACT_UNITS = 32
GAP_REL = 0.01


def _solver(time_limit_s: float | None, gap_rel: float | None = None) -> pulp.LpSolver:
    """CBC through PuLP: ``COIN_CMD`` when a CBC binary is installed (PuLP 4 style), else PuLP 3's bundled one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in ("COIN_CMD", "PULP_CBC_CMD"):
            try:
                solver = pulp.getSolver(name, msg=False, timeLimit=time_limit_s, gapRel=gap_rel)
            except Exception:  # noqa: BLE001 - solver not known to this PuLP version
                continue
            if solver.available():
                return solver
    raise RuntimeError("no CBC solver found: install it with `pip install 'pulp[cbc]'`")


def _solve(model: MemoryModel, budget_bytes: int | None, time_limit_s: float | None):
    """Solve once. Returns (chosen units, status, peak variable value or None)."""
    prob = pulp.LpProblem("remat", pulp.LpMinimize)
    units = list(model.units)
    # x[u]: 1 if unit u is checkpointed
    x = {u: prob.add_variable(f"x_{i}_{_name(u)}", 0, 1, cat=pulp.LpBinary) for i, u in enumerate(units)}
    recompute = pulp.LpAffineExpression([(x[u], model.units[u].cost_s * _US + _TIE_US) for u in units])
    peak = None
    if budget_bytes is None:
        # peak: the predicted peak memory of the step, in bytes (minimised; the cheapest plan at that
        # peak is a second solve, with the peak as the budget: Note [Least peak])
        peak = prob.add_variable("peak_bytes", 0, None)
        prob += peak
    else:
        prob += recompute
    # mem_<row>: predicted memory at every row within the budget (or below the peak variable)
    for row in model.rows:
        terms = [(x[u], c) for u, c in row.coef_bytes.items()]
        if peak is None:
            expr = pulp.LpAffineExpression(terms)
            rhs = budget_bytes - row.const_bytes
        else:
            expr = pulp.LpAffineExpression(terms + [(peak, -1)])
            rhs = -row.const_bytes
        prob += pulp.LpConstraint(expr, pulp.LpConstraintLE, f"mem_{_name(row.name)}", rhs)
    # overlap_<unit>: never two units whose forwards intersect (a unit inside another, overlapping segments)
    for i, group in enumerate(model.cliques()):
        prob += (pulp.lpSum(x[v] for v in group) <= 1, f"overlap_{i}_{_name(group[0])}")
    gap = GAP_REL if len(units) > EXACT_UNITS and budget_bytes is not None else None
    prob.solve(_solver(time_limit_s, gap))
    status = pulp.LpStatus[prob.status]
    if status != "Optimal":
        return None, status.lower()
    chosen = frozenset(u for u in units if (x[u].varValue or 0) > 0.5)
    sol = getattr(prob, "sol_status", pulp.LpSolutionOptimal)
    if sol != pulp.LpSolutionOptimal:
        return chosen, "feasible"
    return chosen, "optimal" if gap is None else f"optimal within {gap:.0%}"


def solve_ilp(
    model: MemoryModel, budget_bytes: int, *, time_limit_s: float | None = 60.0
) -> tuple[frozenset[str] | None, str, float]:
    """Least-recompute plan within ``budget_bytes``.

    Returns ``(units, status, solve_time_s)``; ``units`` is None when no plan fits
    (status "infeasible"). Does not mutate ``model``.
    """
    t0 = time.perf_counter()
    target = budget_bytes
    for _ in range(4):
        chosen, status = _solve(model, target, time_limit_s)
        if chosen is None:
            return None, "infeasible", time.perf_counter() - t0
        over = model.peak_bytes(chosen) - budget_bytes
        if over <= 0:
            return chosen, status, time.perf_counter() - t0
        log.debug("ILP solution exceeds the budget by %d bytes after rounding; tightening", over)
        target -= over
    return None, "infeasible", time.perf_counter() - t0


def min_peak(model: MemoryModel, *, time_limit_s: float | None = 60.0) -> tuple[frozenset[str], int]:
    """The least predicted peak any plan reaches (bytes), and a plan that reaches it.

    Note [Least peak]: minimising the peak alone, then (``solve_ilp`` with that peak as the budget)
    the recompute, is much faster than one objective weighing both: with many near-equal options per
    unit (selective menus) CBC spent 14 s proving a combined optimum on a 24-block GPT (360 units)."""
    chosen, status = _solve(model, None, time_limit_s)
    if chosen is None:  # cannot happen: the empty plan is always feasible without a budget
        raise RuntimeError(f"min-peak ILP failed: {status}")
    return chosen, model.peak_bytes(chosen)
