"""Offload as the third choice of the plan (issue #50; Note [Offload in the memory model] in remat.costs.offload):
the memory model's offload variables, the ILP's exposed copy time and host memory, on synthetic chains whose
figures the tests work out by hand."""

import dataclasses

import pytest

from remat.costs.offload import HostLink, exposed_copy_s, offload_key
from remat.costs.simulate import MemoryModel
from remat.errors import InvalidInputError
from remat.solve import Planner
from remat.solve.plan import Plan
from remat.solve.synthetic import random_chain_profile

FAST = HostLink(1e12, 1e12)
SLOW = HostLink(1e6, 1e6)


def _profile():
    return random_chain_profile(6, 0)


def test_an_offloaded_unit_frees_its_drops_from_the_next_units_forward_until_the_next_units_backward():
    """By hand from the chain: unit u1's drops leave once u2's forward has run (the copy hidden under it) and are
    back when u2's backward starts (prefetched one unit ahead); u1 checkpointed frees them from u1's forward to
    its own backward."""
    p = _profile()
    model = MemoryModel(p, offload=FAST)
    u1, u2 = p.unit("u1"), p.unit("u2")
    span = model.offloads[offload_key("u1")]
    assert span.back_at == u2.recompute_at < u1.recompute_at
    assert all(at == max(d.free_from, u2.forward_end + 1) for d, (_, at, _) in zip(u1.drops, span.drops))
    moved = sum(d.nbytes for d in u1.drops)
    assert span.nbytes == moved
    inside = u2.forward_end + 1
    assert model.peak_bytes([offload_key("u1")]) <= model.peak_bytes([])
    assert span.freed_at(inside) == moved and span.freed_at(u2.recompute_at) == 0
    assert span.freed_at(u1.forward_end) == 0  # still on the device while its copy runs


def test_exposed_copy_time_is_what_the_link_cannot_move_within_each_pass():
    link = HostLink(10e9, 20e9)
    # 30 GB: 3 s out against a 1 s forward, 1.5 s back against a 2 s backward
    assert exposed_copy_s(30 * 10**9, link, 1.0, 2.0) == pytest.approx(2.0)
    assert exposed_copy_s(5 * 10**9, link, 1.0, 2.0) == 0.0


def test_with_a_fast_link_offloading_replaces_recomputation_and_is_predicted_faster_at_every_budget():
    p = _profile()
    plain, offload = Planner(p), Planner(p, offload=FAST)
    assert offload.min_peak_bytes <= plain.min_peak_bytes
    chosen_somewhere = False
    for f in (0.0, 0.3, 0.7):
        budget = int(plain.min_peak_bytes + f * (plain.baseline_peak_bytes - plain.min_peak_bytes))
        a, b = plain.plan_for_budget(budget), offload.plan_for_budget(budget)
        assert b.predicted_peak_bytes <= budget
        assert b.predicted_step_time_s <= a.predicted_step_time_s + 1e-12
        chosen_somewhere |= bool(b.offloaded) and b.predicted_step_time_s < a.predicted_step_time_s
        assert not set(b.offloaded) & set(b.checkpointed)
    assert chosen_somewhere


def test_with_a_slow_link_nothing_is_offloaded():
    p = _profile()
    plain, slow = Planner(p), Planner(p, offload=SLOW)
    for f in (0.0, 0.3, 0.7):
        budget = int(plain.min_peak_bytes + f * (plain.baseline_peak_bytes - plain.min_peak_bytes))
        plan = slow.plan_for_budget(budget)
        assert plan.offloaded == () and plan.checkpointed == plain.plan_for_budget(budget).checkpointed


def test_host_memory_limits_what_is_offloaded():
    p = _profile()
    free = Planner(p, offload=FAST).plan_for_budget(Planner(p).min_peak_bytes)
    assert free.predicted_offload_bytes > 0
    limit = free.predicted_offload_bytes - 1
    tight = Planner(p, offload=dataclasses.replace(FAST, host_bytes=limit)).plan_for_budget(Planner(p).min_peak_bytes)
    assert tight.predicted_offload_bytes <= limit


def test_a_plan_offloading_and_checkpointing_the_same_unit_is_refused():
    model = MemoryModel(_profile(), offload=FAST)
    with pytest.raises(InvalidInputError, match="one of the three"):
        model.peak_bytes(["u1", offload_key("u1")])
    with pytest.raises(InvalidInputError, match="cannot be offloaded"):
        MemoryModel(_profile()).peak_bytes([offload_key("u1")])


def test_the_plan_lists_what_it_offloads_and_round_trips_through_json():
    p = _profile()
    plan = Planner(p, offload=FAST).plan_for_budget(Planner(p).min_peak_bytes)
    assert plan.offloaded and plan.choices == plan.checkpointed + tuple(offload_key(u) for u in plan.offloaded)
    assert "offloaded to host" in str(plan) and "(predicted)" in str(plan)
    again = Plan.from_dict(plan.to_dict())
    assert again.offloaded == plan.offloaded and again.predicted_offload_bytes == plan.predicted_offload_bytes
