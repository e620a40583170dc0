"""The policy's actions: plan shapes x worker assignments drawn from the pool.

Shapes: `single` (one worker answers), `verify` (one worker answers, a second
checks; not on replay pools, which serve only the original question), and
`ensemble` (k workers answer independently, then the `vote` function worker, or
an aggregating model when the pool has no vote, decides).

A pool of 42 models has tens of thousands of such plans, far more than any
rollout budget can try, so the candidate set is cut down with the pool's own
numbers (`skills`, prices) and nothing else:
- singles: the workers on the accuracy/cost Pareto frontier, the few most
  accurate ones (`best`), then the cheapest workers near the frontier (see
  `regret`) up to `max_singles`;
- ensemble members: workers close to that frontier (at most `regret` accuracy
  below the best worker that costs no more), at most `floor` below the most
  accurate worker (a vote of weak models does not help), and costing at most
  1/k of the most accurate worker, so that a k-vote costs about as much as the
  best single worker or less; the `members` most accurate of them; every
  k-subset (k in `sizes`);
- anchored ensembles: one of the `anchors` most accurate workers voting with
  two of the three best members (it goes first, so it breaks ties);
- verify: the frontier's cheapest solvers checked by the most accurate workers.

Which candidate is good for which query is what the policy learns; the set
only has to contain the good ones. An action is named by a stable key such as
`single:gpt-4o-mini`, `verify:a>b` or `ensemble:a+b+c>vote`, so logged plans map
back to actions whatever version of this file produced them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import combinations
from typing import Iterable, Sequence

import orjson

from conductor.pool import Pool, Worker

SHAPES = ("single", "verify", "ensemble")
NOMINAL_IN, NOMINAL_OUT = 200, 300  # tokens, to rank workers by price; the learner sees real costs


@dataclass(frozen=True)
class ActionSettings:
    best: int = 3
    max_singles: int = 12
    members: int = 6
    regret: float = 0.03
    floor: float = 0.1  # members are at most this far below the most accurate worker
    sizes: tuple[int, ...] = (3, 4)  # with the vote, a 4-vote has 5 steps: the default --max-steps
    anchors: int = 2
    verifiers: int = 2
    default_skill: float = 0.5

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ActionSettings":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if "sizes" in known:
            known["sizes"] = tuple(known["sizes"])
        return cls(**known)


@dataclass(frozen=True)
class Action:
    shape: str  # single | verify | ensemble
    solvers: tuple[str, ...]
    finisher: str | None = None  # verifier, `vote`, or an aggregating model

    @property
    def key(self) -> str:
        return f"{self.shape}:{'+'.join(self.solvers)}" + (f">{self.finisher}" if self.finisher else "")

    @property
    def workers(self) -> tuple[str, ...]:
        return self.solvers + ((self.finisher,) if self.finisher else ())

    @classmethod
    def from_key(cls, key: str) -> "Action":
        shape, _, rest = key.partition(":")
        body, _, finisher = rest.partition(">")
        if shape not in SHAPES or not body:
            raise ValueError(f"not an action key: {key!r}")
        return cls(shape, tuple(body.split("+")), finisher or None)


def from_steps(steps_json: str | None) -> Action | None:
    """The action a validated plan executes, or None for a shape outside the action space."""
    if not steps_json:
        return None
    steps = orjson.loads(steps_json)
    steps = steps.get("steps", steps) if isinstance(steps, dict) else steps
    if not steps:
        return None
    workers = [s["worker"] for s in steps]
    access = [s.get("access") or [] for s in steps]
    if len(steps) == 1:
        return Action("single", (workers[0],))
    if any(a for a in access[:-1]):
        return None  # an earlier step reads another step: not one of our shapes
    last = access[-1]
    sees = set(range(len(steps) - 1)) if last == "all" or last == ["all"] else set(last)
    if sees != set(range(len(steps) - 1)):
        return None
    if len(steps) == 2:
        return Action("verify", (workers[0],), workers[1])
    return Action("ensemble", tuple(workers[:-1]), workers[-1])


def action_set(pool: Pool, task: str | None, settings: ActionSettings = ActionSettings()) -> list[Action]:
    """The candidate actions for one task of a pool (see the module's docstring)."""
    solvers = [w for w in pool.workers if w.kind == "llm"]
    if not solvers:
        return []
    voters = [w for w in pool.workers if w.kind == "function" and w.function == "vote"]
    replay = pool.replay is not None
    acc = {w.id: skill(w, task, settings.default_skill) for w in solvers}
    cost = {w.id: nominal_cost(w) for w in solvers}
    by_acc = sorted(solvers, key=lambda w: (-acc[w.id], cost[w.id], w.id))
    regret = _regret(solvers, acc, cost)
    frontier = [w for w in by_acc if regret[w.id] <= 1e-12]
    single_ids = list(dict.fromkeys([w.id for w in frontier] + [w.id for w in by_acc[:settings.best]]))
    near = sorted((w for w in solvers if regret[w.id] <= settings.regret), key=lambda w: (cost[w.id], -acc[w.id]))
    for w in near:  # then the cheapest near-frontier workers, which a cost penalty favors
        if len(single_ids) >= settings.max_singles:
            break
        if w.id not in single_ids:
            single_ids.append(w.id)
    singles = [w for w in by_acc if w.id in single_ids]
    out = [Action("single", (w.id,)) for w in singles]
    if not replay and len(solvers) > 1:
        cheap = sorted(frontier, key=lambda w: cost[w.id])[:3]
        for a in cheap:
            for b in by_acc[:settings.verifiers + 1]:
                if a.id != b.id:
                    out.append(Action("verify", (a.id,), b.id))
    if voters or not replay:
        finisher = voters[0].id if voters else by_acc[0].id
        top = by_acc[0]

        def members(k: int) -> list[Worker]:
            return [w for w in by_acc if regret[w.id] <= settings.regret and acc[w.id] >= acc[top.id] - settings.floor
                    and cost[w.id] * k <= cost[top.id] + 1e-15][:settings.members]

        for k in settings.sizes:
            for group in combinations(members(k), k):  # in accuracy order: the best breaks a tie
                out.append(Action("ensemble", tuple(w.id for w in group), finisher))
        for anchor in by_acc[:settings.anchors]:
            for pair in combinations([m for m in members(3) if m.id != anchor.id][:3], 2):
                out.append(Action("ensemble", (anchor.id, *(w.id for w in pair)), finisher))
    return list(dict.fromkeys(out))


def servable(actions: Iterable[Action], allowed: set[str] | frozenset[str] | None) -> list[Action]:
    """The actions whose solvers may all answer this query (None: no restriction)."""
    if allowed is None:
        return list(actions)
    return [a for a in actions if all(s in allowed for s in a.solvers)]


def skill(w: Worker, task: str | None, default: float = 0.5) -> float:
    s = w.skill(task)
    return default if s is None else float(s)


def nominal_cost(w: Worker) -> float:
    return 0.0 if w.price is None else NOMINAL_IN * w.price.input + NOMINAL_OUT * w.price.output


def _regret(solvers: Sequence[Worker], acc: dict[str, float], cost: dict[str, float]) -> dict[str, float]:
    """How far below the best accuracy available at its cost or less each worker is."""
    out = {}
    for w in solvers:
        best = max(acc[v.id] for v in solvers if cost[v.id] <= cost[w.id] + 1e-15)
        out[w.id] = best - acc[w.id]
    return out
