"""Offload as the third choice of the plan (issue #50; Note [Offload in the memory model] in remat.costs.offload):
the memory model's offload variables, the ILP's exposed copy time and host memory, on synthetic chains whose
figures the tests work out by hand."""

import dataclasses

import pytest

from remat.costs.offload import HostLink, OffloadSpan, exposed_copy_s, link_from_spec, offload_key
from remat.costs.simulate import MemoryModel
from remat.errors import InvalidInputError
from remat.solve import Planner
from remat.solve.plan import Plan
from remat.solve.synthetic import chain_profile, random_chain_profile
from remat.target.spec_file import device_spec

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


def test_exposed_copies_queue_out_behind_the_forward_and_wait_back_unless_the_next_unit_brings_them():
    """Note [Exposed copies], by hand. A's copies out start at 0 s and take 0.6, B's at 0.5 and take 0.6, in a 1 s
    forward: queued, they end at 1.2 (0.2 exposed). Back: A's whole copy (0.5 s) is waited for unless B, the unit
    after it, is offloaded too (then 0.1); B, last, waits 0.4 either way."""
    a = OffloadSpan("A", (), 0, stall_s=0.5, paired_stall_s=0.1, next_unit="B", start_s=0.0, copy_out_s=0.6)
    b = OffloadSpan("B", (), 0, stall_s=0.4, paired_stall_s=0.4, next_unit=None, start_s=0.5, copy_out_s=0.6)
    assert exposed_copy_s({"A": a, "B": b}, 1.0) == pytest.approx(0.2 + 0.1 + 0.4)
    assert exposed_copy_s({"A": a}, 1.0) == pytest.approx(0.5)  # out hidden; nothing brings it back early
    assert exposed_copy_s({"B": b}, 1.0) == pytest.approx(0.1 + 0.4)  # 0.5 + 0.6 out
    assert exposed_copy_s({}, 1.0) == 0.0


def _titan_like():
    """Three units: u0 saves 3.49 GB (torchtitan's offloaded layer) and recomputes in 20 ms; u1 and u2 run 40 ms
    forward each (so u0's copy out, 64 ms at 54.5 GB/s, is done by the end of u2's) and save under 64 KiB (not
    offloadable: nothing after u0 brings its storages back early)."""
    small = 32 * 1024
    return chain_profile([3_491_889_152, small, small], [8 * 2**20] * 3, [0.020, 0.040, 0.040])


def test_offload_is_refused_where_recomputing_is_cheaper_over_the_measured_link_and_chosen_over_a_fast_one():
    """u0 must leave the device (a budget that recomputing it and offloading it both meet). Over the H200's measured
    link (54.5 GB/s host to device, the other direction carried) its copy back is 64 ms, all waited for (u1 is not
    offloaded): more than its 20 ms recompute, so it is recomputed. Over a 450 GB/s link, 7.8 ms: offloaded. The old
    model let u1's backward (80 ms) hide the copy back whatever u1 did, and offloaded u0 at 0 ms (as torchtitan's
    layer was, predicted 361 ms and measured 447-451 where recomputing it measured 405)."""
    p = _titan_like()
    measured = link_from_spec(device_spec("h200"))
    assert measured.to_device_bytes_per_s == 54.5e9
    planner = Planner(p, offload=measured)
    assert offload_key("u0") in planner.model.offloads  # offered: its copy out is done before the backward
    # a budget both meet, below the plain step's peak
    budget = max(planner.model.peak_bytes([offload_key("u0")]), planner.model.peak_bytes(["u0"]))
    assert budget < planner.model.peak_bytes([])
    assert planner.model.exposed_copy_s([offload_key("u0")]) == pytest.approx(3_491_889_152 / 54.5e9)
    plan = planner.plan_for_budget(budget)
    assert plan.offloaded == () and plan.checkpointed == ("u0",)
    fast = Planner(p, offload=HostLink(450e9, 450e9)).plan_for_budget(budget)
    assert fast.offloaded == ("u0",) and fast.checkpointed == ()
    assert fast.predicted_exposed_copy_s == pytest.approx(3_491_889_152 / 450e9)
    assert fast.predicted_step_time_s == pytest.approx(p.step_time_s + 3_491_889_152 / 450e9)
    assert fast.predicted_step_time_s < plan.predicted_step_time_s


