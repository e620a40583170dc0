"""The planner seam: a batch of queries in, K plan drafts per query out.

Every back end (the embedded policy, vLLM, an LLM through litellm) implements
`Planner.plan`. Drafts carry the raw text; parsing and validation happen once,
in `conductor.plans`, whatever wrote the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from conductor.plans import Query  # noqa: F401  (re-exported: the planner seam's input)
from conductor.pool import Pool


# A sweep gives every query as many slots as the largest candidate set; the slots a query
# cannot use are plans with this error, left ungraded (not a wrong answer of the planner's).
UNUSED_SLOT = "sweep slot not used"


@dataclass
class PlanDraft:
    """One sampled plan, as the planner wrote it."""

    text: str
    prompt: str | None = None  # what the planner was asked (RL export needs it)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    logprob: float | None = None  # cumulative log-probability of `text` (LLM planners)
    propensity: float | None = None  # probability of this plan under the policy (embedded)
    template_version: str | None = None
    info: dict[str, Any] = field(default_factory=dict)  # back-end specifics, stored as JSON


class Planner(Protocol):
    """Plans whole batches: back ends batch internally (one vLLM call per batch)."""

    name: str

    def plan(self, queries: Sequence[Query], pool: Pool, samples: int) -> list[list[PlanDraft]]:
        """Return, for each query in order, exactly `samples` drafts."""
        ...


class PlannerBackEnd:
    """What the runner may ask of a planner back end beyond `plan`, declared once with
    defaults that do nothing; a back end overrides what it has. Any other object with a
    `plan` method still plans (tests' scripted planners), without these."""

    name: str

    def plan(self, queries: Sequence[Query], pool: Pool, samples: int) -> list[list[PlanDraft]]:
        raise NotImplementedError

    def bind(self, **context: Any) -> None:
        """The run's context for a planner that calls models through the executor: its work
        folder, cache, run id, seed, refresh setting, budget and progress."""

    def replanner(self, pool: Pool, max_steps: int) -> Any:
        """What re-plans a step given to a planner worker (conductor.planners.replan); None: cannot."""
        return None

    def close(self) -> None:
        """Free what the planner holds (a loaded engine and its processes)."""
