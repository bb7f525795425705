"""The exceptions remat raises. Every one derives from :class:`RematError`."""

from __future__ import annotations


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class InvalidInputError(RematError, ValueError):
    """An argument is malformed (budget, inputs, loss, model); the message says which and how to fix it."""


class UnsupportedError(RematError):
    """remat cannot handle this (an optimizer it cannot predict, a construct it cannot checkpoint); the
    message says what and what to do instead."""


class UserCodeError(InvalidInputError):
    """The user's own code (the loss function, the model's forward) raised on a later call while remat ran it, though
    it ran before and the plain step runs: the message names the code and the call, the user's exception is chained
    (its traceback is the user's code), and the model and its training state are as they were."""


class InternalError(RematError):
    """remat itself failed (the user's own training step runs): the message names the stage, the cause
    is chained, and the model and its training state are as they were."""

    def __init__(self, message: str, *, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


class SolverError(RematError):
    """The ILP solver failed or ran out of time before it found any plan; the message says how to
    give it more room (time_limit_s)."""


class InfeasibleBudgetError(RematError):
    """No plan fits the budget. ``min_feasible_bytes`` is the least peak any plan reaches."""

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes


class PlanMismatchError(RematError):
    """A saved plan does not fit the model it is applied to."""


class EquivalenceError(RematError, AssertionError):
    """Checkpointed and plain training steps differ (raised by ``assert_equivalent``)."""


class MissingDependencyError(RematError, ImportError):
    """An optional part of remat was used without the package it needs; the message names the extra
    to install (``pip install 'remat[hf]'``)."""