def test_a_units_copy_back_hides_behind_the_next_units_backward_only_when_that_unit_is_offloaded_too():
    """The ILP's pairing: with u1 offloadable, offloading u0 and u1 together hides u0's copy back behind u1's
    backward; the plan's predicted time is the model's exposed copies, each wait counted once."""
    p = chain_profile([3_491_889_152, 64 * 2**20, 64 * 2**20], [8 * 2**20] * 3, [0.020, 0.040, 0.040])
    model = MemoryModel(p, offload=HostLink(54.5e9, 54.5e9))
    u0, u1 = offload_key("u0"), offload_key("u1")
    alone, both = model.exposed_copy_s([u0]), model.exposed_copy_s([u0, u1])
    assert alone == pytest.approx(3_491_889_152 / 54.5e9)
    assert both == pytest.approx(64 * 2**20 / 54.5e9)  # u0's hidden behind u1's 80 ms backward; u1's waited for
    budget = max(model.peak_bytes([u0]), model.peak_bytes(["u0"]))
    assert model.peak_bytes([u0, u1]) <= budget < model.peak_bytes([])
    plan = Planner(p, offload=HostLink(54.5e9, 54.5e9)).plan_for_budget(budget)
    assert plan.offloaded == ("u0", "u1")
    assert plan.predicted_step_time_s == pytest.approx(p.step_time_s + both)


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


