"""Profiles fitted across sizes (remat.costs.extrapolate), on synthetic profiles: no torch, milliseconds."""

from __future__ import annotations

import dataclasses

from remat.costs.extrapolate import ProfileFit
from remat.solve.synthetic import chain_profile


def sized(n: int, seconds_per_sample: float):
    mib = 2**20
    p = chain_profile([n * mib] * 3, [n * mib // 4] * 3, [n * seconds_per_sample] * 3)
    return p


def test_fitted_times_never_fall_below_a_smaller_size_timed():
    """Timing noise on a busy machine (the step at batch 4 measured faster than at batch 2) must not fit a
    step time of zero or less at a larger size: max_batch divides by it (a ZeroDivisionError in CI's
    test_max_batch before). A fitted time is at least the time measured at the largest smaller size."""
    small, large = sized(2, 0.010), sized(4, 0.010)
    large = dataclasses.replace(large, forward_s=small.forward_s / 3, backward_s=small.backward_s / 3,
                                units=tuple(dataclasses.replace(u, forward_s=u.forward_s / 6,
                                                                recompute_s=u.recompute_s / 6)
                                            for u in large.units))
    fit = ProfileFit({2: small, 4: large})
    for n in (8, 16, 64):
        p = fit.at(n)
        assert p.step_time_s >= large.step_time_s > 0
        for u, big in zip(p.units, large.units):
            assert u.recompute_s >= big.recompute_s > 0 and u.forward_s >= big.forward_s


def test_fitted_times_grow_with_the_size_when_measured_so():
    fit = ProfileFit({2: sized(2, 0.01), 4: sized(4, 0.01)})
    assert abs(fit.at(8).step_time_s - sized(8, 0.01).step_time_s) < 1e-9
    assert fit.at(8).live_bytes == sized(8, 0.01).live_bytes
