"""The profiler's torch-free parts on hand-written recordings: candidate segments, policy menus,
operator keys, and the fake-vs-real checks (Note [Segments], Note [Policy menus], Note [Fake sizes],
Note [Fake paths])."""

from __future__ import annotations

import dataclasses

from remat.costs.effects import unit_costs, UnitSpec
from remat.profile.calibrate import LoggedOp, calibrate_sizes, diverged
from remat.profile.units import op_keys, policy_menu, segments, selective_specs
from remat.costs.recording import ForwardOp, Storage, UnitTimes, Write, shared_by_twins, twin_groups

from recordings import A, chain


def test_segments_are_every_run_for_short_containers_and_aligned_runs_for_long_ones():
    # every run of two or more, plus Chen's sqrt(n) segments (here one child: (0, 1))
    assert segments(3, container_is_unit=False) == [(0, 1), (0, 2), (0, 3), (1, 3)]
    assert segments(3, container_is_unit=True) == [(0, 1), (0, 2), (1, 3)]  # not the container itself
    long = segments(16, container_is_unit=False)
    assert (0, 4) in long and (4, 8) in long and (1, 5) not in long  # aligned at multiples of the length


def test_the_policy_menu_ranks_operators_by_flops_per_byte_kept():
    rec = chain().with_op_seconds({0: 0.003, 1: 0.001})
    menu = policy_menu(rec, 0, 1)
    # keep the matmul (1000 FLOPs, 100 B) before the relu (no FLOPs, 50 B); "keep the matmuls" is the same set
    assert menu == [frozenset({0, 1}), frozenset({0})]
    assert op_keys(rec, 0, frozenset({0, 1})) == ("aten.mm.default#0", "aten.relu.default#0")


def test_the_policy_menu_does_not_move_with_measured_times():
    # Note [Policy menus]: the same model gives the same options whatever its operators measured in this run;
    # ranked by time per byte, the relu measured slow (3 ms for 50 B) went first and the menu changed
    fast, slow = chain().with_op_seconds({0: 0.003, 1: 0.001}), chain().with_op_seconds({0: 0.001, 1: 0.003})
    assert policy_menu(fast, 0, 1) == policy_menu(slow, 0, 1)
    four = chain(forward_ops=tuple(ForwardOp(f"aten.{n}.default", (i,), flops=f) for i, (n, f) in
                                   enumerate([("mm", 800), ("gelu", 0), ("mm", 800), ("add", 0)])),
                 storages=(Storage(100, 0, 8), Storage(100, 1, 7), Storage(50, 2, 9), Storage(100, 3, 9)),
                 spans={"a": ((0, 3),)})
    times = [{0: 0.002, 1: 0.001, 2: 0.001, 3: 0.0005}, {0: 0.001, 1: 0.0005, 2: 0.002, 3: 0.001}]
    menus = [policy_menu(four.with_op_seconds(t), 0, 3) for t in times]
    assert menus[0] == menus[1]
    # the matmuls first (16 FLOPs/B for the 50 B one, 8 for the 100 B one), then the smaller of the equal-sized rest
    assert menus[0] == [frozenset({0, 1, 2, 3}), frozenset({0, 1, 2}), frozenset({0, 2}), frozenset({2})]


def test_twins_share_their_measured_times():
    # two identical units (the same operators creating the same bytes) and a third that differs in one size
    ops = tuple(ForwardOp(n, (i,), seconds=t) for i, (n, t) in enumerate(
        [("aten.mm.default", 0.003), ("aten.relu.default", 0.001), ("aten.mm.default", 0.005),
         ("aten.relu.default", 0.002), ("aten.mm.default", 0.004), ("aten.relu.default", 0.001)]))
    rec = chain(n_ops=12, backward_start=6, forward_ops=ops, spans={"a": ((0, 1),), "b": ((2, 3),), "c": ((4, 5),)},
                storages=tuple(Storage(n, i, 11) for i, n in enumerate([100, 50, 100, 50, 100, 60])))
    assert twin_groups(rec, ["a", "b", "c"]) == [["a", "b"]]
    times = UnitTimes(forward_s={"a": 0.004, "b": 0.008, "c": 0.005}, recompute_s={"a": 0.005},
                      backward_s={"a": 0.01, "b": 0.02, "c": 0.03}, mutated_buffers={},
                      step_forward_s=0.02, step_backward_s=0.04)
    shared, t = shared_by_twins(rec, times, ["a", "b", "c"])
    assert [op.seconds for op in shared.forward_ops] == [0.004, 0.0015, 0.004, 0.0015, 0.004, 0.001]
    assert (t.forward_s["a"], t.forward_s["b"], t.forward_s["c"]) == (0.006, 0.006, 0.005)
    assert (t.backward_s["a"], t.backward_s["b"]) == (0.015, 0.015)
    assert dict(t.recompute_s) == {"a": 0.005}  # measured for one twin only: left as it is


def test_random_and_overwritten_outputs_are_never_kept():
    rec = chain().with_op_seconds({0: 0.003, 1: 0.001})
    dropout = dataclasses.replace(rec, forward_ops=(dataclasses.replace(rec.forward_ops[0], random=True),
                                                    *rec.forward_ops[1:]))
    assert policy_menu(dropout, 0, 1) == []  # one keepable operator left: no menu
    written = dataclasses.replace(rec, writes=(Write(("a",), 0, None, "aten.add_.Tensor"),))
    assert policy_menu(written, 0, 1) == []


def test_selective_specs_name_their_policies():
    rec = chain().with_op_seconds({0: 0.003, 1: 0.001})
    specs = selective_specs(rec, unit_costs(rec, [A]))
    assert [s.name for s in specs] == ["a@ops1", "a@ops2"]
    assert specs[1] == UnitSpec("a@ops2", ("a",), None, "a.", keep=frozenset({0}), saved_ops=("aten.mm.default#0",))


def test_sizes_come_from_the_real_forward():
    rec = chain()
    real = (LoggedOp("aten.mm.default", (100,), 1e-3), LoggedOp("aten.relu.default", (64,), 1e-3),
            LoggedOp("aten.sum.default", (10,), 1e-3))
    fixed, n = calibrate_sizes(rec, real)
    assert n == 1 and fixed.storages[1].nbytes == 64 and rec.storages[1].nbytes == 50
    assert diverged(rec, real) == []


def test_another_path_on_real_tensors_is_seen():
    real = (LoggedOp("aten.mm.default", (100,), 0.0), LoggedOp("aten.expand.default", (None,), 0.0),
            LoggedOp("aten.clone.default", (400,), 0.0), LoggedOp("aten.relu.default", (50,), 0.0),
            LoggedOp("aten.sum.default", (10,), 0.0))
    assert diverged(chain(), real) == ["aten.clone.default"]  # the view allocates nothing: not a difference
    assert calibrate_sizes(chain(), real)[1] == 0  # aligned, the matching operators agree
    assert chain().forward_ops[0] == ForwardOp("aten.mm.default", (0,), flops=1000)
