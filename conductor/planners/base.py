"""The planner seam: a batch of queries in, K plan drafts per query out.

Every back end (the embedded policy, vLLM, an LLM through litellm) implements
`Planner.plan`. Drafts carry the raw text; parsing and validation happen once,
in `conductor.plans`, whatever wrote the text.
"""

from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from conductor.errors import ConductorError
from conductor.plans import Query  # noqa: F401  (re-exported: the planner seam's input)
from conductor.pool import Pool
from conductor.yamlkeys import shown_value


# A sweep gives every query as many slots as the largest candidate set; the slots a query
# cannot use are plans with this error, left ungraded (not a wrong answer of the planner's).
UNUSED_SLOT = "sweep slot not used"


class PlanningStopped(ConductorError):
    """Planning that stopped after its calls were sent (and maybe paid): not exit 2, which
    promises that nothing was called. `exit_code` is `conductor run`'s: 3 when a budget
    stopped it, else 4 (plans failed)."""

    def __init__(self, message: object, exit_code: int = 4):
        super().__init__(message)
        self.exit_code = exit_code


def option_checks(who: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """A planner's checks of whole-number and number options, their messages naming `who`:
    planner options arrive as YAML scalars, and a bad one must be refused before the run
    folder is written, not found by the model or the bill."""

    def whole(name: str, value: Any, least: int | None, optional: bool = False) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int) or (least is not None and value < least) \
                or not -2**63 <= value < 2**63:  # the run's id hashes its options as 64-bit integers
            at_least = f" of at least {least}" if least is not None else ""
            none = " (or unset)" if optional else ""
            raise ConductorError(f"{who}: {name} must be a whole number{at_least}{none} (got {shown_value(value)})")

    def number(name: str, value: Any, low: float, low_open: bool, high: float | None) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and (isinstance(value, int) or math.isfinite(value))  # NaN passes no comparison; inf all
        ok = ok and (value > low if low_open else value >= low) and (high is None or value <= high)
        if not ok:
            span = f"{'above' if low_open else 'at least'} {low:g}" + (f" and at most {high:g}" if high is not None
                                                                        else "")
            raise ConductorError(f"{who}: {name} must be a number {span} (got {shown_value(value)})")

    return whole, number


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
    # Planning calls models or starts an engine (money, minutes): the runner checks the workers the plans
    # may use before it (runner.check_before_planning), not only after, as for the embedded planner.
    plans_at_a_cost = False

    def plan(self, queries: Sequence[Query], pool: Pool, samples: int) -> list[list[PlanDraft]]:
        raise NotImplementedError

    def bind(self, **context: Any) -> None:
        """The run's context for a planner that calls models through the executor: its work
        folder, cache, run id, seed, refresh setting, budget and progress; and for every model
        planner `replans`, whether its plans may give steps to planner workers (top_level_kinds)."""

    def replanner(self, pool: Pool, max_steps: int) -> Any:
        """What re-plans a step given to a planner worker (conductor.planners.replan); None: cannot."""
        return None

    def close(self) -> None:
        """Free what the planner holds (a loaded engine and its processes)."""


def top_level_kinds(kinds: Sequence[str], replans: bool) -> tuple[str, ...]:
    """The worker kinds a run's own plans may use: no planner workers when the run allows no
    re-planning (--max-depth 0), as sub-plans at the deepest level (replan.sub_kinds). Offered,
    their steps were refused by the executor after the plan's earlier steps were paid for."""
    return tuple(k for k in kinds if replans or k != "planner")


class SeededByRun:
    """A planner whose `config.seed` (None: unset) follows the run's --seed unless the planner
    option `seed` was given: --seed once never reached the embedded and vLLM planners, so another
    seed drew the same plans under another run id. Needs `config` (a dataclass with `seed`) and
    `_seed_option`, the option as given."""

    config: Any
    _seed_option: int | None

    def bind(self, **context: Any) -> None:
        seed = self._seed_option if self._seed_option is not None else context.get("seed", 0)
        if seed != self.config.seed:
            self.config = dataclasses.replace(self.config, seed=seed)

    @property
    def seed(self) -> int:
        return self.config.seed if self.config.seed is not None else 0
