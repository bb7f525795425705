"""The exceptions remat raises. Every one derives from :class:`RematError`."""

from __future__ import annotations


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class InvalidInputError(RematError, ValueError):
    """An argument is malformed (budget, inputs, loss, model); the message says which and how to fix it."""


class CaptureError(RematError):
    """The model could not be run or traced on the example inputs."""


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
