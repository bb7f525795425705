"""remat.costs.effects.unit_costs on hand-written recordings: what checkpointing a unit frees, holds and
recomputes, rule by rule (Note [Memory model] in remat.costs.simulate). No torch, milliseconds."""

from __future__ import annotations

import dataclasses

import pytest

from remat.costs.unit_costs import CallSpan, Drop, Keep
from remat.costs.effects import UnitSpec, unit_costs
from remat.costs.recording import CheckpointOverhead, ForwardOp, SavedTensor, Storage, UnitTimes, Write

from recordings import A, chain




def test_a_storage_saved_only_inside_the_unit_is_dropped_until_the_recomputation():
    rec = chain()
    assert rec.timeline() == (100, 150, 160, 160, 160, 160, 160, 110, 10, 0)
    (u,) = unit_costs(rec, [A])
    # freed after its last forward use (op 1), alive again when backward first reads it (op 7)
    assert u.drops == (Drop(100, free_from=2),)
    assert u.recompute_at == 7 and u.drop_until(u.drops[0]) == 7
    # the recomputation reruns ops 0-1: 150 bytes on top of what was alive before the unit (0)
    assert u.recompute_peak_bytes == 150
    assert u.saved_bytes == 100 and u.flops == 1000 and u.excluded is None and u.keeps == ()
    assert u.calls == 1 and u.later_calls == () and u.recompute_end == 1


def test_a_storage_the_plain_step_never_frees_is_not_dropped():
    """Note [Held storages]: held by something besides autograd (the output, a module attribute)."""
    rec = chain(storages=(Storage(100, 0, None), Storage(50, 1, 7), Storage(10, 2, 9)))
    (u,) = unit_costs(rec, [A])
    assert u.drops == ()


def test_a_storage_also_saved_outside_lives_until_the_outside_reader_is_done():
    """Note [Shared saved storages]."""
    outside = SavedTensor(0, (), (), at=3, unpacked_at=5)
    (u,) = unit_costs(chain(saved=chain().saved + (outside,)), [A])
    assert u.drops == (Drop(100, free_from=6),)
    never_read = dataclasses.replace(outside, unpacked_at=None)
    (u,) = unit_costs(chain(saved=chain().saved + (never_read,)), [A])
    assert u.drops == ()  # the outside saver keeps it all step


def test_the_units_output_saved_inside_and_outside_is_dropped_once_the_outside_reader_is_done():
    """s1, made by the unit's last operator (a ReLU saving its result), is also saved by the loss outside it:
    dropped from just after the loss's backward reads it (6) until the unit's recomputation (8), like any
    storage saved inside and outside (Note [Shared saved storages]). (It was once kept: that made the ResNet
    zoo model's segments exact only because the recomputation's growth missed the free at their start, Note
    [Growth of a recomputation]; with both fixed, every ResNet unit's prediction is its measured peak.)"""
    rec = chain(storages=(Storage(100, 0, 9), Storage(50, 1, 9), Storage(10, 2, 9)),
                saved=(SavedTensor(0, ("a",), (1,), at=2, unpacked_at=8), SavedTensor(1, (), (), at=3, unpacked_at=6),
                       SavedTensor(1, ("a",), (1,), at=2, unpacked_at=8)))
    (u,) = unit_costs(rec, [A])
    assert u.recompute_at == 8 and u.drops == (Drop(100, free_from=2), Drop(50, free_from=7))


def _freed_at_the_start(inputs):
    """op 0 (outside) makes s0 (40 B), which dies as unit ``b`` starts (op 1: the previous residual's addend);
    b's ops 1-2 make s1 (100 B, saved by op 2) and s2 (50 B, saved by the loss, op 3, which makes s3)."""
    return chain(
        storages=(Storage(40, 0, 1), Storage(100, 1, 8), Storage(50, 2, 7), Storage(10, 3, 9)),
        saved=(SavedTensor(1, ("b",), (1,), at=3, unpacked_at=7), SavedTensor(2, (), (), at=4, unpacked_at=6)),
        forward_ops=(ForwardOp("aten.add.default", (0,)), ForwardOp("aten.mm.default", (1,)),
                     ForwardOp("aten.relu.default", (2,)), ForwardOp("aten.sum.default", (3,))),
        spans={"b": ((1, 2),)}, calls={"b": 1}, inputs={"b": (inputs,)}, last_use={0: 1, 1: 2, 2: 3},
        flops={"b": 0})


