"""remat.max_batch: the largest and the fastest batch under a budget (Note [Max batch] in remat.sweeps.sizing)."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.examples import make_gpt
from remat.costs.extrapolate import ProfileFit
from remat.solve import Planner

MiB = 2**20
SMALL = dict(layers=2, d_model=64, heads=4, seq_len=32, vocab=256)


def make_batch(n):
    return make_gpt(batch_size=n, **SMALL)[1]


def state_of(model):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()},
            {n: m.__dict__.get("forward") for n, m in model.named_modules()}, torch.get_rng_state())


@pytest.fixture(scope="module")
def report():
    model, _, _ = make_gpt(batch_size=2, **SMALL)
    before = state_of(model)
    r = remat.max_batch(model, 10 * MiB / 2**30, make_batch, optimizer=torch.optim.AdamW(model.parameters()),
                        repeats=1)
    after = state_of(model)
    assert all(torch.equal(before[0][n], after[0][n]) for n in before[0])
    assert before[1] == after[1] and before[2] == after[2] and torch.equal(before[3], after[3])
    return r


def test_the_answer_fits_as_measured_and_the_next_size_is_refused(report):
    top = report.row(report.max_size)
    assert top.fits and top.source == "profiled" and top.plan is report.max_plan
    assert top.measured_peak_bytes <= report.budget_bytes
    # the search went past the profiled sizes (2, 4) on fitted profiles
    assert report.max_size > 4
    refused = report.rows[-1]
    assert refused.size == report.max_size + 1 and not refused.fits and refused.plan is None
    assert refused.least_peak_bytes > report.budget_bytes  # the least peak it would need, measured
    assert refused.why == "its least measured peak is over the budget"
    # the least peaks of sizes refused on real steps are measured ones; of a size whose plan measured within the
    # budget, the plan's own (measured where the least-memory plan's step ran: Note [Least peak is a promise]); the
    # others predicted; each labelled so
    assert refused.least_peak_measured
    assert top.least_peak_measured == top.plan.min_peak_checked and top.least_peak_bytes == top.plan.min_peak_bytes
    assert [r.least_peak_measured for r in report.rows if r.source == "fitted"] == \
        [False for r in report.rows if r.source == "fitted"] != []
    assert "m: measured on real steps, else predicted" in str(report)
    assert report.best_size in [r.size for r in report.rows if r.fits]
    best = report.row(report.best_size)
    assert best.measured_samples_per_s == max(r.measured_samples_per_s for r in report.rows if r.fits)
    assert "largest batch that fits" in str(report)


def test_fitted_profiles_match_real_ones():
    """Note [Profiles by size]: fitted from batches 2 and 4, the profile at 8 predicts the same peaks as the
    one recorded at 8 (no checkpointing, every block, least) within 1%."""
    def profile(n):
        model, inputs, _ = make_gpt(batch_size=n, **SMALL)
        return remat.make_profile(model, inputs)

    fit = ProfileFit({2: profile(2), 4: profile(4)})
    fitted, real = Planner(fit.at(8), granularity="block"), Planner(profile(8), granularity="block")
    for a, b in ((fitted.baseline_peak_bytes, real.baseline_peak_bytes), (fitted.min_peak_bytes, real.min_peak_bytes),
                 (fitted.every_nth_block(1).predicted_peak_bytes, real.every_nth_block(1).predicted_peak_bytes)):
        assert abs(a - b) <= 0.01 * b


def test_arguments_are_checked():
    model, _, _ = make_gpt(batch_size=2, **SMALL)
    with pytest.raises(remat.InvalidInputError, match="dim must be"):
        remat.max_batch(model, 1.0, make_batch, dim="width")
    with pytest.raises(remat.InvalidInputError, match="profile_sizes"):
        remat.max_batch(model, 1.0, make_batch, profile_sizes=(4,))
    with pytest.raises(remat.InfeasibleBudgetError, match="even the smallest batch size profiled, 2"):
        remat.max_batch(model, 1 * MiB / 2**30, make_batch)


def test_a_size_the_model_refuses_ends_the_search():
    """A model that takes at most 6 positions: the search stops below the first size it fails on, which is the
    refused row, with the model's error as the reason (not a crash of max_batch)."""
    class Positions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = torch.nn.Parameter(torch.randn(6, 8))
            self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))

        def forward(self, x):
            return self.mlp(x + self.pos[: x.shape[1]].expand_as(x))

    model = Positions()
    report = remat.max_batch(model, 1.0, lambda n: torch.randn(4, n, 8), dim="seq", profile_sizes=(2, 3, 4),
                             max_size=16,
                             repeats=1)
    assert report.max_size == 6 and report.rows[-1].size == 7 and not report.rows[-1].fits
    assert report.rows[-1].why.startswith("size 7 could not run")
