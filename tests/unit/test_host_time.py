"""The host in the target's time model (issue #56; Note [Host time model] in remat.costs.device_time, Note [Host
time in the plan] in remat.costs.step_time) on hand-made profiles whose times the formulas fix."""

import dataclasses

import pytest

from remat.costs.device_time import GPU_HOST, HostCosts
from remat.costs.step_time import plan_step_time_s, with_host_times
from remat.solve import Planner
from remat.solve.synthetic import chain_profile

#: round figures, so that the expected seconds are worked out by hand
HOST = HostCosts(forward_op_s=20e-6, backward_op_s=10e-6, selective_forward_op_s=40e-6,
                 selective_recompute_op_s=10e-6, source="by hand")
MS = 1e-3


def _chain(**phases):
    """Three units of two operators each (remat.solve.synthetic), 1 ms of recomputation each, with the plain
    step's phases as given."""
    p = chain_profile([100, 100, 100], [10, 10, 10], [MS, MS, MS])
    return dataclasses.replace(p, **phases)


def test_the_h200_host_figures_are_the_traces():
    """What benchmarks/gpu_traces.py --calibrate derived from the H200's host events (and no step time)."""
    assert (GPU_HOST.forward_op_s, GPU_HOST.backward_op_s) == (29.0e-6, 18.7e-6)
    assert (GPU_HOST.selective_forward_op_s, GPU_HOST.selective_recompute_op_s) == (47.8e-6, 13.2e-6)
    assert "llama1b__1" in GPU_HOST.source and "llama1b__4" in GPU_HOST.source


def test_a_selective_units_host_time_grows_with_its_operator_count():
    """A selective unit's dispatch mode runs over every operator of its forward and its recomputation: 10
    operators cost 10 x 40 us more in the forward and 10 x (20 + 10) us to recompute, 20 twice that; a whole
    unit's recomputation 20 us an operator and nothing more in the forward."""
    (u, *_) = _chain().units
    sel10 = dataclasses.replace(u, name="h.0@ops1", forward_end=u.forward_start + 9, recompute_end=None)
    sel20 = dataclasses.replace(u, name="h.0@ops2", forward_end=u.forward_start + 19, recompute_end=None)
    whole = dataclasses.replace(u, name="h.0", forward_end=u.forward_start + 19, recompute_end=None)
    a, b, w = with_host_times([sel10, sel20, whole], HOST)
    assert a.forward_host_s == pytest.approx(10 * 40e-6) and b.forward_host_s == pytest.approx(20 * 40e-6)
    assert a.recompute_host_s == pytest.approx(10 * 30e-6) and b.recompute_host_s == pytest.approx(20 * 30e-6)
    assert w.forward_host_s == 0.0 and w.recompute_host_s == pytest.approx(20 * 20e-6)
    # a recomputation that stops early (Note [Early stop]) dispatches only what it runs
    (early,) = with_host_times([dataclasses.replace(sel20, recompute_end=u.forward_start + 4)], HOST)
    assert early.recompute_host_s == pytest.approx(5 * 30e-6) and early.forward_host_s == pytest.approx(20 * 40e-6)
    # in a step whose forward the host sets (1 ms of GPU work, 0.9 ms of host work), the plan's time grows with
    # the unit's operators: 0.9 + 0.4 ms forward against 0.9 + 0.8
    p = _chain(forward_s=1 * MS, forward_host_s=0.9 * MS, backward_s=2 * MS, backward_host_s=0.1 * MS,
               optimizer_s=0.0)
    t10, t20 = plan_step_time_s(p, [a]), plan_step_time_s(p, [b])
    assert t10 == pytest.approx(1.3 * MS + 3 * MS) and t20 == pytest.approx(1.7 * MS + 3 * MS)
    assert t10 < t20
    # the solver's cost of the unit grows with it too (Note [Host time in the plan]: its recomputation's longer
    # time, here the GPU's 1 ms, plus its forward's dispatch mode)
    assert a.cost_s == pytest.approx(1 * MS + 0.4 * MS) and b.cost_s == pytest.approx(1 * MS + 0.8 * MS)


def test_a_step_whose_host_work_exceeds_its_gpu_work_is_predicted_at_the_hosts_time():
    """Forward: 10 ms on the GPU, 30 ms of host work: 30. Backward: 20 on the GPU, 5 on the host: 20. Plus the
    optimizer's 1 ms: 51 ms, the plain step and the Planner's plan of nothing alike. A recomputation whose host
    time takes the backward past its GPU time sets the backward too."""
    p = _chain(forward_s=10 * MS, forward_host_s=30 * MS, backward_s=20 * MS, backward_host_s=5 * MS,
               optimizer_s=1 * MS)
    assert p.step_time_s == pytest.approx(51 * MS)
    planner = Planner(p)
    assert planner.make_plan((), "none").predicted_step_time_s == pytest.approx(51 * MS)
    # one unit: 1 ms of GPU recomputation, 18 ms of host recomputation: the backward is the host's 5 + 18
    slow = dataclasses.replace(p.units[0], recompute_host_s=18 * MS)
    q = dataclasses.replace(p, units=(slow, *p.units[1:]))
    assert plan_step_time_s(q, [slow]) == pytest.approx(30 * MS + 23 * MS + 1 * MS)
    assert Planner(q).make_plan((slow.name,), "one").predicted_step_time_s == pytest.approx(54 * MS)


def test_without_a_modelled_host_a_plan_costs_its_recomputation_as_before():
    """A measured profile (no host figures): the plain step plus each unit's recompute and bookkeeping."""
    p = _chain(forward_s=10 * MS, backward_s=20 * MS, optimizer_s=1 * MS)
    u = dataclasses.replace(p.units[0], overhead_s=0.5 * MS)
    assert plan_step_time_s(p, [u]) == pytest.approx(31 * MS + 1.5 * MS)
    assert u.cost_s == pytest.approx(1.5 * MS)