def test_a_free_outside_the_unit_as_it_starts_is_not_part_of_its_recomputation():
    """Note [Growth of a recomputation]: the plain forward grows by 150 - 40 over ops 1-2 because s0 dies as
    the unit starts; its recomputation in backward frees nothing of the sort and grows by the 150 bytes its
    operators make. When s0 is the unit's input, the checkpoint holds it instead (a Keep) and it is not
    added again."""
    B = UnitSpec("b", ("b",), None, "b.")
    rec = _freed_at_the_start(inputs=())
    assert rec.timeline()[:3] == (40, 100, 150)
    (u,) = unit_costs(rec, [B])
    assert u.freed_outside == ((1, 40),) and u.recompute_peak_bytes == 150
    (u,) = unit_costs(_freed_at_the_start(inputs=(0,)), [B])
    assert u.freed_outside == () and u.recompute_peak_bytes == 110 and u.keeps == (Keep(40, 1, 8),)


def test_checkpoint_holds_its_inputs_until_the_units_backward_is_done():
    """Note [Checkpoint holds its inputs]: s1 is an input of unit ``b`` (op 2); the plain step frees it at
    7, but b's checkpoint holds it until b's last saved tensor is read back (op 8), i.e. until 9."""
    rec = chain(spans={"a": ((0, 1),), "b": ((2, 2),)}, calls={"a": 1, "b": 1},
                inputs={"a": ((),), "b": ((1,),)},
                saved=(SavedTensor(0, ("a",), (1,), 2, 7), SavedTensor(1, ("b",), (1,), 3, 8)))
    (b,) = unit_costs(rec, [UnitSpec("b", ("b",), None, "b.")])
    assert b.keeps == (Keep(50, from_index=7, until_index=9),)
    assert b.drops == ()  # s1 was made before b: b does not free it


def test_writes_decide_exclusion_and_buffer_replay():
    inplace_param = Write(("a",), None, ("param", "w"), "aten.add_.Tensor")
    (u,) = unit_costs(chain(writes=(inplace_param,)), [A])
    assert u.excluded == "modifies a tensor from outside the unit in place (param w, aten.add_.Tensor)"
    own_buffer = Write(("a",), None, ("buffer", "a.bn.running_mean"), "aten.add_.Tensor")
    (u,) = unit_costs(chain(writes=(own_buffer,)), [A])
    assert u.excluded is None and u.mutated_buffers == ("bn.running_mean",)
    earlier = Write(("a",), 1, None, "aten.relu_.default")  # s1 exists before unit ``b`` (op 2) starts
    rec = chain(spans={"a": ((0, 1),), "b": ((2, 2),)}, calls={"a": 1, "b": 1}, writes=(
        dataclasses.replace(earlier, stack=("b",)),))
    (b,) = unit_costs(rec, [UnitSpec("b", ("b",), None, "b.")])
    assert b.excluded == "modifies its input in place (aten.relu_.default)"


def test_a_module_called_again_in_backward_is_excluded():
    (u,) = unit_costs(chain(calls={"a": 2}), [A])
    assert u.excluded == "called 2 times per step, 1 in forward"


def test_a_selective_unit_keeps_what_its_policy_keeps():
    """Keeping op 0's output (s0) drops nothing and caches s0 until the recomputation; the recomputation
    reuses it, so it adds only s1."""
    (u,) = unit_costs(chain(), [UnitSpec("a@ops1", ("a",), None, "a.", keep=frozenset({0}),
                                         saved_ops=("aten.mm.default#0",))])
    assert u.drops == ()
    assert u.keeps == ()  # the plain step keeps s0 until 8 anyway, past the recomputation at 7
    assert u.recompute_peak_bytes == 50
    assert u.saved_ops == ("aten.mm.default#0",) and not u.is_segment


def test_early_stop_limits_the_recomputation_to_the_last_saved_tensor():
    """Note [Early stop]: the last tensor saved inside the unit is saved by op 1 (at=2), so an op 2 inside
    the unit is not recomputed and does not count in the recomputation's peak."""
    rec = chain(spans={"a": ((0, 2),)})
    (u,) = unit_costs(rec, [A])
    assert u.recompute_end == 1 and u.recompute_peak_bytes == 150  # not 160


