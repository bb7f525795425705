"""What holds a plan's predicted peak: its breakdown by category and the largest tensors alive then.

In: a :class:`remat.costs.simulate.MemoryModel` (its profile, candidate units and rows) and a plan. Out: a
:class:`PeakBreakdown` (the peak's bytes by category, where in the step it happens, and the
:class:`HeldTensor` list that holds it: Note [What holds the peak]); ``fmt_bytes`` to print bytes. And the
list of tensors that needs, from a :class:`~remat.costs.recording.Recording`: ``largest_tensors`` (the
``Profile.tensors`` that ``remat.profile`` stores; re-exported by ``remat.costs.effects``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

from remat.costs.memory_rows import Row
from remat.costs.recording import Recording
from remat.costs.unit_costs import Profile, TensorInfo, UnitCost, inner_unit


@dataclass(frozen=True)
class HeldTensor:
    """Something alive at a plan's predicted peak (Note [What holds the peak])."""

    #: "parameters", "gradients", "optimizer state" (the whole category), or "tensor" (one storage)
    kind: str
    nbytes: int
    #: a tensor's shape and dtype, the operator and innermost module that made it ("" for a category)
    shape: tuple[int, ...] = ()
    dtype: str = ""
    op: str = ""
    module: str = ""
    #: some plan could free it (saved inside a candidate unit); False: no checkpointing plan can
    freeable: bool = False
    #: why no plan frees it, or which units would
    why: str = ""

    def __str__(self) -> str:
        if self.kind != "tensor":
            return f"{self.kind}: {fmt_bytes(self.nbytes)} (no checkpointing plan frees them)"
        op = self.op.removeprefix("aten.").removesuffix(".default")
        made = f"{op} in {self.module}" if op and self.module else (op or "backward")
        return (f"{fmt_bytes(self.nbytes)} {self.dtype} {list(self.shape)} ({made}): "
                f"{'freeable' if self.freeable else 'no plan frees it'}, {self.why}")


def fmt_bytes(n: int | float) -> str:
    """Human-readable bytes (GiB above 1 GiB, else MiB); ``remat.solve.plan.fmt_bytes`` for the public one."""
    return f"{n / 2**30:.3f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


#: how many tensors the breakdown names (Note [What holds the peak])
HELD_TENSORS = 5


@dataclass(frozen=True)
class PeakBreakdown:
    """Where the bytes of a predicted peak go. All fields in bytes except ``phase``/``index``."""

    #: the predicted peak (bytes): the sum of the parts below
    total_bytes: int
    #: parameters
    params_bytes: int
    #: gradients alive at the peak
    grads_bytes: int
    #: the optimizer's state
    optimizer_state_bytes: int
    #: buffers
    buffers_bytes: int
    #: the batch
    inputs_bytes: int
    #: activations saved for backward and alive at the peak
    saved_activations_bytes: int
    #: everything else alive at the peak (outputs, gradients of activations, recomputed tensors)
    temporaries_bytes: int
    #: where in the step the peak happens, e.g. "backward" or "recompute of h.3"
    phase: str
    #: the timeline index (operator) of the peak
    index: int
    #: what holds the peak, largest first: parameters, gradients, optimizer state and the largest tensors
    #: alive then, each saying whether a plan could free it (Note [What holds the peak]); empty when the
    #: profile has no tensor list
    largest: tuple[HeldTensor, ...] = ()
    #: the libraries' workspaces held all step (``Profile.workspace_bytes``: cuBLAS's on CUDA)
    workspace_bytes: int = 0

    @property
    def unfreeable_bytes(self) -> int:
        """Bytes of ``largest`` (not of the whole peak) that no checkpointing plan frees."""
        return sum(h.nbytes for h in self.largest if not h.freeable)


