"""One of a step's largest storages, as its recording saw it (a record of ``Profile.tensors``). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TensorInfo"]


@dataclass(frozen=True)
class TensorInfo:
    """One of the step's largest storages, as the recording saw it (Note [What holds the peak] in
    remat.costs.peak_breakdown)."""

    #: its index in the recording (``Drop.storage``)
    storage: int
    nbytes: int
    #: timeline index of the operator that made it, and of the first after it died (None: alive at the end)
    alloc_index: int
    free_index: int | None
    #: shape and dtype of the first tensor seen on it, e.g. (4, 256, 50304) and "float32"
    shape: tuple[int, ...]
    dtype: str
    #: the operator that made it ("aten.mm.default"; "" when unknown) and the innermost module it ran in
    #: ("" outside every module: the loss, the optimizer)
    op: str
    module: str
    #: a parameter's gradient
    is_grad: bool = False
