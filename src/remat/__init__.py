"""remat: choose which activations to keep and which to recompute so a PyTorch training step
fits a memory budget at the least extra time.

Pipeline (one module per stage): ``capture`` -> ``profile`` -> ``solve`` (with ``simulate``)
-> ``rewrite`` -> ``verify``. The entry point is :func:`optimize_checkpointing`.
"""

from remat.api import apply_plan, default_loss, optimize_checkpointing
from remat.costs import Profile, UnitCost
from remat.errors import (
    EquivalenceError,
    InfeasibleBudgetError,
    InternalError,
    InvalidInputError,
    PlanMismatchError,
    RematError,
    SolverError,
    UnsupportedError,
)
from remat.plan import Plan
from remat.rewrite import checkpointed_modules, remove_checkpointing
from remat.verify import EquivalenceReport, assert_equivalent, check_equivalence, measure_step

__version__ = "0.1.0"

__all__ = [
    "optimize_checkpointing",
    "apply_plan",
    "remove_checkpointing",
    "checkpointed_modules",
    "check_equivalence",
    "assert_equivalent",
    "measure_step",
    "default_loss",
    "Plan",
    "Profile",
    "UnitCost",
    "EquivalenceReport",
    "RematError",
    "InvalidInputError",
    "InfeasibleBudgetError",
    "PlanMismatchError",
    "InternalError",
    "SolverError",
    "UnsupportedError",
    "EquivalenceError",
]