class PeakExplainer:
    """The explaining half of :class:`remat.costs.simulate.MemoryModel` (a base class of it): where the bytes of
    a plan's predicted peak go. Reads the model's ``profile``, ``units``, ``rows`` and ``offloads`` and uses its
    ``assignment``, ``row_bytes`` and ``_coefs``."""

    profile: Profile
    units: dict[str, UnitCost]
    rows: tuple[Row, ...]
    offloads: dict

    def breakdown(self, plan: Iterable[str]) -> PeakBreakdown:
        """The predicted peak of ``plan`` split by category."""
        chosen = self.assignment(plan)
        p = self.profile
        row = max(self.rows, key=lambda r: self.row_bytes(r, chosen))
        total = self.row_bytes(row, chosen)
        i = row.index
        grads = p.grad_bytes[i] if p.live_bytes else 0
        effects = self._coefs(i)
        saved = (p.saved_bytes[i] if p.live_bytes else 0) + sum(effects.get(v, 0) for v in chosen)
        phase = row.phase if row.unit is None or row.unit not in chosen else f"recompute of {row.unit}"
        if phase == "recompute":
            phase = "backward"
        temporaries = total - p.fixed_bytes - grads - saved
        return PeakBreakdown(
            total_bytes=total,
            params_bytes=p.params_bytes,
            grads_bytes=grads,
            optimizer_state_bytes=p.optimizer_state_bytes,
            buffers_bytes=p.buffers_bytes,
            inputs_bytes=p.inputs_bytes,
            saved_activations_bytes=saved,
            temporaries_bytes=temporaries,
            phase=phase,
            index=i,
            largest=self.held_at(i, chosen, grads),
            workspace_bytes=p.workspace_bytes,
        )

    @functools.cached_property
    def _droppers(self) -> dict[int, list[str]]:
        """Per recorded storage, the candidate units that drop it (Note [What holds the peak])."""
        out: dict[int, list[str]] = {}
        for u in self.units.values():
            for d in u.drops:
                if d.storage is not None:
                    out.setdefault(d.storage, []).append(u.name)
        return out

    def held_at(self, i: int, chosen: frozenset[str], grads: int) -> tuple[HeldTensor, ...]:
        """Note [What holds the peak]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A least peak says only "temporaries 491 MiB" until it names what they are. Issue #23 guessed the
        logits (4 x 256 x 50,304 fp32, 196 MiB) at GPT-2 small size; the breakdown shows that with the
        weight-tied head the least peak (every block's) comes in backward, where the head's and the
        embedding's gradient contributions to the tied weight (two 50,304 x 768 fp32 tensors, 147 MiB each)
        are alive with the parameters, gradients and AdamW state: no checkpointing plan removes any of them
        (benchmarks/results/gpt2-small-cpu.md).
        At the peak's operator ``i`` the breakdown lists the fixed categories (parameters, optimizer state,
        gradients then alive) and the HELD_TENSORS largest of the profile's tensors (``Profile.tensors``)
        alive there with the plan's drops taken out, each with the operator and module that made it and
        whether some plan could free it: a storage some candidate unit drops (saved inside it, freed until
        its recomputation) is freeable; a gradient, a tensor made outside every module (the loss) or one no
        candidate drops (a unit's output, the head's logits) is not. Tensors a recomputation makes again
        are not in the recording: they are in ``temporaries``."""
        p = self.profile
        if not p.tensors:
            return ()
        droppers = self._droppers
        dropped: set[int] = set()
        for v in chosen:
            if v in self.offloads:  # Note [Offload in the memory model]
                dropped |= self.offloads[v].gone_at(i)
                continue
            u = self.units[inner_unit(v)]
            for d in u.drops:
                until = d.until_index if d.until_index is not None else u.recompute_at
                if d.storage is not None and d.free_from <= i and (until is None or i < until):
                    dropped.add(d.storage)
        alive = [t for t in p.tensors if t.alloc_index <= i and (t.free_index is None or i < t.free_index)
                 and t.storage not in dropped and not t.is_grad]
        shaped_like: dict[tuple[int, ...], str] = {}
        for name, shape in p.parameter_shapes:
            shaped_like.setdefault(shape, name)
        held = [HeldTensor("parameters", p.params_bytes), HeldTensor("optimizer state", p.optimizer_state_bytes),
                HeldTensor("gradients", grads)]
        for t in alive[:HELD_TENSORS]:
            units = droppers.get(t.storage, [])
            if units:
                why = "saved inside " + ", ".join(sorted(units, key=len)[:3])
            elif t.alloc_index >= p.backward_start and (like := shaped_like.get(t.shape)):
                why = (f"a gradient made in backward shaped like parameter {like} (a contribution to a weight "
                       "used more than once, e.g. a tied embedding and head, before autograd sums it into .grad)")
            elif t.alloc_index >= p.backward_start:
                why = "an activation's gradient, made in backward"
            elif not t.module:
                why = "made outside every candidate unit (the model's own code or the loss)"
            else:
                why = f"not saved inside any candidate unit ({t.module}'s output, or a module no plan checkpoints)"
            held.append(HeldTensor("tensor", t.nbytes, t.shape, t.dtype, t.op, t.module, bool(units), why))
        return tuple(sorted((h for h in held if h.nbytes), key=lambda h: -h.nbytes))


def largest_tensors(rec: Recording, n: int = 64) -> tuple[TensorInfo, ...]:
    """The ``n`` largest storages of the step with the operator and innermost module that made them (Note
    [What holds the peak])."""
    made_by = {s: i for i, op in enumerate(rec.forward_ops) for s in op.created if s is not None}
    spans = [(a, b, name) for name, ss in rec.spans.items() for a, b in ss]
    out = []
    for s in sorted(range(len(rec.storages)), key=lambda k: (-rec.storages[k].nbytes, k))[:n]:
        st = rec.storages[s]
        i = made_by.get(s)
        inside = [(b - a, name) for a, b, name in spans if a <= st.alloc_index <= b] if i is not None else []
        out.append(TensorInfo(
            storage=s, nbytes=st.nbytes, alloc_index=st.alloc_index, free_index=st.free_index, shape=st.shape,
            dtype=st.dtype, op="" if i is None else rec.forward_ops[i].name,
            module=min(inside)[1] if inside else "", is_grad=st.is_grad))
    return tuple(out)
