"""The largest and the fastest batch (or sequence) under a budget: :func:`max_batch`.

Note [Max batch]
~~~~~~~~~~~~~~~~
"What is the largest batch that fits, and which batch trains fastest?" has an answer per plan: a
larger batch fits when more is recomputed. ``max_batch`` answers it the way the rest of remat
answers a budget: profile a few sizes for real, predict the others (fitted profiles, Note [Profiles
by size] in remat.costs.extrapolate), plan every size predicted, and confirm with real steps:

1. search the sizes on fitted profiles, doubling from the profiled ones, then bisecting, for the
   largest whose best plan is predicted within the budget;
2. profile that size for real and check its plan on a real step (``plan_checked``: Note [Checked
   plans] in remat.api), and the next size up the same way, which must be refused (its least
   *measured* peak over the budget); when a real check disagrees with the prediction, the search goes
   on with real checks only (doubling, then bisecting) until two neighbouring sizes disagree;
3. time real steps with each size's plan (one size per doubling, and the largest): the size with the
   most measured samples per second is the best size. A plan is compared with the hand rules the model
   cannot tell from it in these same rounds, not at every size tried (Note [Plans timed beside the hand
   rules] in remat.api.hand_rules): the rule measured faster is the row's plan, and the notes say so.

Nothing is applied: the model, its checkpointing, gradients, buffers and the RNG state are as they were,
and the user applies the plan they choose with ``apply_plan``.

The search itself and its report are :mod:`remat.sweeps.search`'s (``_Search``, ``SizeRow``, ``BatchSizeReport``:
importable from here too).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from remat._compat import uncompiled
from remat.api import prepare_hf_for_training, validate
from remat.costs.unit_costs import Profile
from remat.errors import InvalidInputError
from remat.runtime.measure import LossFn, default_loss
from remat.rewrite import remove_checkpointing
from remat.runtime.state import preserved
from remat.sweeps.search import BatchSizeReport, SizeRow, _Search

log = logging.getLogger(__name__)

#: how plans are made per size: remat's ILP, or a hand rule (for comparison tables)
STRATEGIES = ("ilp", "every_block", "none")


def max_batch(
    model: nn.Module, budget_gb: float, make_batch: Callable[[int], Any], *, loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None, dim: str = "batch", profile_sizes: tuple[int, ...] | None = None,
    max_size: int = 1 << 16, multiple_of: int = 1, strategy: str = "ilp", granularity: str = "block",
    output_alive: bool = True, repeats: int = 3, time_limit_s: float | None = 60.0,
) -> BatchSizeReport:
    """The largest size ``n`` (of the batch, or with ``dim="seq"`` of the sequence) whose best plan fits
    ``budget_gb`` (GiB of whole-step peak, as in :func:`remat.optimize_checkpointing`), confirmed on a real
    step, and the size that trains the most samples per second (Note [Max batch]).

    ``make_batch(n)`` returns example inputs of size ``n`` (a tensor, a tuple of positional arguments or a
    dict of keyword arguments); ``loss_fn(output)`` gives the loss (default: :func:`remat.default_loss`).
    ``profile_sizes``: the sizes profiled for real to fit the others (default: 2 and 4 for the batch, 3
    sizes for the sequence, whose attention grows with its square); ``max_size`` bounds the search;
    ``multiple_of``: only sizes that are multiples of it. ``strategy``: "ilp" (remat's plans), or a hand rule,
    "every_block" or "none", sized the same way. ``optimizer``'s state counts in the budget; it is never
    called.

    Leaves ``model`` as it was (no plan applied). Raises InfeasibleBudgetError when even the smallest profiled
    size does not fit."""
    return max_batch_of(model, budget_gb, lambda n: (make_batch(n), loss_fn), optimizer=optimizer, dim=dim,
                        profile_sizes=profile_sizes, max_size=max_size, multiple_of=multiple_of, strategy=strategy,
                        granularity=granularity, output_alive=output_alive, repeats=repeats,
                        time_limit_s=time_limit_s)


def max_batch_of(model: nn.Module, budget_gb: float, sized: Callable[[int], tuple[Any, LossFn | None]], *,
                 optimizer: torch.optim.Optimizer | None, dim: str, profile_sizes: tuple[int, ...] | None, max_size: int,
                 multiple_of: int, strategy: str, granularity: str, output_alive: bool, repeats: int,
                 time_limit_s: float | None, profiles: dict[int, Profile] | None = None) -> BatchSizeReport:
    """:func:`max_batch` for a ``sized(n)`` that gives the batch of size ``n`` with its own loss function (the
    command line's targets: a loss that closes over the labels of its batch). ``profiles``: real profiles of
    this model, loop and optimizer by size, reused and filled in (one dict across strategies: each size is
    profiled once)."""
    model = uncompiled(model)
    if dim not in ("batch", "seq"):
        raise InvalidInputError(f"dim must be 'batch' or 'seq', got {dim!r}")
    if strategy not in STRATEGIES:
        raise InvalidInputError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not isinstance(multiple_of, int) or multiple_of < 1:
        raise InvalidInputError(f"multiple_of must be a positive integer, got {multiple_of!r}")
    if profile_sizes is None:
        profile_sizes = tuple(multiple_of * k for k in ((2, 4) if dim == "batch" else (4, 8, 12)))
    profile_sizes = tuple(sorted(set(profile_sizes)))
    if len(profile_sizes) < 2 or profile_sizes[0] < 1 or any(s % multiple_of for s in profile_sizes):
        raise InvalidInputError(f"profile_sizes must be two or more positive multiples of {multiple_of}, "
                                f"got {profile_sizes}")
    budget_bytes, *_ = validate(model, budget_gb, sized(profile_sizes[0])[0])
    _, undo = prepare_hf_for_training(model)
    try:
        with preserved(model):
            remove_checkpointing(model)
            search = _Search(model, budget_bytes, lambda n: _with_loss(sized(n)), optimizer=optimizer, dim=dim,
                             strategy=strategy, granularity=granularity, output_alive=output_alive,
                             time_limit_s=time_limit_s, step=multiple_of, max_size=max_size,
                             profiles=profiles)
            return search.run(profile_sizes, repeats=repeats)
    finally:
        undo()


def _with_loss(batch: tuple[Any, LossFn | None]) -> tuple[Any, LossFn]:
    return batch[0], batch[1] or default_loss
