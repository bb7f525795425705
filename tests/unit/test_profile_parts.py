"""The profiler's torch-free parts on hand-written recordings: candidate segments, policy menus,
operator keys, and the fake-vs-real checks (Note [Segments], Note [Policy menus], Note [Fake sizes],
Note [Fake paths])."""

from __future__ import annotations

import dataclasses

from remat.effects import unit_costs, UnitSpec
from remat.profile.calibrate import LoggedOp, calibrate_sizes, diverged
from remat.profile.units import op_keys, policy_menu, segments, selective_specs
from remat.recording import ForwardOp, Write

from recordings import A, chain


def test_segments_are_every_run_for_short_containers_and_aligned_runs_for_long_ones():
    # every run of two or more, plus Chen's sqrt(n) segments (here one child: (0, 1))
    assert segments(3, container_is_unit=False) == [(0, 1), (0, 2), (0, 3), (1, 3)]
    assert segments(3, container_is_unit=True) == [(0, 1), (0, 2), (1, 3)]  # not the container itself
    long = segments(16, container_is_unit=False)
    assert (0, 4) in long and (4, 8) in long and (1, 5) not in long  # aligned at multiples of the length


def test_the_policy_menu_ranks_operators_by_time_saved_per_byte_kept():
    rec = chain().with_op_seconds({0: 0.003, 1: 0.001})
    menu = policy_menu(rec, 0, 1)
    # keep the matmul (3 ms, 100 B) before the relu (1 ms, 50 B); "keep the matmuls" is the same set
    assert menu == [frozenset({0, 1}), frozenset({0})]
    assert op_keys(rec, 0, frozenset({0, 1})) == ("aten.mm.default#0", "aten.relu.default#0")


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
    assert chain().forward_ops[0] == ForwardOp("aten.mm.default", (0,))
