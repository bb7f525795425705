"""remat: choose which activations to keep and which to recompute so a PyTorch training step
fits a memory budget at the least extra time.

The pipeline, one module (or package) per stage, each handing a frozen dataclass to the next::

    capture    nn.Module + batch        -> ModelGraph   candidate units, capture path (fx/export/hooks)
    profile/   one recorded step        -> Recording    storages, saved tensors, unit spans (remat.recording)
               + timed real steps, optimizer accounting on shadows
    effects    Recording + times        -> UnitCost     what checkpointing each unit frees/holds/recomputes
    costs                                  Profile      every UnitCost + the step's fixed memory and times
    simulate   Profile + plan           -> predicted peak (the one definition), rows for the ILP
    solve/     Profile + budget         -> Plan         ILP (PuLP/CBC) and the hand rules
    rewrite    Plan                     -> the model, checkpointed in place (reversible)
    measure    one training step, one clock, one peak meter, used by every stage that runs the model
    steps      real steps measured (peak, step time) on one copy, or in place for sharded models
    distributed  one plan for every rank under FSDP2 / DDP
    verify     plain vs checkpointed    -> EquivalenceReport
    extrapolate  profiles at a few sizes -> profiles fitted at any size (no torch)
    sizing     budget + make_batch(n)   -> BatchSizeReport  the largest / fastest size, confirmed on real steps

Entry points: :func:`optimize_checkpointing` (all of it, in place), :func:`make_profile` with
:class:`Planner` (profile once, plan many budgets and hand rules), :func:`apply_plan` (a saved plan),
:func:`tradeoff` (the CLI's table: plans per budget and hand rules, each measured), :func:`max_batch`
(the largest and the fastest batch or sequence under a budget),
:func:`check_equivalence` and :func:`measure_step` (prove it). Every error is a :class:`RematError`.
"""

from remat._compat import TORCH_FLOOR as _TORCH_FLOOR, require_torch as _require_torch

_require_torch("remat", _TORCH_FLOOR, "the least release remat is tested on")

from remat.api import apply_plan, checked_plan, make_profile, optimize_checkpointing  # noqa: E402
from remat.costs import Profile, UnitCost
from remat.errors import (
    EquivalenceError,
    InfeasibleBudgetError,
    InternalError,
    InvalidInputError,
    MissingDependencyError,
    PlanMismatchError,
    RematError,
    SolverError,
    UnsupportedError,
)
from remat.measure import default_loss
from remat.steps import StepMeasurement, measure_step
from remat.plan import Plan
from remat.report import TradeoffRow, tradeoff
from remat.rewrite import checkpointed_modules, remove_checkpointing
from remat.simulate import PeakBreakdown
from remat.sizing import BatchSizeReport, SizeRow, max_batch
from remat.solve import Planner
from remat.verify import EquivalenceReport, assert_equivalent, check_equivalence

__version__ = "0.1.0"

__all__ = [
    "optimize_checkpointing",
    "make_profile",
    "Planner",
    "checked_plan",
    "apply_plan",
    "remove_checkpointing",
    "checkpointed_modules",
    "tradeoff",
    "TradeoffRow",
    "max_batch",
    "BatchSizeReport",
    "SizeRow",
    "check_equivalence",
    "assert_equivalent",
    "measure_step",
    "default_loss",
    "Plan",
    "Profile",
    "UnitCost",
    "PeakBreakdown",
    "StepMeasurement",
    "EquivalenceReport",
    "RematError",
    "InvalidInputError",
    "InfeasibleBudgetError",
    "PlanMismatchError",
    "InternalError",
    "SolverError",
    "UnsupportedError",
    "EquivalenceError",
    "MissingDependencyError",
]
