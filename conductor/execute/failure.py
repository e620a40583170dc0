"""The failure a step ends with, apart from the engine so that the modules the engine
calls (structured record steps) can raise it without importing the engine back."""

from __future__ import annotations

from typing import Any


class StepFailed(Exception):
    """A step that did not produce an answer: `status` goes into its trace row."""

    def __init__(self, status: str, message: str, attempts: int = 0, extra: dict[str, Any] | None = None,
                 kind: str | None = None, row: dict[str, Any] | None = None,
                 cost: float | None = None, tokens: tuple[int, int] | None = None):
        super().__init__(message)
        self.status = status
        self.attempts = attempts
        self.extra = extra  # row fields for the failed step's trace row (the sub-plan that failed)
        self.row = row  # the trace row already written for this failure (with what the call cost)
        # what a failed call was billed (an answer that could not be kept), and its usage
        self.cost = cost
        self.tokens = tokens
        # why, as a class: a call failure's kind (connection, timeout, server, rate_limit, auth,
        # not_found, client, malformed, other), budget, config or plan
        self.kind = kind or ("budget" if status == "budget_exhausted" else "other")


class Aborted(Exception):
    """The run is stopping (a storage error elsewhere): stop this plan without recording it."""
