"""The host in the target's time model (issues #56, #60; Note [Host time model] in remat.costs.device_time, Note
[Host time decomposed] in remat.costs.host_time, Note [Host time in the plan] in remat.costs.step_time) on
hand-made profiles whose times the formulas fix, and the built-in H200 figures from the shared traces."""

import dataclasses
import json
from pathlib import Path

import pytest

from remat.costs.device_time import GPU_HOST, HostCosts
from remat.costs.host_time import HostWork, op_s_from_phase, phase_host_s
from remat.costs.recording import CheckpointOverhead
from remat.costs.step_time import plan_step_time_s, with_host_times
from remat.solve import Planner
from remat.solve.synthetic import chain_profile
from remat.target.host_trace import TraceEvents, host_costs_from_traces, host_phases

DATA = Path(__file__).parents[2] / "benchmarks" / "h200" / "data"
#: round figures, so that the expected seconds are worked out by hand
HOST = HostCosts(forward_op_s=10e-6, backward_op_s=5e-6, selective_forward_op_s=40e-6, selective_recompute_op_s=10e-6,
                 source="by hand")
#: the model's own work: 20 ms forward over 1,000 operators (20 us each), 8 ms backward over 2,000
WORK = HostWork(forward_python_s=20e-3, backward_python_s=8e-3, forward_ops=1000, backward_ops=2000)
#: checkpointing's bookkeeping: 100 us a call, 10 us a saved tensor, 30 us an operator of a selective unit
BOOK = CheckpointOverhead(per_call_s=100e-6, per_saved_tensor_s=10e-6, per_selective_op_s=30e-6)
MS = 1e-3


def _chain(**phases):
    """Three units of two operators each (remat.solve.synthetic), 1 ms of recomputation each, with the plain
    step's phases as given."""
    p = chain_profile([100, 100, 100], [10, 10, 10], [MS, MS, MS])
    return dataclasses.replace(p, **phases)


def _h200_phases():
    return {name: host_phases(TraceEvents.load(str(DATA / f"{name}.trace.json.gz")))
            for name in ("llama1b__1", "llama1b__4")}


def test_the_built_in_h200_host_figures_follow_from_the_shared_traces():
    """GPU_HOST is what host_costs_from_traces derives (through op_s_from_phase, the function remat calibrate
    uses) from the H200's profiled steps (benchmarks/h200/data, copied from ../shared/gpu/h200-2026-12-04) and the inputs
    measured on this project's CPU for the same model (benchmarks/h200/gpu_traces.py --host --write), to the 0.01 us
    the figures are written to; inputs that differ give figures that differ (the check can fail)."""
    inputs = json.loads((DATA / "host_inputs.json").read_text())
    phases = _h200_phases()
    derived = host_costs_from_traces(phases, inputs)
    for field in ("forward_op_s", "backward_op_s", "selective_forward_op_s", "selective_recompute_op_s"):
        assert getattr(GPU_HOST, field) == pytest.approx(getattr(derived, field), abs=0.006e-6), field
    # the forward's wall is llama1b__1's, read from its trace
    assert phases["llama1b__1"]["forward"].wall_s == pytest.approx(35.35e-3, abs=0.01e-3)
    assert "llama1b__1" in GPU_HOST.source and "llama1b__4" in GPU_HOST.source
    # another model's own work (1 ms more of it) moves the figure by 1 ms over the operators
    other = host_costs_from_traces(phases, {**inputs, "forward_python_s": inputs["forward_python_s"] + 1e-3})
    assert derived.forward_op_s - other.forward_op_s == pytest.approx(1e-3 / inputs["forward_ops"], rel=1e-9)
    assert abs(GPU_HOST.forward_op_s - other.forward_op_s) > 0.5e-6


def test_a_phases_wall_is_decomposed_by_what_causes_it():
    """10 ms of host wall = 4 ms of the model's own work + 1 ms of bookkeeping + 1,000 profiler events of 1 us +
    400 operators of 10 us; a wall no longer than what is known of it describes no step."""
    assert op_s_from_phase(10e-3, 4e-3, 400, bookkeeping_s=1e-3, profiler_events=1000,
                           profiler_event_s=1e-6) == pytest.approx(10e-6)
    assert op_s_from_phase(10e-3, 6e-3, 400) == pytest.approx(10e-6)
    with pytest.raises(ValueError, match="nothing is left for its operators"):
        op_s_from_phase(5e-3, 4e-3, 400, bookkeeping_s=1e-3)
    assert phase_host_s(4e-3, 400, 10e-6) == pytest.approx(8e-3)


