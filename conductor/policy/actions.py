"""The policy's actions: plan shapes x worker assignments drawn from the pool.

Shapes:
- `single`: one worker answers;
- `cascade`: 2-3 cheap workers answer the question; an escalation worker runs
  only when their final answers disagree (`when: disagree`), and in a two-level
  cascade a last worker runs only when the answers so far have no majority
  (`when: no_majority`). Agreeing cheap models stop the plan early: that is
  where the accuracy per dollar comes from;
- `ensemble`: k workers answer independently, then the `vote` function worker
  (or an aggregating model when the pool has no vote) decides;
- `verify`: one worker answers, a second checks (not on replay pools, which
  serve only the original question).

The set is built from the pool's own numbers (`skills`, prices), broadly: every
worker alone, cascades over the `cheap` workers (the most skilled of those
costing at most `cheap_cost` of the most skilled worker) escalating to the
`escalations` (4) most skilled workers, votes of the best cheap workers, and
verify pairs. It is deliberately too big: training measures every candidate on
the train split and keeps only the accuracy/cost Pareto frontier (`pareto`),
so no rule of thumb can leave only expensive singles.

An action is named by a stable key such as `single:gpt-4o-mini`,
`cascade:a+b>c`, `cascade:a+b>c>d`, `verify:a>b` or `ensemble:a+b+c>vote`, so
logged plans map back to actions whatever version of this file produced them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from itertools import combinations
from typing import Iterable, Sequence

import orjson

from conductor.pool import Pool, Price, Worker

SHAPES = ("single", "verify", "ensemble", "cascade")
NOMINAL_IN, NOMINAL_OUT = 200, 300  # tokens, to rank workers by price; training sees real costs


@dataclass(frozen=True)
class ActionSettings:
    cheap: int = 5  # cascade and vote members: the most skilled workers ...
    cheap_cost: float = 1 / 3  # ... costing at most this share of the most skilled worker
    # Cascades escalate to the most skilled workers. Skills are the recorded labels' train accuracy,
    # and near the top the ranks swap under our grader (GSM8K: the grader's best single is 4th by label).
    escalations: int = 4
    sizes: tuple[int, ...] = (2, 3)  # cheap workers that must agree
    two_level: int = 2  # two-level cascades: a mid worker among the escalations, then one of the top `two_level`
    votes: tuple[int, ...] = (3,)
    verifiers: int = 2
    default_skill: float = 0.5

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ActionSettings":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        for k in ("sizes", "votes"):
            if k in known:
                known[k] = tuple(known[k])
        return cls(**known)


@dataclass(frozen=True)
class Action:
    shape: str  # single | verify | ensemble | cascade
    solvers: tuple[str, ...]
    finisher: str | None = None  # verifier, `vote`, or an aggregating model
    escalation: tuple[str, ...] = ()  # cascade: who runs when the answers so far disagree, in order

    @functools.cached_property
    def key(self) -> str:  # cached: training looks it up millions of times
        tail = "".join(f">{w}" for w in ((self.finisher,) if self.finisher else self.escalation))
        return f"{self.shape}:{'+'.join(self.solvers)}{tail}"

    @property
    def workers(self) -> tuple[str, ...]:
        return self.solvers + ((self.finisher,) if self.finisher else ()) + self.escalation

    @classmethod
    def from_key(cls, key: str) -> "Action":
        shape, _, rest = key.partition(":")
        body, *tail = rest.split(">")
        if shape not in SHAPES or not body or any(not t for t in tail):
            raise ValueError(f"not an action key: {key!r}")
        solvers = tuple(body.split("+"))
        if shape == "cascade":
            if len(solvers) < 2 or not 1 <= len(tail) <= 2:
                raise ValueError(f"not a cascade key: {key!r} (expected a+b[+c]>escalation[>last])")
            return cls(shape, solvers, None, tuple(tail))
        if len(tail) > 1:
            raise ValueError(f"not an action key: {key!r}")
        return cls(shape, solvers, tail[0] if tail else None)

    def steps(self, solve: str, finish: str | None = None) -> list[dict]:
        """The plan's steps: `solve` is every solver's (and escalation's) instruction,
        `finish` the verifier's or aggregator's."""
        out = [{"worker": w, "instruction": solve, "access": []} for w in self.solvers]
        if self.shape == "verify":
            out.append({"worker": self.finisher, "instruction": finish or solve, "access": [0]})
        elif self.shape == "ensemble":
            out.append({"worker": self.finisher, "instruction": finish or solve, "access": "all"})
        elif self.shape == "cascade":
            n = len(self.solvers)
            out.append({"worker": self.escalation[0], "instruction": solve, "access": [],
                        "when": {"disagree": list(range(n))}})
            if len(self.escalation) > 1:
                out.append({"worker": self.escalation[1], "instruction": solve, "access": [],
                            "when": {"no_majority": list(range(n + 1))}})
        return out


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
    when = [s.get("when") for s in steps]
    if any(when):
        return _cascade(workers, access, when)
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


def _cascade(workers: list[str], access: list, when: list) -> Action | None:
    n = next(i for i, w in enumerate(when) if w)
    if n < 2 or any(access) or len(workers) - n not in (1, 2):
        return None
    if when[n] != {"disagree": list(range(n))}:
        return None
    if len(workers) == n + 2 and when[n + 1] != {"no_majority": list(range(n + 1))}:
        return None
    return Action("cascade", tuple(workers[:n]), None, tuple(workers[n:]))


def action_set(pool: Pool, task: str | None, settings: ActionSettings = ActionSettings()) -> list[Action]:
    """The candidate actions for one task of a pool (see the module's docstring)."""
    solvers = [w for w in pool.workers if w.kind == "llm"]
    if not solvers:
        return []
    voters = [w for w in pool.workers if w.kind == "function" and w.function == "vote"]
    replay = pool.replay is not None
    acc = {w.id: skill(w, task, settings.default_skill) for w in solvers}
    prices = planning_prices(pool.workers)
    cost = {w.id: nominal_cost(prices[w.id]) for w in solvers}
    by_acc = sorted(solvers, key=lambda w: (-acc[w.id], cost[w.id], w.id))
    top = by_acc[0]
    out = [Action("single", (w.id,)) for w in by_acc]
    cheap = [w.id for w in by_acc if w.id != top.id
             and cost[w.id] <= settings.cheap_cost * cost[top.id] + 1e-15][:settings.cheap]
    escal = [w.id for w in by_acc[:settings.escalations]]
    for k in settings.sizes:
        for group in combinations(cheap, k):
            for e in escal:
                out.append(Action("cascade", group, None, (e,)))
    for group in combinations(cheap, 2):  # two-level: a mid escalation, then a top one on no majority
        for mid in escal:
            for last in escal[:settings.two_level]:
                if last != mid and acc[last] >= acc[mid]:
                    out.append(Action("cascade", group, None, (mid, last)))
    if voters or not replay:
        finisher = voters[0].id if voters else top.id
        for k in settings.votes:
            for group in combinations(cheap, k):
                out.append(Action("ensemble", group, finisher))
    if not replay and len(solvers) > 1:
        for a in cheap[:3]:
            for b in by_acc[:settings.verifiers]:
                if a != b.id:
                    out.append(Action("verify", (a,), b.id))
    return [a for a in dict.fromkeys(out) if len(set(a.workers)) == len(a.workers)]


def servable(actions: Iterable[Action], allowed: set[str] | frozenset[str] | None) -> list[Action]:
    """The actions whose workers may all answer this query (None: no restriction).
    A cascade needs its escalation too: it may run."""
    if allowed is None:
        return list(actions)
    return [a for a in actions if all(s in allowed for s in a.solvers + a.escalation)]


@dataclass(frozen=True)
class Measured:
    """An action's mean correctness and cost on the train split, from logged rollouts."""

    action: Action
    n: int
    accuracy: float
    cost: float

    @property
    def se(self) -> float:
        p = self.accuracy
        return math.sqrt(max(p * (1 - p), 1e-12) / max(self.n, 1))


def pareto(measured: Sequence[Measured], band: float = 1.0, keep: int = 40) -> list[Measured]:
    """The actions on the accuracy/cost frontier, or within `band` standard errors of it,
    cheapest first, at most `keep` (the frontier itself first)."""
    by_cost = sorted(measured, key=lambda m: (m.cost, -m.accuracy, m.action.key))
    gap = {}
    for m in by_cost:  # best accuracy any action at or below this cost reaches
        best = max(o.accuracy for o in by_cost if o.cost <= m.cost + 1e-15)
        gap[m.action.key] = best - m.accuracy
    front = [m for m in by_cost if gap[m.action.key] <= 1e-12]
    near = sorted((m for m in by_cost if 1e-12 < gap[m.action.key] <= band * m.se),
                  key=lambda m: gap[m.action.key] / max(m.se, 1e-9))
    chosen = {m.action.key for m in (front + near)[:keep]}
    return [m for m in by_cost if m.action.key in chosen]


def skill(w: Worker, task: str | None, default: float = 0.5) -> float:
    s = w.skill(task)
    return default if s is None else float(s)


def nominal_cost(price: Price) -> float:
    return NOMINAL_IN * price.input + NOMINAL_OUT * price.output


FREE = Price(0.0, 0.0)


def planning_prices(workers: Iterable[Worker]) -> dict[str, Price]:
    """Each worker's price as planning ranks it: the pool's, else litellm's cost map, as the
    executor bills it (a worker priced only by the map counted $0, so plans went to it). A
    worker of no known price counts at the dearest known price of the llm workers among
    `workers` (by a nominal call), never as free; when none has a known price, all count $0."""
    from conductor.execute.prices import resolve_price

    workers = list(workers)
    known = {w.id: resolve_price(w) for w in workers}
    priced = [known[w.id] for w in workers if w.kind == "llm" and known[w.id] is not None]
    unknown = max(priced, key=nominal_cost) if priced else FREE
    return {wid: unknown if p is None else p for wid, p in known.items()}
