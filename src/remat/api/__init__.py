"""The front door in Python: the pipeline's stages called in order, with the user's model kept as it was on any
failure.

- ``optimize``   optimize_checkpointing: capture, profile, cost model, solve, check, rewrite, in place -> Plan
- ``request``    one call's arguments checked -> Request (the model, budget, inputs, loss, loop, cost source)
- ``source``     where a step's costs come from (Note [Where costs come from]): CostSource, and MeasuredHere, the
                 step recorded, timed and checked on this machine -> Profile, then the Plan for the budget
- ``profiling``  make_profile: a training step profiled once, to plan many budgets from -> Profile
- ``checking``   plans checked on real steps (plan_checked, least_checked): Planner + budget -> Plan
                 with its checked peak, nothing timed
- ``compiled``   a compiled plan's reading over ranks, and its proof beside the plain compiled step -> its note
- ``hand_rules`` fastest_checked: the checked plan raced beside the hand rules that meet its budget, where the model
                 cannot tell them apart (Note [Plans timed beside the hand rules]) -> the plan, or the rule measured
                 faster; checked_plan, the public call of it
- ``margins``    which rules the plan is timed beside: the model's error measured on the checked steps (Note [The
                 model's measured error]) and when a pair confirms the model; no torch
- ``table_rows`` rows_decided: the same race decided by a tradeoff table's own rounds (remats_row: remat's row)
- ``apply``      apply_plan: a saved Plan applied to a model, checked against its fingerprint
- ``inputs``     what the user passed, validated, and whose failure a failure is (InvalidInputError or
                 InternalError, Note [Whose failure])
"""

# what other stages, the benchmarks and the tests take from remat.api (private names: from their own modules)
# ruff: noqa: F401
from remat.api.apply import apply_plan
from remat.api.checking import (
    checked_reading,
    measure_checked_peak,
    peak_with_plan,
    plan_checked,
)
from remat.api.hand_rules import checked_plan
from remat.api.table_rows import remats_row
from remat.api.inputs import model_signature, stage, validate
from remat.api.optimize import optimize_checkpointing
from remat.api.hf import prepare_hf_for_training
from remat.api.profiling import make_profile
from remat.runtime.measure import split_inputs

__all__ = ["apply_plan", "checked_plan", "make_profile", "optimize_checkpointing"]
