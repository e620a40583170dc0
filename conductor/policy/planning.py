"""Planning with the policy: which candidates a query has, and how K plans are drawn.

K=1 takes the greedy action (propensity 1, or its epsilon-greedy probability
when exploration is asked for). K>1 draws K times, with replacement, from the
epsilon-greedy distribution (see `learner.pmf`); each plan's propensity is the
probability of its action under that distribution, so a learner can weight
it by 1/propensity later. Draws are seeded by (seed, query id): rerunning a
run plans the same.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, replace
from typing import Sequence

from conductor.plans import Query
from conductor.policy.actions import Action, servable
from conductor.policy.artifact import Artifact
from conductor.policy.features import context
from conductor.policy.learner import pmf

DEFAULT_EXPLORE = 0.2  # K>1 with a learned policy: the share of draws spread evenly


@dataclass(frozen=True)
class Pick:
    action: Action
    propensity: float
    greedy: bool
    group: str | None = None  # the query's group, when the policy plans per group (its features' group_by)


def candidates(artifact: Artifact, q: Query, allowed: frozenset[str] | set[str] | None) -> list[Action] | None:
    """The artifact's actions for this query's task that the pool can serve; None if it has none."""
    acts = artifact.actions.get(q.task or "none")
    if not acts:
        return None
    return servable(acts, allowed) or None


def choose(artifact: Artifact, q: Query, actions: Sequence[Action], samples: int, explore: float,
           seed: int) -> list[Pick]:
    ctx = context(q.prompt, q.task, artifact.features, q.metadata)
    g = artifact.learner.greedy(ctx, actions)
    return [replace(p, group=ctx.group) for p in draw(actions, g, samples, explore, seed, q.query_id)]


def draw(actions: Sequence[Action], greedy: int, samples: int, explore: float, seed: int,
         query_id: str) -> list[Pick]:
    if samples == 1 and explore == 0:
        return [Pick(actions[greedy], 1.0, True)]
    probs = pmf(greedy, len(actions), explore)
    rng = random.Random(_seed(seed, query_id))
    picks = rng.choices(range(len(actions)), weights=probs, k=samples)
    return [Pick(actions[i], probs[i], i == greedy) for i in picks]


def _seed(seed: int, query_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"policy:{seed}:{query_id}".encode()).digest()[:8], "big")
