"""Hand-written recordings for the unit tests."""

from __future__ import annotations

from remat.costs.effects import UnitSpec
from remat.costs.recording import ForwardOp, Recording, SavedTensor, Storage


def chain(**changes) -> Recording:
    """Unit ``a`` runs operators 0-1, then operator 2 (the loss) runs outside it; backward is 5-9.

    op 0 (mm, in a) creates s0 (100 B); op 1 (relu, in a) creates s1 (50 B) and saves s0; op 2 (outside)
    creates s2 (10 B) and saves s1. Backward reads s1 back at 6, s0 at 7; s1 dies at 7, s0 at 8, s2 at 9.
    Live bytes after each operator: 100, 150, 160, 160, 160, 160, 160, 110, 10, 0."""
    fields = dict(
        n_ops=10, backward_start=5, after_backward_bytes=0,
        storages=(Storage(100, 0, 8), Storage(50, 1, 7), Storage(10, 2, 9)),
        saved=(SavedTensor(0, ("a",), (1,), at=2, unpacked_at=7), SavedTensor(1, (), (), at=3, unpacked_at=6)),
        forward_ops=(ForwardOp("aten.mm.default", (0,), flops=1000), ForwardOp("aten.relu.default", (1,)),
                     ForwardOp("aten.sum.default", (2,))),
        writes=(), spans={"a": ((0, 1),)}, calls={"a": 1}, inputs={"a": ((),)},
        last_use={0: 1, 1: 2}, flops={"a": 1000},
    )
    fields.update(changes)
    return Recording(**fields)


A = UnitSpec("a", ("a",), None, "a.")
