"""remat: choose which activations to keep and which to recompute so a PyTorch training step
fits a memory budget at the least extra time.

The pipeline, one package (or module) per stage in the order data flows, each handing a frozen dataclass
to the next::

    capture    nn.Module + batch        -> ModelGraph   candidate units, capture path (fx/export/hooks)
    profile/   one recorded step        -> Recording    storages, saved tensors, unit spans (costs/recording.py)
               + timed real steps, optimizer accounting on shadows
    costs/     Recording + times        -> Profile      every UnitCost (effects) + the step's fixed memory and
               Profile + plan           -> predicted peak (simulate: the one definition), rows for the ILP;
                                                        compiled programs' memory, extrapolation (no torch)
    solve/     Profile + budget         -> Plan         ILP (PuLP/CBC) and the hand rules
    rewrite/   Plan                     -> the model, checkpointed in place (reversible)
    check/     plain vs checkpointed    -> measured steps, EquivalenceReport

Costs come from one of two sources (``api/source.py``, Note [Where costs come from]): measured on this machine, or
``target/``: modelled for a device and a world that are not here (a GPU from the table, FSDP2/TP at any world
size on torch's fake process group, the CUDA caching allocator replayed; issue #39).

The front doors: ``api/`` (below; ``api/source.py``: where a step's costs come from, measured here), ``cli/``,
``integrations/``. Built on the pipeline: ``sweeps/`` (the tradeoff
table, the largest batch). Shared ground: ``runtime/`` (one training step, one clock, one peak meter; snapshots;
compiled and distributed loops), ``errors``, ``_compat/`` (private torch APIs), ``examples``.

Entry points: :func:`optimize_checkpointing` (all of it, in place), :func:`make_profile` with
:class:`Planner` (profile once, plan many budgets and hand rules), :func:`apply_plan` (a saved plan),
:func:`tradeoff` (the CLI's table: plans per budget and hand rules, each measured), :func:`max_batch`
(the largest and the fastest batch or sequence under a budget),
:func:`check_equivalence` and :func:`measure_step` (prove it), :func:`check_prediction` (on a GPU: the
prediction for it beside the same plans run there). Every error is a :class:`RematError`.
"""

from remat._compat import TORCH_FLOOR as _TORCH_FLOOR, require_torch as _require_torch

_require_torch("remat", _TORCH_FLOOR, "the least release remat is tested on")

from remat.api import apply_plan, checked_plan, make_profile, optimize_checkpointing  # noqa: E402
from remat.costs.unit_costs import Profile, UnitCost
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
    UserCodeError,
)
from remat.runtime.measure import default_loss
from remat.check.steps import StepMeasurement, measure_step
from remat.solve.plan import Plan
from remat.sweeps.report import TradeoffRow, tradeoff
from remat.rewrite import checkpointed_modules, remove_checkpointing
from remat.costs.simulate import PeakBreakdown
from remat.sweeps.sizing import BatchSizeReport, SizeRow, max_batch
from remat.solve import Planner
from remat.check.verify import EquivalenceReport, assert_equivalent, check_equivalence
from remat.target import DeviceSpec, Target
from remat.sweeps.accuracy import AccuracyRow, PredictionCheck, check_prediction

from remat._compat.versions import REMAT_VERSION as __version__  # noqa: E402

__all__ = [
    "optimize_checkpointing",
    "Target",
    "DeviceSpec",
    "check_prediction",
    "PredictionCheck",
    "AccuracyRow",
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
    "UserCodeError",
    "EquivalenceError",
    "MissingDependencyError",
]
