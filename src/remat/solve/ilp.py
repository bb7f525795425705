"""The ILP: least recompute time such that every predicted-memory row stays within the budget.

Decision variables (one per plan variable ``v`` of the memory model, ``MemoryModel.variables``):
    ``x[u]``   = 1 if unit ``u`` is checkpointed at the top level, else 0;
    ``x[u/w]`` = 1 if unit ``w`` is checkpointed inside checkpointed unit ``u`` (Note [Nested
               checkpoints] in remat.costs.simulate), else 0.

Constraints:
    ``mem_<row>``   for every row of the memory model (remat.costs.simulate.Row), in units of
                     ``scale`` bytes rounded soundly (Note [Sound scaling]):
                     ``ceil(row.const_bytes / scale) + sum(ceil(row.coef_bytes[u] / scale) * x[u])
                     <= floor(budget_bytes / scale)``
    ``overlap_<unit>`` units whose forward spans cover ``unit``'s first operator (nested units,
                     overlapping segments) are never checkpointed together at the top level:
                     ``sum(x[v]) <= 1``
    ``inside_<u/w>``  a unit is checkpointed inside ``u`` only when ``u`` is checkpointed:
                     ``x[u/w] <= x[u]``
    ``nested_overlap_<u>_<k>`` units inside ``u`` whose spans cover one unit's first operator are
                     never both checkpointed inside it: ``sum(x[u/w]) <= 1``
    ``copy_out_<i>``, ``paired_*``, ``host_memory``: with offloading offered, the copies out the
                     forward does not finish (a row per start time: Note [Queue rows]), each offload's shorter wait
                     where the unit after it is offloaded too (a row per unit: Note [Pairing rows]), the host memory
                     (Note [Exposed copies] in remat.costs.offload; ``_offload_terms``)

Objective: minimise ``sum(cost_s[v] * x[v])`` (a nested variable costs its inner unit's): measured seconds of recompute plus checkpoint's
measured bookkeeping per unit; exactly for small problems, within 1% for large ones (Note [Solver gap]).

The solver's own tolerances are not trusted: the rounded solution is re-checked with the
simulator, and a (rare) violation tightens the budget and solves again.

Note [Warm start]
~~~~~~~~~~~~~~~~~
Nested pairs give CBC many more near-equal plans to rule out: on the 24-block GPT (120 variables,
block granularity) two budgets out of six took 5-17 s to solve within 1%, against 0.2-0.4 s without
nesting (fixing the nested variables at 0 in the same problem was as slow: its extra rows stay). Solving
the flat problem (``MemoryModel(nesting=False)``, fast) and handing CBC its plan as the first incumbent
(``solve_ilp(start=...)``) brought every budget under 0.7 s (benchmarks/scale/solve_scaling.py --gpt 24); with the
selective options too, the flat block-level plan starts the op-level solve. The
flat plan is a plan of the nested problem too, so the answer is never worse than the flat one. Even so,
another profile of the same model (other measured times) took 10-11 s at one budget of six; so with a flat
plan in hand the nested search stops after ``remat.solve.NESTED_SEARCH_S`` (1 s) with the best plan found,
which the plan's status says ("at least as good as the best flat plan"). The bundled CBC (2.10, PuLP
3.3) segfaulted reading the start for one model (the MobileNet-style zoo model, 61 variables): a failed
warm start is solved again without one.

Note [Queue rows]
~~~~~~~~~~~~~~~~~
The copies out are one queue (Note [Exposed copies]): from any time ``s`` on it holds the chosen copies that start
at ``s`` or later, so it ends no sooner than ``s`` plus their copy times, whether or not a copy starts at ``s``; the
largest of these bounds over the starts is its end (an unchosen start's bound is at most the next chosen one's). So
each distinct start gets one row, ``sum(copy_out_s[v] * x[v] for v starting at s or later) - out <= forward_s - s``,
exact for every plan. Before issue #60 each option had its own row, with its start on its own variable
(``start_k * x[k]``): exact on plans too, but a fractional ``x[k]`` took a fraction of the start off, which loosened
the LP relaxation CBC bounds its search with, and a unit's options repeated one row.

Note [Pairing rows]
~~~~~~~~~~~~~~~~~~~
A unit's wait shortens where the unit after it is offloaded too (``z <= x[k]`` per option ``k``). At most one of a
unit's options is chosen, so their ``z`` together are at most the next unit's options' sum: one row per unit. One row
per option (before issue #60) was as exact on plans, but the LP relaxation then paired each of a unit's options with
the same fraction of the next unit: on torchtitan's Llama 3 8B (8 H100s, 70 GiB) it spread every layer over two
parts and chained halves of layers, and its bound sat 6.2% under the best plan (3.0% after CBC's cuts, which did
not move in 60 s of branching; with Note [Queue rows]); with one row per unit, 2.9% (1.3% after cuts).

Note [Offload search]
~~~~~~~~~~~~~~~~~~~~~
Even so, with offloading offered CBC's bound stays 1-4% under the best plan on large problems (pairs of layers, the
copy queue and many near-equal options across identical layers), and branching does not close it: on the 8B it ran
to its time limit (60 s) at most budgets, every time the reserved budget was tightened (7 solves: 275 s of planning
against 76 s without offloading, issue #60), and its plans depended on how loaded the machine was. The plans it
kept were found in the first seconds (at the root: the feasibility pump, diving). So a problem above
``EXACT_UNITS`` with offloading offered stops within ``GAP_REL`` where CBC proves it, else after ``OFFLOAD_NODES``
nodes of branching (300: 4-6 s on the 8B here, against 50 nodes for the same plans), a count rather than a time so
the same problem gets the same plan on any machine; the plan's status says so and how far from CBC's bound it may
be (read from CBC's log). On the 8B (allocated budgets of the reserved budget's tightening) it kept the plans 60 s
of search kept at 70 and 55 GiB, and at 62 GiB one of 379.5 ms extra time against 376.2 (+0.1% of the step).

Note [Sound scaling]
~~~~~~~~~~~~~~~~~~~~
Rows in raw bytes (10^6-10^10) next to 0/1 variables are badly scaled for CBC: its presolve
declared a feasible problem infeasible when the only feasible plans lay exactly on a row
(``random_chain_profile(5, 512)`` at its least peak, a failure seen in CI). So every row is
written in units of ``scale`` bytes, a power of two that brings the largest number to about
2^20, and rounded so that the scaled problem is never looser than the real one: constants and
coefficients round up (a saving, being negative, rounds towards zero), the budget rounds down.
Any plan feasible after scaling is feasible in bytes; the price is at most (terms + 1) x scale
bytes of slack per row, about one millionth of the row. A budget at or above the least peak that
rounding (or the time limit) leaves without a solution gets the least-memory plan, which is
known to fit (``solve_ilp``'s ``fallback``), never "infeasible".
"""

