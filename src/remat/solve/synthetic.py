"""Synthetic profiles for solver tests and the solve-time benchmark (no torch, no model).

A chain of ``n`` units: unit ``i`` runs forward operators ``2i`` (allocates an activation
saved for backward, ``saved[i]`` bytes) and ``2i+1`` (allocates its output, ``out[i]``
bytes, which the next unit saves). Backward runs the units in reverse, two operators each:
the first reads unit ``i``'s saved tensors and allocates the gradient of its input, the
second frees unit ``i``'s activation and the gradient of its output. Optionally each unit
``i`` contains a child unit ``i.sub`` that owns part of its activation.
"""

from __future__ import annotations

import random

from remat.costs.unit_costs import Drop, Profile, UnitCost


def chain_profile(
    saved: list[int],
    out: list[int],
    recompute_s: list[float],
    *,
    fixed_bytes: int = 0,
    optimizer_step_bytes: int = 0,
    nested_fraction: float | None = None,
) -> Profile:
    """A chain profile with the given per-unit sizes (bytes) and recompute times (seconds)."""
    n = len(saved)
    fwd_ops = 2 * n + 1  # + the loss
    events: list[tuple[int, int, int]] = []  # (alloc index, free index, bytes)
    bstart = fwd_ops
    r = [bstart + 2 * (n - 1 - i) for i in range(n)]  # first backward operator of unit i
    total = bstart + 2 * n
    for i in range(n):
        events.append((2 * i, r[i] + 2, saved[i]))  # activation: until unit i's backward ends
        free_out = r[i + 1] + 2 if i + 1 < n else bstart + 1  # output: saved by unit i+1 (last: by the loss)
        events.append((2 * i + 1, free_out, out[i]))
        events.append((r[i], (r[i - 1] + 2) if i > 0 else total, out[i - 1] if i > 0 else 0))  # input grad
    live = [0] * total
    for a, f, b in events:
        for t in range(a, min(f, total)):
            live[t] += b
    units = []
    for i in range(n):
        units.append(UnitCost(
            name=f"u{i}", parent=None, forward_s=recompute_s[i], recompute_s=recompute_s[i],
            backward_s=None, flops=0, forward_start=2 * i, forward_end=2 * i + 1, recompute_at=r[i],
            drops=(Drop(saved[i], 2 * i + 2),), recompute_peak_bytes=saved[i] + out[i], saved_bytes=saved[i],
        ))
        if nested_fraction is not None:
            part = int(saved[i] * nested_fraction)
            units.append(UnitCost(
                name=f"u{i}.sub", parent=f"u{i}", forward_s=recompute_s[i] * nested_fraction,
                recompute_s=recompute_s[i] * nested_fraction, backward_s=None, flops=0,
                forward_start=2 * i, forward_end=2 * i, recompute_at=r[i], drops=(Drop(part, 2 * i + 1),),
                recompute_peak_bytes=part, saved_bytes=part,
            ))
    zeros = tuple(0 for _ in live)
    return Profile(
        units=tuple(units), live_bytes=tuple(live), grad_bytes=zeros, saved_bytes=zeros, backward_start=bstart,
        params_bytes=fixed_bytes, grads_bytes=0, buffers_bytes=0, inputs_bytes=0, optimizer_state_bytes=0,
        optimizer_step_bytes=optimizer_step_bytes, forward_s=sum(recompute_s), backward_s=2 * sum(recompute_s),
        optimizer_s=0.0, device="synthetic", capture_path="synthetic", memory_recorded_with="synthetic",
        optimizer="none",
    )


def random_chain_profile(n: int, seed: int = 0, *, nested: bool = False) -> Profile:
    """A chain of ``n`` units with random sizes (1-64 MiB) and recompute times (1-20 ms)."""
    rng = random.Random(seed)
    mib = 2**20
    return chain_profile(
        [rng.randint(1, 64) * mib for _ in range(n)],
        [rng.randint(1, 8) * mib for _ in range(n)],
        [rng.uniform(1e-3, 2e-2) for _ in range(n)],
        fixed_bytes=rng.randint(0, 256) * mib,
        nested_fraction=0.5 if nested else None,
    )
