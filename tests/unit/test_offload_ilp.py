"""The ILP's rows for offloading (issue #60, Notes [Queue rows], [Pairing rows] and [Offload search] in
remat.solve.ilp): exact for every plan, as tight as they can be for fractional ones (CBC's bound is the LP's), and
the search on large problems stopped after a fixed number of nodes; figures worked out by hand."""

from types import SimpleNamespace

import pulp
import pytest

from remat.costs.offload import HostLink, OffloadSpan, exposed_copy_s
from remat.solve import Planner, ilp
from remat.solve.synthetic import random_chain_profile


def _model(spans: dict[str, OffloadSpan], forward_s: float = 1.0) -> SimpleNamespace:
    """What ``_offload_terms`` reads of a memory model: its link, its profile's forward time and its offloads."""
    return SimpleNamespace(link=HostLink(1e9, 1e9), profile=SimpleNamespace(forward_s=forward_s), offloads=spans)


def _lp_value(model: SimpleNamespace, fixed: dict[str, float]) -> tuple[float, pulp.LpProblem]:
    """The objective (seconds) of the offload terms with every plan variable fixed at ``fixed`` (fractions allowed:
    the LP relaxation CBC bounds its search with), each variable's own wait (``stall_s``) included."""
    prob = pulp.LpProblem("fixed", pulp.LpMinimize)
    x = {k: pulp.LpVariable(f"x{i}", fixed[k], fixed[k]) for i, k in enumerate(model.offloads)}
    own = pulp.LpAffineExpression([(x[k], s.stall_s * ilp._US) for k, s in model.offloads.items()])
    prob += ilp._offload_terms(prob, model, x, 1, own)
    prob.solve(ilp._solver(None, None))
    return pulp.value(prob.objective) / ilp._US, prob


def test_a_units_options_together_pair_no_more_than_its_next_unit_is_offloaded():
    """Note [Pairing rows]. L0 has two options (whole: waits 0.5 s, 0.1 paired with L1; a part: 0.3, 0 paired), L1
    one (0.4). With L0's options at 1/2 each and L1 at 1/2, at most half of L0 is paired: 0.6 of waits less 0.2.
    One row per option let each option pair with the same half of L1 (0.6 - 0.2 - 0.15 = 0.25): the LP's bound
    on the 8B's problem sat 6% under the best plan, chaining halves of layers' options."""
    spans = {
        "offload:L0": OffloadSpan("L0", (), 0, stall_s=0.5, paired_stall_s=0.1, next_unit="L1"),
        "offload:L0~1": OffloadSpan("L0", (), 0, stall_s=0.3, paired_stall_s=0.0, next_unit="L1"),
        "offload:L1": OffloadSpan("L1", (), 0, stall_s=0.4, paired_stall_s=0.4, next_unit=None),
    }
    value, prob = _lp_value(_model(spans), {"offload:L0": 0.5, "offload:L0~1": 0.5, "offload:L1": 0.5})
    assert value == pytest.approx(0.4, abs=1e-6)
    assert sum(name.startswith("paired_next") for name in prob.constraints) == 1  # one per unit, not per option
    for chosen in (["offload:L0", "offload:L1"], ["offload:L0~1", "offload:L1"], ["offload:L0"]):  # exact on plans
        fixed = {k: float(k in chosen) for k in spans}
        assert _lp_value(_model(spans), fixed)[0] == pytest.approx(
            exposed_copy_s({k: spans[k] for k in chosen}, 1.0), abs=1e-6), chosen


def test_the_queue_rows_bound_every_start_without_the_options_own_variable():
    """Note [Queue rows]. B's copy out (1.0 s) starts 0.5 s into a 1 s forward: chosen, 0.5 s of it is exposed; at
    0.8 of B, 0.3 (the queue from 0.5 s holds 0.8 s of copies). The row that added B's start times B's own variable
    let the LP have it at 0.2. A's two options share their start: one row for them."""
    spans = {
        "offload:A": OffloadSpan("A", (), 0, start_s=0.2, copy_out_s=0.1),
        "offload:A~1": OffloadSpan("A", (), 0, start_s=0.2, copy_out_s=0.05),
        "offload:B": OffloadSpan("B", (), 0, start_s=0.5, copy_out_s=1.0),
    }
    value, prob = _lp_value(_model(spans), {"offload:A": 0.0, "offload:A~1": 0.0, "offload:B": 0.8})
    assert value == pytest.approx(0.3, abs=1e-6)
    assert sum(name.startswith("copy_out") for name in prob.constraints) == 2  # one per distinct start
    for chosen in (["offload:B"], ["offload:A", "offload:B"], ["offload:A~1"], []):  # exact on plans
        fixed = {k: float(k in chosen) for k in spans}
        assert _lp_value(_model(spans), fixed)[0] == pytest.approx(
            exposed_copy_s({k: spans[k] for k in chosen}, 1.0), abs=1e-6), chosen


LOG_STOPPED = """Cbc0010I After 0 nodes, 1 on tree, 304953.62 best solution, best possible 294235.65 (1.68 seconds)
Cbc0003I Exiting on maximum nodes
Result - Stopped on node limit

Objective value:                298280.18088651
Lower bound:                    294235.650
Gap:                            0.01
"""


def test_the_search_gap_is_read_from_cbcs_log(tmp_path):
    """Note [Offload search]: where CBC stopped on its node limit, the status says how far its plan may be from the
    best (1 - bound / objective); a search that finished says nothing."""
    stopped = tmp_path / "stopped.log"
    stopped.write_text(LOG_STOPPED)
    why, gap = ilp._search_gap(str(stopped))
    assert why == "nodes" and gap == pytest.approx(1 - 294235.650 / 298280.18088651)
    finished = tmp_path / "finished.log"
    finished.write_text("Result - Optimal solution found\n\nObjective value:                298280.18\n")
    assert ilp._search_gap(str(finished)) is None


def test_only_large_problems_with_offloading_offered_stop_after_a_number_of_nodes(monkeypatch):
    """Note [Offload search]: budgeted solves of a problem above EXACT_UNITS with offloading offered stop after
    OFFLOAD_NODES nodes; the least-peak solve and every problem without offloading search as before."""
    seen = []
    real = ilp._solver

    def spy(*args, **kwargs):
        seen.append(kwargs.get("max_nodes"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ilp, "_solver", spy)
    p = random_chain_profile(40, 0)
    for offload, nodes in ((None, None), (HostLink(1e12, 1e12), ilp.OFFLOAD_NODES)):
        seen.clear()
        planner = Planner(p, offload=offload, nesting=False)
        assert seen == [None]  # the least peak: solved to the end
        assert len(planner.model.variables) > ilp.EXACT_UNITS
        assert bool(planner.model.offloads) == (offload is not None)
        planner.plan_for_budget((planner.min_peak_bytes + planner.baseline_peak_bytes) // 2)
        assert set(seen[1:]) == {nodes}