from __future__ import annotations

import logging
import math
import os
import re
import tempfile
import time
import warnings

import pulp

from remat.costs.unit_costs import nest_key
from remat.errors import SolverError
from remat.costs.simulate import MemoryModel

log = logging.getLogger(__name__)

#: microseconds of recompute per second: keeps the objective's coefficients well scaled for CBC
_US = 1e6
#: objective cost of choosing a unit at all, in microseconds: among equally fast plans, prefer fewer units
_TIE_US = 1e-3


def _name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", s)


#: Note [Solver gap]: models of identical blocks give CBC many symmetric, near-equal solutions to rule
#: out (a 24-block GPT with 72 units took 40-60 s to prove optimality, 0.06-0.2 s to get within 1%:
#: benchmarks/scale/solve_scaling.py --gpt 24). Above
#: EXACT_UNITS candidates the ILP stops within GAP_REL of the best recompute time; 1% of the recompute
#: is far below the noise of the measured costs it optimises. Small problems are solved exactly.
EXACT_UNITS = 32
GAP_REL = 0.01


#: Note [Offload search]: nodes of branching CBC may spend on a problem with offloading offered that it has not
#: solved within GAP_REL by then
OFFLOAD_NODES = 300


def _solver(time_limit_s: float | None, gap_rel: float | None = None, warm: bool = False,
            max_nodes: int | None = None, log_path: str | None = None) -> pulp.LpSolver:
    """CBC through PuLP: ``COIN_CMD`` when a CBC binary is installed (PuLP 4 style), else PuLP 3's bundled one.
    ``log_path``: where CBC writes its log (read for its bound: :func:`_search_gap`)."""
    extra = {k: v for k, v in (("maxNodes", max_nodes), ("logPath", log_path)) if v is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in ("COIN_CMD", "PULP_CBC_CMD"):
            try:
                try:
                    solver = pulp.getSolver(name, msg=False, timeLimit=time_limit_s, gapRel=gap_rel, warmStart=warm,
                                            **extra)
                except TypeError:  # a PuLP without the maxNodes argument (2.7): CBC's own option, as PuLP passes it
                    solver = pulp.getSolver(name, msg=False, timeLimit=time_limit_s, gapRel=gap_rel, warmStart=warm,
                                            options=[f"maxNodes {max_nodes}"] if max_nodes is not None else [],
                                            **{k: v for k, v in extra.items() if k != "maxNodes"})
            except Exception:  # noqa: BLE001 - solver not known to this PuLP version
                continue
            if solver.available():
                return solver
    raise SolverError("no CBC solver found: PuLP 2.7-3.x bundles one (`pip install 'pulp>=2.7,<4'`); with PuLP 4 "
                      "install a CBC binary (e.g. `apt-get install coinor-cbc`)")


#: Note [Sound scaling]: the largest number in a scaled row is about 2**SCALED_BITS
SCALED_BITS = 20


def row_scale(model: MemoryModel) -> int:
    """Bytes per unit of the scaled rows (a power of two; 1 for small problems)."""
    biggest = max((abs(v) for row in model.rows for v in (row.const_bytes, *row.coef_bytes.values())), default=1)
    return 2 ** max(0, math.ceil(math.log2(max(biggest, 1))) - SCALED_BITS)


def _up(nbytes: int, scale: int) -> int:
    """``ceil(nbytes / scale)`` in integers (never smaller than the true value, for either sign)."""
    return -(-nbytes // scale)


def _variable(prob: pulp.LpProblem, name: str, low: float, high: float | None, cat: str) -> pulp.LpVariable:
    """A variable of ``prob``: ``prob.add_variable`` where PuLP has it (3.x, required by 4), else
    ``LpVariable`` (2.7-2.9, where it does not exist yet)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, high, cat=cat)
    return pulp.LpVariable(name, low, high, cat=cat)


def _solve(model: MemoryModel, budget_bytes: int | None, time_limit_s: float | None,
           start: frozenset[str] | None = None):
    """Solve once (``start``: a plan to start from, Note [Warm start]). Returns (chosen units or None, status)."""
    prob = pulp.LpProblem("remat", pulp.LpMinimize)
    units = list(model.variables)
    scale = row_scale(model)
    # x[v]: 1 if plan variable v is chosen (unit v at the top level; for v = "u/w", unit w inside unit u)
    x = {u: _variable(prob, f"x_{i}_{_name(u)}", 0, 1, pulp.LpBinary) for i, u in enumerate(units)}
    recompute = pulp.LpAffineExpression([(x[u], model.cost_s(u) * _US + _TIE_US) for u in units])
    peak = None
    if budget_bytes is None:
        # peak: the predicted peak memory of the step, in units of scale bytes (minimised; the cheapest
        # plan at that peak is a second solve, with the peak as the budget: Note [Least peak])
        peak = _variable(prob, "peak_scaled", 0, None, pulp.LpContinuous)
        prob += peak
    # mem_<row>: predicted memory at every row within the budget (or below the peak variable), in units
    # of scale bytes rounded soundly (Note [Sound scaling])
    for row in model.rows:
        terms = [(x[u], _up(c, scale)) for u, c in row.coef_bytes.items()]
        if peak is None:
            expr = pulp.LpAffineExpression(terms)
            rhs = budget_bytes // scale - _up(row.const_bytes, scale)
        else:
            expr = pulp.LpAffineExpression(terms + [(peak, -1)])
            rhs = -_up(row.const_bytes, scale)
        prob += pulp.LpConstraint(expr, pulp.LpConstraintLE, f"mem_{_name(row.name)}", rhs)
    # overlap_<unit>: never two units whose forwards intersect (a unit inside another, overlapping segments)
    for i, group in enumerate(model.cliques()):
        prob += (pulp.lpSum(x[v] for v in group) <= 1, f"overlap_{i}_{_name(group[0])}")
    for outer, inner in model.inner.items():
        # inside_<u/w>: checkpointed inside u only if u is checkpointed
        for w in inner:
            prob += (x[nest_key(outer, w)] <= x[outer], f"inside_{_name(nest_key(outer, w))}")
        # nested_overlap_<u>_<k>: overlapping units inside u, at most one of them inside it
        for k, group in enumerate(model.inner_cliques(outer)):
            prob += (pulp.lpSum(x[nest_key(outer, w)] for w in group) <= 1, f"nested_overlap_{_name(outer)}_{k}")
    if model.offloads and model.link is not None:
        recompute = _offload_terms(prob, model, x, scale, recompute)
    gap = GAP_REL if len(units) > EXACT_UNITS and budget_bytes is not None else None
    # Note [Offload search]: with offloading offered, branching stops after OFFLOAD_NODES nodes
    nodes = OFFLOAD_NODES if gap is not None and model.offloads and model.link is not None else None
    if peak is None:
        prob += recompute
    if start is not None:  # Note [Warm start]
        chosen_start = model.assignment(start)
        for v, var in x.items():
            var.setInitialValue(1 if v in chosen_start else 0)
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "cbc.log") if nodes is not None else None
        try:
            prob.solve(_solver(time_limit_s, gap, warm=start is not None, max_nodes=nodes, log_path=log_path))
        except pulp.PulpSolverError:
            if start is None:
                raise
            # Note [Warm start]: CBC 2.10 (PuLP 3.3's) crashed reading the start on one model of six
            log.info("CBC failed with a warm start; solving again without one")
            return _solve(model, budget_bytes, time_limit_s)
        stopped = _search_gap(log_path) if log_path is not None and os.path.exists(log_path) else None
    status = pulp.LpStatus[prob.status]
    if status != "Optimal" or any(x[u].varValue is None for u in units):
        return None, status.lower()
    chosen = model.units_of(u for u in units if x[u].varValue > 0.5)
    sol = getattr(prob, "sol_status", pulp.LpSolutionOptimal)
    if sol != pulp.LpSolutionOptimal:
        if stopped is not None and stopped[0] == "nodes":
            within = "" if stopped[1] is None else f", within {stopped[1]:.1%} of CBC's bound"
            return chosen, f"feasible (search stopped after {nodes} nodes{within}: Note [Offload search])"
        return chosen, "feasible (time limit reached)"
    return chosen, "optimal" if gap is None else f"optimal within {gap:.0%}"


def _search_gap(log_path: str) -> tuple[str, float | None] | None:
    """From a CBC log, why a search stopped short ("nodes" or "time") and its best plan's distance from the bound
    (a share of the plan's objective; None where the log does not say); None where it was not stopped short."""
    with open(log_path, errors="replace") as f:
        text = f.read()
    why = re.search(r"Result - Stopped on (\w+)", text)
    if why is None:
        return None
    value, bound = (re.search(rf"^{k}:\s*(-?[\d.eE+-]+)\s*$", text, re.M) for k in ("Objective value", "Lower bound"))
    gap = None
    if value is not None and bound is not None and float(value.group(1)) > 0:
        gap = max(0.0, 1 - float(bound.group(1)) / float(value.group(1)))
    return ("nodes" if why.group(1).startswith("node") else why.group(1)), gap


def _offload_terms(prob: pulp.LpProblem, model: MemoryModel, x: dict, scale: int,
                   recompute: pulp.LpAffineExpression) -> pulp.LpAffineExpression:
    """Note [Exposed copies] in remat.costs.offload: the copies out the forward does not finish (one continuous
    variable, a row per offload option) and each option's wait for its copy back, less where the unit after it
    is offloaded too (a continuous ``z`` per option), in the objective beside recompute; and the host memory the
    offloaded bytes fill. Each offload variable's own cost (``model.cost_s``) is its wait alone."""
    link, p = model.link, model.profile
    spans = model.offloads
    moved = [(x[k], span.nbytes) for k, span in spans.items()]
    out_s = _variable(prob, "exposed_to_host_s", 0, None, pulp.LpContinuous)
    # copy_out_<i>: Note [Queue rows]: from each start time on, the side stream's queue holds the chosen copies that
    # start then or later; what it has not finished when the backward starts is exposed. One row per distinct start
    for i, start_s in enumerate(sorted({s.start_s for s in spans.values()})):
        terms = [(x[v], s.copy_out_s) for v, s in spans.items() if s.start_s >= start_s]
        prob += (pulp.LpAffineExpression(terms + [(out_s, -1)]) <= p.forward_s - start_s, f"copy_out_{i}")
    options: dict[str, list[str]] = {}
    for k, span in spans.items():
        options.setdefault(span.unit, []).append(k)
    paired, pairs = [], {}
    for i, (k, span) in enumerate(spans.items()):
        saved_s = span.stall_s - span.paired_stall_s
        if saved_s <= 0 or span.next_unit not in options:
            continue
        # paired_<k>: z = 1 only when k and one option of the unit after it are chosen: its wait shortens
        z = _variable(prob, f"paired_{i}_{_name(k)}", 0, 1, pulp.LpContinuous)
        prob += (z <= x[k], f"paired_self_{i}_{_name(k)}")
        pairs.setdefault(span.unit, []).append(z)
        paired.append((z, -saved_s * _US))
    # paired_next_<unit>: Note [Pairing rows]: the unit's options together pair at most as much as its next unit is
    # offloaded (one option of a unit is chosen at most)
    for i, (unit, zs) in enumerate(pairs.items()):
        nxt = spans[options[unit][0]].next_unit
        prob += (pulp.lpSum(zs) <= pulp.lpSum(x[j] for j in options[nxt]), f"paired_next_{i}_{_name(unit)}")
    if link.host_bytes is not None:
        prob += (pulp.LpAffineExpression([(v, _up(b, scale)) for v, b in moved]) <= link.host_bytes // scale,
                 "host_memory")
    return recompute + pulp.LpAffineExpression([(out_s, _US)] + paired)


def solve_ilp(
    model: MemoryModel, budget_bytes: int, *, time_limit_s: float | None = 60.0,
    fallback: frozenset[str] | None = None, start: frozenset[str] | None = None,
) -> tuple[frozenset[str] | None, str, float]:
    """Least-recompute plan within ``budget_bytes``.

    ``start``: a plan that fits, CBC's first incumbent (Note [Warm start]). ``fallback``: a plan known to
    fit (the least-memory plan, when ``budget_bytes`` is at least its peak): returned, with a status that says so, when the solver finds nothing (Note [Sound
    scaling]: rounding at the edge of feasibility, or the time limit). Returns ``(units, status,
    solve_time_s)``; ``units`` is None only when no plan fits and there is no fallback. Does not
    mutate ``model``.
    """
    t0 = time.perf_counter()
    target = budget_bytes
    why = "infeasible"
    for _ in range(4):
        chosen, status = _solve(model, target, time_limit_s,
                                start if start is not None and model.peak_bytes(start) <= target else None)
        if chosen is None:
            why = status
            break
        over = model.peak_bytes(chosen) - budget_bytes
        if over <= 0:
            return chosen, status, time.perf_counter() - t0
        log.debug("ILP solution exceeds the budget by %d bytes after rounding; tightening", over)
        target -= over
    if start is not None and model.peak_bytes(start) <= budget_bytes:
        # the warm start fits and recomputes no more than the least-memory plan would: a large nested problem (80
        # layers' selective menus under FSDP2 x TP) found no solution in the nested search's short time, and the
        # least-memory fallback then recomputed every layer where the flat plan needed 59 of 80
        return start, f"the best flat plan (the nested search: {why})", time.perf_counter() - t0
    if fallback is not None and model.peak_bytes(fallback) <= budget_bytes:
        # the fallback meets the budget: the solver's "infeasible" is its rounded rows at the edge (Note [Sound
        # scaling]) or its time limit, not the budget's, and must not read as if the budget were not met
        why = "none found on its rounded rows at the edge of feasibility" if why == "infeasible" else why
        return fallback, f"least-memory plan (meets the budget; the ILP: {why})", time.perf_counter() - t0
    return None, why, time.perf_counter() - t0


def min_peak(model: MemoryModel, *, time_limit_s: float | None = 60.0) -> tuple[frozenset[str], int]:
    """The least predicted peak any plan reaches (bytes), and a plan that reaches it.

    Note [Least peak]: minimising the peak alone, then (``solve_ilp`` with that peak as the budget)
    the recompute, is much faster than one objective weighing both: with many near-equal options per
    unit (selective menus) CBC spent 14 s proving a combined optimum on a 24-block GPT (360 units)."""
    chosen, status = _solve(model, None, time_limit_s)
    if chosen is None:  # the empty plan is feasible: only a time limit too short for any solution
        raise SolverError(
            f"the ILP found no plan at all within time_limit_s={time_limit_s} s (CBC status: {status}) over "
            f"{len(model.units)} candidate units; raise time_limit_s (None: no limit)"
        )
    return chosen, model.peak_bytes(chosen)