def _named_profile():
    """The chain with u1's one drop split into four storages of 40, 30, 20 and 10% of its bytes, made by named
    operators (``aten.mm.default#k``, the k-th), as a recorded profile's are: what parts of u1 are made of."""
    p = _profile()
    (d,) = p.unit("u1").drops
    sizes = [d.nbytes * k // 10 for k in (4, 3, 2)]
    sizes.append(d.nbytes - sum(sizes))
    drops = tuple(dataclasses.replace(d, nbytes=b, op=f"aten.mm.default#{k}") for k, b in enumerate(sizes))
    return dataclasses.replace(p, units=tuple(dataclasses.replace(u, drops=drops) if u.name == "u1" else u
                                              for u in p.units))


def test_parts_of_a_unit_move_its_largest_operator_outputs_up_to_each_share_and_leave_sooner():
    """Note [Offloaded parts], by hand: u1's storages are 40, 30, 20 and 10% of its bytes. Largest first up to 25%
    of them is the 40% one (a part holds at least one), up to 50% the same (not offered twice), up to 75% the 40
    and 30% ones. Over a link that copies u1 whole in 1.5 of u2's forwards, the 40% part's copy (0.6 of u2's
    forward) is done when u2's forward ends; the 70% part's (1.05) and the whole unit's only when u3's ends."""
    p = _named_profile()
    u1, u2, u3 = p.unit("u1"), p.unit("u2"), p.unit("u3")
    sizes = [d.nbytes for d in u1.drops]
    total = sum(sizes)
    assert u2.forward_s + u3.forward_s >= 1.5 * u2.forward_s  # (so u3's forward ends each copy)
    model = MemoryModel(p, offload=HostLink(total / (1.5 * u2.forward_s), 1e12))
    spans = {k: s for k, s in model.offloads.items() if k.startswith(offload_key("u1"))}
    assert [(k, s.ops, s.nbytes) for k, s in spans.items()] == [
        (offload_key("u1"), (), total),
        (offload_key("u1", 1), ("aten.mm.default#0",), sizes[0]),
        (offload_key("u1", 2), ("aten.mm.default#0", "aten.mm.default#1"), sizes[0] + sizes[1])]
    back = spans[offload_key("u1")].back_at
    for key, gone in ((offload_key("u1"), u3.forward_end + 1), (offload_key("u1", 1), u2.forward_end + 1),
                      (offload_key("u1", 2), u3.forward_end + 1)):
        made = [d for d in u1.drops if not spans[key].ops or d.op in spans[key].ops]
        assert [at for _, at, _ in spans[key].drops] == [max(d.free_from, min(gone, back)) for d in made], key


def test_a_unit_is_offloaded_once_whole_or_as_one_part_and_the_plan_names_the_parts_operators():
    p = _named_profile()
    assert not any("~" in k for k in Planner(p, offload=FAST).model.offloads)  # whole units only at "block"
    planner = Planner(p, offload=FAST, granularity="op")
    part = next(k for k in planner.model.offloads if k.startswith(offload_key("u1") + "~"))
    with pytest.raises(InvalidInputError, match="offload a unit, or one part of it"):
        planner.make_plan([offload_key("u1"), part], "two")
    assert any({offload_key("u1"), part} <= set(c) for c in planner.model.cliques())
    plan = planner.make_plan([part], "part")
    assert plan.offloaded == (part.removeprefix("offload:"),)
    assert plan.offloaded_ops == {plan.offloaded[0]: planner.model.offloads[part].ops}
    assert plan.predicted_offload_bytes == planner.model.offloads[part].nbytes
    assert Plan.from_dict(plan.to_dict()) == plan and "the rest stays on the device" in str(plan)


def test_the_next_unit_in_the_recorded_order_pairs_a_units_copy_back():
    """Note [Exposed copies] (issue #62): a unit is brought back early at the backward of the unit that ran next at
    its level, as recorded, whatever the names: ``u1`` after ``u0``, and the same chain with its units named
    ``attn``, ``mlp``, ``out`` alike (by name it paired nothing there, and both copies back were waited for in
    full). Only where that unit is offloaded too; the plan carries the pairing it priced."""
    from remat.solve import Planner

    p = chain_profile([3_491_889_152, 64 * 2**20, 64 * 2**20], [8 * 2**20] * 3, [0.020, 0.040, 0.040])
    names = {"u0": "attn", "u1": "mlp", "u2": "out"}
    renamed = dataclasses.replace(p, units=tuple(dataclasses.replace(u, name=names[u.name]) for u in p.units))
    link = HostLink(54.5e9, 54.5e9)
    for profile, (a, b) in ((p, ("u0", "u1")), (renamed, ("attn", "mlp"))):
        model = MemoryModel(profile, offload=link)
        assert model.offloads[offload_key(a)].next_unit == b
        paired = [offload_key(a), offload_key(b)]
        # the first's copy back (64 ms) hidden by the second's backward (80 ms); the second's waited for in full
        assert model.exposed_copy_s(paired) == pytest.approx(64 * 2**20 / 54.5e9)
        assert model.exposed_copy_s([offload_key(a)]) == pytest.approx(3_491_889_152 / 54.5e9)
        plan = Planner(profile, offload=link).make_plan(paired, "paired")
        assert plan.offload_ahead == {b: a}


def test_the_ilps_copy_out_rows_count_each_units_own_copy():
    """Note [Exposed copies]: the ILP's rows for the copies out, with the plan's variables fixed, price every set of
    offloads as the model does (``exposed_copy_s``). u0's copy (3.8 GiB, 82 ms at 50 GB/s, from 0 s) and u1's (1.8 GiB,
    39 ms, from 29 ms) queue past the 100 ms forward: 20 ms exposed. Each row was built as a list of (variable,
    coefficient) pairs where a unit's own variable came twice, its copy and its start: PuLP kept the last, so every
    unit's own copy was dropped and the ILP priced both at 40 ms against the model's 61 ms."""
    import pulp

    from remat.solve import ilp

    gib = 2**30
    p = chain_profile([int(3.8 * gib), int(1.8 * gib), 64 * 2**20], [8 * 2**20] * 3, [0.020, 0.040, 0.040])
    model = MemoryModel(p, offload=HostLink(50e9, 50e9))
    u0, u1 = offload_key("u0"), offload_key("u1")
    assert set(model.offloads) == {u0, u1}
    for chosen in ([u0], [u1], [u0, u1]):
        prob = pulp.LpProblem("fixed", pulp.LpMinimize)
        x = {v: pulp.LpVariable(f"x{i}", 0, 1, cat="Binary") for i, v in enumerate(model.variables)}
        for v, var in x.items():
            var.lowBound = var.upBound = 1 if v in chosen else 0
        own = pulp.LpAffineExpression([(x[v], model.cost_s(v) * ilp._US) for v in x])
        prob += ilp._offload_terms(prob, model, x, 1, own)
        prob.solve(ilp._solver(None, None))  # the solver the ILP uses (CBC, as PuLP finds it)
        assert pulp.value(prob.objective) / ilp._US == pytest.approx(model.exposed_copy_s(chosen), rel=1e-6), chosen
    assert model.exposed_copy_s([u0, u1]) == pytest.approx(0.0605, abs=1e-3)


def test_a_unit_between_two_layers_is_the_one_that_pairs():
    """Note [Exposed copies] (issue #62): with another unit (``adapter.0``) run between ``layers.0`` and ``layers.1``,
    ``layers.0`` comes back early at ``adapter.0``'s backward, the unit that ran next, where that one is offloaded too,
    and never at ``layers.1``'s (by name the mechanism once paired ``layers.1`` with ``layers.0`` across the unit
    between, and the model had to follow it); the plan says which pairs it priced, none for a unit alone."""
    from remat.solve import Planner

    p = chain_profile([64 * 2**20] * 3, [8 * 2**20] * 3, [0.020, 0.020, 0.020])
    names = {"u0": "layers.0", "u1": "adapter.0", "u2": "layers.1"}
    p = dataclasses.replace(p, units=tuple(dataclasses.replace(u, name=names[u.name]) for u in p.units))
    link = HostLink(54.5e9, 54.5e9)
    model = MemoryModel(p, offload=link)
    span = model.offloads[offload_key("layers.0")]
    assert span.next_unit == "adapter.0" and span.back_at == p.unit("adapter.0").recompute_at
    planner = Planner(p, offload=link)
    assert set(model.offloads) == {offload_key("layers.0"), offload_key("adapter.0")}  # layers.1: its copy too late
    assert planner.make_plan([offload_key("layers.0")], "alone").offload_ahead == {}
    both = [offload_key("layers.0"), offload_key("adapter.0")]
    assert planner.make_plan(both, "both").offload_ahead == {"adapter.0": "layers.0"}
