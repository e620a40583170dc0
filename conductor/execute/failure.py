"""The failure a step ends with, apart from the engine so that the modules the engine
calls (structured record steps) can raise it without importing the engine back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Billed:
    """What a failed call was billed for: a 200 whose answer could not be kept (a refusal, a
    content filter, an answer past the limits). Counted like an answer's cost: the failed
    step's row, the budgets, and on resume (its request key says the call was logged)."""

    cost: float | None  # None: no known price
    tokens: tuple[int, int]  # prompt, completion: as reported, or the request's bounds
    estimated: bool  # the usage was not reported (or not believable): the request's bounds
    request_key: str


class StepFailed(Exception):
    """A step that did not produce an answer: `status` goes into its trace row."""

    def __init__(self, status: str, message: str, attempts: int = 0, extra: dict[str, Any] | None = None,
                 kind: str | None = None, row: dict[str, Any] | None = None, billed: Billed | None = None):
        super().__init__(message)
        self.status = status
        self.attempts = attempts
        self.extra = extra  # row fields for the failed step's trace row (the sub-plan that failed)
        self.row = row  # the trace row already written for this failure (with what the call cost)
        self.billed = billed  # what the failed call was billed, if anything
        # why, as a class: a call failure's kind (connection, timeout, server, rate_limit, auth,
        # not_found, client, malformed, other), budget, config or plan
        self.kind = kind or ("budget" if status == "budget_exhausted" else "other")

    @property
    def cost(self) -> float | None:
        return self.billed.cost if self.billed is not None else None


class Aborted(Exception):
    """The run is stopping (a storage error elsewhere): stop this plan without recording it."""