def test_a_reused_module_is_checkpointed_call_by_call():
    """Note [Reused modules]: module ``m`` runs twice (ops 0 and 1); each call's saved storage is freed
    until that call's own recomputation."""
    rec = chain(spans={"m": ((0, 0), (1, 1))}, calls={"m": 2}, inputs={"m": ((), ())},
                saved=(SavedTensor(0, ("m",), (1,), 1, 7), SavedTensor(1, ("m",), (2,), 2, 6)),
                storages=(Storage(100, 0, 8), Storage(50, 1, 7), Storage(10, 2, 9)), last_use={0: 0, 1: 1})
    (m,) = unit_costs(rec, [UnitSpec("m", ("m",), None, "m.")])
    assert m.calls == 2
    assert m.drops == (Drop(100, 1, until_index=7), Drop(50, 2, until_index=6))
    assert m.later_calls == (CallSpan(1, 1, 6, 50),)
    assert m.recomputations == ((7, 100), (6, 50))


def test_a_segment_runs_its_members_as_one_unit():
    rec = chain(spans={"s.0": ((0, 0),), "s.1": ((1, 1),)}, calls={"s.0": 1, "s.1": 1},
                inputs={"s.0": ((),), "s.1": ((0,),)},
                saved=(SavedTensor(0, ("s.1",), (1,), 2, 7), SavedTensor(1, (), (), 3, 6)), flops={})
    (seg,) = unit_costs(rec, [UnitSpec("s[0:2]", ("s.0", "s.1"), None, "s.")])
    assert seg.is_segment and seg.members == ("s.0", "s.1")
    assert (seg.forward_start, seg.forward_end) == (0, 1)
    assert seg.drops == (Drop(100, 2),)  # s0 is made inside the segment (by s.0), so it is dropped


def test_times_and_overhead_come_from_the_measurements():
    times = UnitTimes(forward_s={"a": 0.004}, recompute_s={"a": 0.003}, backward_s={"a": 0.008},
                      mutated_buffers={"a": ("bn.running_var",)}, step_forward_s=0.01, step_backward_s=0.02)
    overhead = CheckpointOverhead(per_call_s=1e-4, per_saved_tensor_s=1e-5, per_selective_op_s=1e-6)
    (u,) = unit_costs(chain(), [A], times=times, overhead=overhead, buffer_bytes={"a.bn.running_var": 64})
    assert (u.forward_s, u.recompute_s, u.backward_s) == (0.004, 0.003, 0.008)
    assert u.overhead_s == pytest.approx(1e-4 + 1e-5)  # one call, one saved tensor
    assert u.mutated_buffers == ("bn.running_var",)
    # the checkpoint holds a snapshot of the buffer it replays, from the unit's start until its backward ends
    assert u.keeps == (Keep(64, from_index=0, until_index=8),)
    # Note [Recomputation transients]: its recomputation holds the buffer's value to put back (64 B) and,
    # with an RNG state to copy, that copy too
    assert u.recompute_extra_bytes == 64
    (rng,) = unit_costs(chain(), [A], times=times, overhead=dataclasses.replace(overhead, held_bytes=5056),
                        buffer_bytes={"a.bn.running_var": 64})
    assert rng.recompute_extra_bytes == 64 + 5056
    (sel,) = unit_costs(chain().with_op_seconds({0: 0.003, 1: 0.001}), [
        UnitSpec("a@ops1", ("a",), None, "a.", keep=frozenset({0}))], times=times, overhead=overhead)
    assert sel.recompute_s == pytest.approx(0.003 * 0.25)  # only relu (a quarter of the op time) runs again
    assert sel.overhead_s == pytest.approx(1e-4 + 1e-5 + 2 * 1e-6)


def test_recordings_are_immutable_and_corrections_make_new_ones():
    rec = chain()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.n_ops = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        rec.spans["b"] = ((0, 0),)  # type: ignore[index]
    bigger = rec.with_sizes({0: 200})
    assert bigger.timeline()[0] == 200 and rec.timeline()[0] == 100
    assert rec.before_bytes() == (0, 100, 150, 160, 160, 160, 160, 110, 10, 0)
    assert rec.saved_timeline() == (100, 150, 150, 150, 150, 150, 150, 100, 0, 0)
