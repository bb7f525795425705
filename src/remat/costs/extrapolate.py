"""Profiles at sizes never run: fitted from profiles of the same step at a few sizes (no torch).

Note [Profiles by size]
~~~~~~~~~~~~~~~~~~~~~~~
Growing the batch (or the sequence) changes how big the step's tensors are and how long its operators
run, not which operators run or which tensors they save: the recorded timelines of two sizes have the
same length, the same units at the same timeline indices, the same drops and keeps. Only the numbers
differ. So a profile at any size ``n`` is fitted number by number from profiles at a few sizes: through
two sizes a line (activations, gradients of inputs and step times grow linearly with the batch; the
parameters, their gradients and the optimizer state do not change), through three a parabola (attention
scores grow with the square of the sequence length). ``max_batch`` profiles two sizes for the batch and
three for the sequence, plans every other size on fitted profiles, and confirms its answer with real
steps (remat.sweeps.sizing). Where the structure differs between sizes (data-dependent graphs, a selective menu
that changes with the sizes), the unit or the whole fit is refused, never guessed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from remat.costs.unit_costs import Drop, Keep, Profile, UnitCost
from remat.errors import UnsupportedError


def _lagrange(sizes: Sequence[int], n: float) -> list[float]:
    """Weights ``w`` such that ``sum(w[i] * f(sizes[i]))`` is the polynomial through the points, at ``n``."""
    out = []
    for i, xi in enumerate(sizes):
        w = 1.0
        for j, xj in enumerate(sizes):
            if j != i:
                w *= (n - xj) / (xi - xj)
        out.append(w)
    return out


class ProfileFit:
    """Profiles of one step at several sizes; ``at(n)`` is the profile fitted at size ``n``."""

    def __init__(self, profiles: Mapping[int, Profile]) -> None:
        if len(profiles) < 2:
            raise UnsupportedError(f"a fit needs profiles at two sizes or more, got {sorted(profiles)}")
        self.sizes = tuple(sorted(profiles))
        self.profiles = tuple(profiles[s] for s in self.sizes)
        first = self.profiles[0]
        lengths = {len(p.live_bytes) for p in self.profiles}
        if len(lengths) > 1 or len({p.backward_start for p in self.profiles}) > 1:
            raise UnsupportedError(
                f"the step runs different operators at sizes {list(self.sizes)} (timelines of {sorted(lengths)} "
                "operators): its profile cannot be fitted across sizes (Note [Profiles by size]); profile each size")
        by_name = [{u.name: u for u in p.units} for p in self.profiles]
        #: units with the same structure at every size (the others are left out of fitted profiles)
        self.units = tuple(u.name for u in first.units if all(u.name in b and _shape(b[u.name]) == _shape(u)
                                                              for b in by_name))
        self.left_out = tuple(u.name for u in first.units if u.name not in self.units)
        self._by_name = by_name

    def at(self, n: int) -> Profile:
        """The profile fitted at size ``n``: every byte count rounded up, nothing below zero, and no time below
        the one measured at the largest profiled size not above ``n`` (Note [Fitted times])."""
        w = _lagrange(self.sizes, n)
        below = [i for i, s in enumerate(self.sizes) if s <= n]

        def num(values: Sequence[float], integer: bool) -> float:
            v = sum(wi * x for wi, x in zip(w, values))
            if integer:
                return max(0, math.ceil(v - 1e-9))
            # Note [Fitted times]: a larger step does not run faster, but timings on a busy machine can say
            # so (batch 4 measured faster than batch 2), and a line through them falls to zero further on
            return max(0.0, v, values[below[-1]] if below else 0.0)

        def series(values: Sequence[Sequence[int] | None]) -> tuple[int, ...] | None:
            if any(v is None for v in values):
                return None
            return tuple(int(num(col, True)) for col in zip(*values))

        ps = self.profiles
        units = tuple(self._unit(name, num) for name in self.units)
        fields = {}
        for f in ("params_bytes", "grads_bytes", "buffers_bytes", "inputs_bytes", "optimizer_state_bytes",
                  "optimizer_step_bytes"):
            fields[f] = int(num([getattr(p, f) for p in ps], True))
        for f in ("forward_s", "backward_s", "optimizer_s"):
            fields[f] = num([getattr(p, f) for p in ps], False)
        after = [p.after_backward_bytes for p in ps]
        return dataclasses.replace(
            ps[0], units=units, **fields,
            live_bytes=series([p.live_bytes for p in ps]), grad_bytes=series([p.grad_bytes for p in ps]),
            saved_bytes=series([p.saved_bytes for p in ps]), before_bytes=series([p.before_bytes for p in ps]),
            after_backward_bytes=None if None in after else int(num(after, True)),
            tensors=(),  # the measured sizes' tensors, not this size's: a fitted breakdown names none
            notes=ps[0].notes + (f"fitted at size {n} from profiles at sizes {list(self.sizes)} "
                                 "(Note [Profiles by size] in remat.costs.extrapolate)",))

    def _unit(self, name: str, num) -> UnitCost:
        us = [b[name] for b in self._by_name]
        u = us[0]

        def ints(get) -> int:
            return int(num([get(x) for x in us], True))

        def secs(get) -> float:
            return num([get(x) for x in us], False)

        return dataclasses.replace(
            u, forward_s=secs(lambda x: x.forward_s), recompute_s=secs(lambda x: x.recompute_s),
            backward_s=None if any(x.backward_s is None for x in us) else secs(lambda x: x.backward_s),
            flops=ints(lambda x: x.flops), overhead_s=secs(lambda x: x.overhead_s),
            recompute_peak_bytes=ints(lambda x: x.recompute_peak_bytes), saved_bytes=ints(lambda x: x.saved_bytes),
            drops=tuple(Drop(ints(lambda x, k=k: x.drops[k].nbytes), d.free_from, d.until_index, op=d.op)
                        for k, d in enumerate(u.drops)),
            keeps=tuple(Keep(ints(lambda x, k=k: x.keeps[k].nbytes), kp.from_index, kp.until_index)
                        for k, kp in enumerate(u.keeps)),
            later_calls=tuple(dataclasses.replace(c, recompute_peak_bytes=ints(
                lambda x, k=k: x.later_calls[k].recompute_peak_bytes)) for k, c in enumerate(u.later_calls)),
            freed_outside=tuple((f, ints(lambda x, k=k: x.freed_outside[k][1]))
                                for k, (f, _) in enumerate(u.freed_outside)),
        )


def _shape(u: UnitCost) -> tuple:
    """What must agree between sizes for a unit to be fitted: everything but the numbers."""
    return (u.forward_start, u.forward_end, u.recompute_at, u.recompute_end, u.excluded, u.saved_ops,
            tuple((d.free_from, d.until_index) for d in u.drops),
            tuple((k.from_index, k.until_index) for k in u.keeps),
            tuple((c.forward_start, c.forward_end, c.recompute_at) for c in u.later_calls),
            tuple(f for f, _ in u.freed_outside))

