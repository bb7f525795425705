"""``apply_plan``: a saved plan applied to a model (checked against its fingerprint).

In: a model and a :class:`~remat.solve.plan.Plan`. Out: the model checkpointed in place.
"""

from __future__ import annotations

import logging

from torch import nn

from remat._compat import uncompiled
from remat.api.inputs import model_signature
from remat.api.hf import prepare_hf_for_training
from remat.errors import PlanMismatchError
from remat.rewrite import check_units, checkpoint_plan, remove_checkpointing
from remat.runtime.distributed import wrapping_of
from remat.solve.plan import Plan

log = logging.getLogger(__name__)


def apply_plan(model: nn.Module, plan: Plan) -> None:
    """Checkpoint ``model`` as ``plan`` says, without profiling (mutates ``model``).

    Raises PlanMismatchError when the model's parameter names or shapes differ from the
    model the plan was made for, a planned module is missing, or the model is trained by another number
    of ranks or wrapped otherwise than the plan was made for (a plan made under FSDP2 or DDP applies on
    every rank of the same set-up)."""
    if not isinstance(plan, Plan):
        raise PlanMismatchError(f"expected a remat.Plan, got {type(plan).__name__}")
    model = uncompiled(model)
    wrapping = wrapping_of(model)
    if (plan.world_size, plan.wrapping) != (wrapping.world_size, str(wrapping) if wrapping.world_size > 1 else ""):
        raise PlanMismatchError(
            f"this plan was made for {plan.wrapping or 'one process'} ({plan.world_size} rank(s)), but this model "
            f"is trained by {wrapping} ({wrapping.world_size} rank(s)): per-rank memory depends on both; run "
            "optimize_checkpointing on every rank of this set-up to make a new plan"
        )
    if plan.model_signature:
        mine = dict(model_signature(model))
        theirs = dict(plan.model_signature)
        missing = sorted(theirs.keys() - mine.keys())
        extra = sorted(mine.keys() - theirs.keys())
        shapes = sorted(n for n in theirs.keys() & mine.keys() if tuple(theirs[n]) != tuple(mine[n]))
        if missing or extra or shapes:
            parts = []
            if missing:
                parts.append(f"parameters missing from the model: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
            if extra:
                parts.append(f"parameters not in the plan's model: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
            if shapes:
                n = shapes[0]
                parts.append(f"{len(shapes)} parameter(s) of another shape, e.g. {n}: plan {tuple(theirs[n])}, "
                             f"model {tuple(mine[n])}")
            raise PlanMismatchError(
                "this plan was made for another model (" + "; ".join(parts) + "); run optimize_checkpointing "
                "on this model to make a new plan"
            )
    from remat.costs.offload import offloaded_module

    absent = check_units(model, plan.checkpointed + tuple(offloaded_module(u) for u in plan.offloaded))
    if absent:
        raise PlanMismatchError(f"the plan checkpoints units this model does not have: {absent}")
    if plan.checkpointed:
        for note in prepare_hf_for_training(model)[0]:
            log.warning("remat.apply_plan: %s", note)
    remove_checkpointing(model)
    checkpoint_plan(model, plan)