def test_the_plain_step_is_not_charged_checkpointings_bookkeeping():
    """The plan of nothing pays the model's own work and the device's per operator, nothing of checkpointing: 20 ms
    + 1,000 x 10 us forward. A checkpointed unit adds its bookkeeping to the forward (a call and each tensor it
    saves: 100 + 10 us for the chain's units, which drop one storage each) and recomputes its operators at
    the model's 20 us and the device's 10 us each."""
    p = _chain(forward_s=1 * MS, backward_s=2 * MS, optimizer_s=0.0,
               forward_host_s=phase_host_s(WORK.forward_python_s, WORK.forward_ops, HOST.forward_op_s),
               backward_host_s=phase_host_s(WORK.backward_python_s, WORK.backward_ops, HOST.backward_op_s))
    assert p.forward_host_s == pytest.approx(30 * MS) and p.backward_host_s == pytest.approx(18 * MS)
    assert plan_step_time_s(p, ()) == pytest.approx(30 * MS + 18 * MS)
    assert Planner(p).make_plan((), "none").predicted_step_time_s == pytest.approx(48 * MS)
    units = with_host_times(p.units, HOST, WORK, BOOK)
    u = units[0]
    assert len(u.drops) == 1 and u.forward_end - u.forward_start + 1 == 2
    assert u.forward_host_s == pytest.approx(100e-6 + 10e-6)
    assert u.recompute_host_s == pytest.approx(2 * (20e-6 + 10e-6))
    assert plan_step_time_s(p, [u]) == pytest.approx(30 * MS + 110e-6 + 18 * MS + 60e-6)


def test_a_selective_units_host_time_grows_with_its_operator_count():
    """A selective unit's dispatch mode runs over every operator of its forward and its recomputation: 10
    operators cost 10 x 40 us more in the forward and 10 x (20 + 10 + 10) us to recompute, 20 twice that; a whole
    unit's recomputation 30 us an operator and its forward only the bookkeeping."""
    (u, *_) = _chain().units
    sel10 = dataclasses.replace(u, name="h.0@ops1", forward_end=u.forward_start + 9, recompute_end=None)
    sel20 = dataclasses.replace(u, name="h.0@ops2", forward_end=u.forward_start + 19, recompute_end=None)
    whole = dataclasses.replace(u, name="h.0", forward_end=u.forward_start + 19, recompute_end=None)
    a, b, w = with_host_times([sel10, sel20, whole], HOST, WORK, BOOK)
    book = 100e-6 + 10e-6  # a call, one saved tensor
    assert a.forward_host_s == pytest.approx(book + 10 * 40e-6) and b.forward_host_s == pytest.approx(book + 20 * 40e-6)
    assert a.recompute_host_s == pytest.approx(10 * 40e-6) and b.recompute_host_s == pytest.approx(20 * 40e-6)
    assert w.forward_host_s == pytest.approx(book) and w.recompute_host_s == pytest.approx(20 * 30e-6)
    # a recomputation that stops early (Note [Early stop]) dispatches only what it runs
    (early,) = with_host_times([dataclasses.replace(sel20, recompute_end=u.forward_start + 4)], HOST, WORK, BOOK)
    assert early.recompute_host_s == pytest.approx(5 * 40e-6)
    # a host without selective figures of its own: the planning machine's (30 us) in both
    mine = dataclasses.replace(HOST, selective_forward_op_s=None, selective_recompute_op_s=None)
    (c,) = with_host_times([sel10], mine, WORK, BOOK)
    assert c.forward_host_s == pytest.approx(book + 10 * 30e-6) and c.recompute_host_s == pytest.approx(10 * 60e-6)
    # in a step whose forward the host sets, the plan's time grows with the unit's operators
    p = _chain(forward_s=1 * MS, forward_host_s=0.9 * MS, backward_s=2 * MS, backward_host_s=0.1 * MS,
               optimizer_s=0.0)
    t10, t20 = plan_step_time_s(p, [a]), plan_step_time_s(p, [b])
    assert t10 == pytest.approx(0.9 * MS + a.forward_host_s + 3 * MS)
    assert t20 == pytest.approx(0.9 * MS + b.forward_host_s + 3 * MS)
    assert t10 < t20
    # the solver's cost of the unit grows with it too (its recomputation's longer time, the GPU's 1 ms, plus what
    # it adds to the forward's host)
    assert a.cost_s == pytest.approx(1 * MS + a.forward_host_s) and b.cost_s == pytest.approx(1 * MS + b.forward_host_s)


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
