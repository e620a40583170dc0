"""Learners of the contextual bandit, trained off-policy on logged plans.

Every logged example is one executed plan: the query's context, the candidate
actions it had, the action the sampler chose and the probability it chose it
with (the propensity), and the reward the pipeline measured for it
(correct - lambda x USD). The learners:

- `vw` (default): Vowpal Wabbit's `--cb_explore_adf` with action-dependent
  features, trained with importance weights 1 / propensity (`--cb_type mtr`;
  `dr`, doubly robust, and `ips` are settings);
  the context (task, hashed word and character n-grams, length) is crossed
  with the action's features (its key, shape, size and workers), so what it
  learns about a worker carries over to the ensembles it is part of.
- `vw-task`: the same without the text n-grams (task and length only): an
  ablation that measures what the query's words are worth.
- `table`: per task, the self-normalized inverse-propensity estimate of each
  action's mean reward; no text at all. The simple cost-aware baseline.
- `fixed`: per task, one action for every query (the best fixed action on the
  training logs: by reward, or the cheapest reaching an accuracy floor). Training compares the learned policy with it on held-back
  queries and ships whichever is better (conductor.policy.training).
- `segment`: per task and group (a field of the query's metadata, `--group-by`), one
  action for every query of the group, its cost weight and its pull toward the task-wide
  choice (shrinkage) set by cross-fitting.

Planning asks for the greedy action and an epsilon-greedy distribution over
the candidates: (1 - eps) on the greedy action plus eps spread evenly, the
distribution VW's `--epsilon` exploration uses, so the propensity logged with
a sampled plan is exactly its probability under the sampler.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import orjson

from conductor.policy.actions import Action
from conductor.policy.features import Context

LEARNERS = ("vw", "vw-task", "table", "fixed", "segment")
_TEXT_NS = ("w", "c")


@dataclass
class Logged:
    """One executed plan, as a training example."""

    context: Context
    actions: list[Action]  # the candidates, the chosen one among them
    chosen: int
    propensity: float
    reward: float  # correct - lambda * USD
    correct: bool | None = None
    cost: float = 0.0
    query: str = ""  # the query id: held-back splits go by query


class Learner(Protocol):
    name: str

    def fit(self, examples: Sequence[Logged]) -> dict: ...

    def greedy(self, ctx: Context, actions: Sequence[Action]) -> int: ...

    def save(self, folder: Path) -> list[str]: ...


def pmf(greedy: int, n: int, explore: float) -> list[float]:
    """Epsilon-greedy: what VW's `--cb_explore_adf --epsilon` puts on each candidate."""
    if n == 1:
        return [1.0]
    probs = [explore / n] * n
    probs[greedy] += 1.0 - explore
    return probs


# ---------------------------------------------------------------- Vowpal Wabbit


@dataclass(frozen=True)
class VWSettings:
    # mtr: importance-weighted (1 / propensity) regression of the reward on the logged action;
    # dr: doubly robust; ips: inverse propensity. mtr won on a validation half of the train logs.
    cb_type: str = "mtr"
    bits: int = 20
    passes: int = 10
    learning_rate: float = 1.0  # with sgd: per unit of mean importance weight (see fit)
    sgd: bool = True  # plain SGD: VW's per-feature adaptive rates let rare n-grams memorize single queries
    l2: float = 0.0
    text: bool = True  # cross the word and character n-grams with the action
    text_cross: str = "m"  # action namespaces the text crosses: a (key, shape, size), m (workers)
    extra: str = ""  # further VW arguments

    def args(self) -> str:
        # Everything per task: what a word or a length says about a worker on math need not hold on choice.
        crosses = ["ta", "tm", "tla", "tlm"]
        if self.text:
            crosses += [f"t{c}{a}" for c in _TEXT_NS for a in self.text_cross]
        inter = " ".join(f"--interactions {x}" for x in crosses)
        return (f"--cb_explore_adf --cb_type {self.cb_type} --epsilon 0 -b {self.bits} "
                f"-l {self.learning_rate} --l2 {self.l2} {inter} --noconstant --quiet"
                f"{' --sgd' if self.sgd else ''} {self.extra}").strip()


class VWLearner:
    model_file = "model.vw"
    kind = "vw"

    def __init__(self, settings: VWSettings = VWSettings(), seed: int = 0, name: str = "vw"):
        self.settings = settings
        self.seed = seed
        self.name = name
        self._ws = None
        self._action_text: dict[str, str] = {}
        self._shared: dict[int, str] | None = None  # context line by context, while fitting

    def fit(self, examples: Sequence[Logged]) -> dict:
        from vowpalwabbit import Workspace

        # Importance weights 1/p scale every SGD step; divide the rate by their mean so that
        # the same rate suits a uniform logging policy over 10 candidates or over 50.
        mean_w = sum(1.0 / max(e.propensity, 1e-6) for e in examples) / max(len(examples), 1)
        lr = self.settings.learning_rate / mean_w if self.settings.sgd else self.settings.learning_rate
        args = self.settings.args().replace(f"-l {self.settings.learning_rate} ", f"-l {lr:.6g} ")
        self._ws = Workspace(args + f" --random_seed {self.seed}")
        order = list(range(len(examples)))
        rng = random.Random(self.seed)
        self._shared = {}
        try:
            for _ in range(self.settings.passes):
                rng.shuffle(order)
                for i in order:
                    e = examples[i]
                    self._ws.learn(self._lines(e.context, e.actions, e.chosen, -e.reward, e.propensity))
        finally:
            self._shared = None
        return {"args": args, "passes": self.settings.passes, "mean_importance_weight": round(mean_w, 3)}

    def greedy(self, ctx: Context, actions: Sequence[Action]) -> int:
        probs = self._ws.predict(self._lines(ctx, actions))
        return max(range(len(actions)), key=lambda i: (probs[i], -i))

    def save(self, folder: Path) -> list[str]:
        self._ws.save(str(Path(folder) / self.model_file))
        return [self.model_file]

    @classmethod
    def load(cls, folder: Path, meta: dict) -> "VWLearner":
        from vowpalwabbit import Workspace

        s = VWSettings(**meta.get("settings", {}))
        self = cls(s, name=meta.get("name", "vw"))
        self._ws = Workspace(f"-i {Path(folder) / cls.model_file} --epsilon 0 --quiet")
        return self

    def close(self) -> None:
        if self._ws is not None:
            self._ws.finish()
            self._ws = None

    def describe(self) -> dict:
        return {"name": self.name, "settings": self.settings.__dict__}

    def _lines(self, ctx: Context, actions: Sequence[Action], chosen: int | None = None,
               cost: float = 0.0, prob: float = 1.0) -> list[str]:
        shared = self._shared.get(id(ctx)) if self._shared is not None else None
        if shared is None:
            shared = "shared " + " ".join(
                f"|{ns} " + " ".join(f"{k}:{v:.4g}" for k, v in zip(ctx.namespaces[ns], ctx.values[ns]))
                for ns in ctx.namespaces if self.settings.text or ns not in _TEXT_NS)
            if self._shared is not None:
                self._shared[id(ctx)] = shared
        lines = [shared]
        for i, a in enumerate(actions):
            text = self._action_text.get(a.key)
            if text is None:
                text = self._action_text[a.key] = action_features(a)
            lines.append((f"0:{cost:.6g}:{max(prob, 1e-6):.6g} " if i == chosen else "") + text)
        return lines


def action_features(a: Action) -> str:
    """|a: the action itself, its shape and size; |m: its workers (weighted 1/k) and who breaks ties."""
    ident = [_h(f"key={a.key}"), _h(f"shape={a.shape}"), _h(f"size={len(a.solvers)}")]
    if a.finisher:
        ident.append(_h(f"finisher={a.finisher}"))
    w = 1.0 / len(a.solvers)
    members = [f"{_h('w=' + s)}:{w:.4g}" for s in a.solvers] + [str(_h("first=" + a.solvers[0]))]
    members += [str(_h(f"escalate{i}=" + e)) for i, e in enumerate(a.escalation)]
    return "|a " + " ".join(map(str, ident)) + " |m " + " ".join(members)


def _h(s: str) -> int:
    return zlib.crc32(s.encode()) & 0x3FFFFFFF


# ---------------------------------------------------------------- the table baseline


def coverage(examples: Sequence[Logged]) -> dict[tuple[str, str], float]:
    """Per (task, action key): the share of the task's logged queries the action could serve
    (was among the candidates). A replay model that recorded half the questions serves half."""
    queries: dict[str, set[str]] = {}
    served: dict[tuple[str, str], set[str]] = {}
    for e in examples:
        task = e.context.task or "none"
        queries.setdefault(task, set()).add(e.query)
        for a in e.actions:
            served.setdefault((task, a.key), set()).add(e.query)
    return {k: len(v) / max(len(queries[k[0]]), 1) for k, v in served.items()}


def per_query_means(examples: Sequence[Logged], field: str = "reward") -> dict[tuple[str, str], dict[str, float]]:
    """Per (task, action key): the action's mean `field` on each query it was logged on. Every
    query weighs the same: a sweep logs every candidate of every query once, so weighting by
    1/propensity would favor the queries with more candidates."""
    sums: dict[tuple[str, str], dict[str, list[float]]] = {}
    for e in examples:
        key = (e.context.task or "none", e.actions[e.chosen].key)
        value = float(bool(e.correct)) if field == "correct" else float(getattr(e, field))
        sums.setdefault(key, {}).setdefault(e.query, []).append(value)
    return {k: {q: sum(v) / len(v) for q, v in by_q.items()} for k, by_q in sums.items()}


def candidate_keys(examples: Sequence[Logged]) -> dict[str, dict[str, set[str]]]:
    """Per task and query: the keys of the actions that were candidates there (servable)."""
    out: dict[str, dict[str, set[str]]] = {}
    seen: set[tuple[str, int]] = set()  # examples of one query often share their candidate list
    for e in examples:
        by_q = out.setdefault(e.context.task or "none", {})
        keys = by_q.get(e.query)
        if keys is None:
            keys = by_q[e.query] = set()
        if (e.query, id(e.actions)) not in seen:
            seen.add((e.query, id(e.actions)))
            keys.update(a.key for a in e.actions)
    return out


# When choosing on the figures, an action's unlogged queries count at its logged mean made worse
# by this many standard errors of that mean: one, the Pareto cut's default band.
GUARD_SE = 1.0


@dataclass
class ActionLogs:
    """One action's logs on one task; its figures are per query of the task (`queries`).

    - Queries it was logged on count at its mean there.
    - Queries where it was no candidate (a replay worker without a recorded response) count
      as wrong and free, so that an action is never favored for skipping hard queries.
    - Queries where it was a candidate but was never logged (`unlogged`: any run but a sweep
      draws only some actions per query) are unknown. `mean` counts them at its logged mean
      (servable, they are like the logged ones, not like the unservable ones). `guarded`
      counts them at that mean less GUARD_SE standard errors (cost: plus), since
      choices (the fixed action, the Pareto cut) are made on it: logged on two easy queries,
      an action is 2 of 2 right by luck, and its unlogged queries must not all count as
      right. The penalty is the standard error of the stand-in for those queries, so it
      fades as coverage grows and is 0 on a sweep, where both are the plain mean.
    """

    by_q: dict[str, dict[str, float]]  # field (correct, cost, reward) -> query it was logged on -> its mean there
    queries: int
    unservable: int
    unlogged: list[str]

    @property
    def logged(self) -> int:
        return len(self.by_q["correct"])

    @property
    def n(self) -> int:
        """The queries its figures rest on, the base of their standard error: logged, or known
        to count as wrong and free. Unlogged queries add none: they repeat the logged mean."""
        return self.logged + self.unservable

    def mean(self, field: str) -> float:
        """Per query of the task: logged queries at their means, unlogged ones at the logged
        mean, unservable ones at 0. On a sweep (nothing unlogged), the mean over `n` queries."""
        values = self.by_q[field].values()
        total = sum(values)
        if self.unlogged:
            total += len(self.unlogged) * total / len(values)
        return total / self.queries

    def guarded(self, field: str) -> float:
        total = sum(self.by_q[field].values())
        if self.unlogged:
            total += len(self.unlogged) * self.stand_in(field)
        return total / self.queries

    def stand_in(self, field: str) -> float:
        """What an unlogged query counts as when choosing: the logged mean, worse by GUARD_SE of
        its standard errors. Correctness's spread is taken as at least a Bernoulli's with one
        right and one wrong answer added (so 2 of 2 right still has one), cost's as its sample
        spread (with a single query, as large as its mean)."""
        values = list(self.by_q[field].values())
        s = len(values)
        m = sum(values) / s
        p = (sum(self.by_q["correct"].values()) + 1) / (s + 2)
        spread = sum((x - m) ** 2 for x in values) / (s - 1) if s > 1 else None
        if field == "cost":
            return m + GUARD_SE * math.sqrt((m * m if spread is None else spread) / s)
        var = p * (1 - p) if field == "correct" else max(spread or 0.0, p * (1 - p))
        low = m - GUARD_SE * math.sqrt(var / s)
        return max(low, 0.0) if field == "correct" else low

    def filled(self, field: str) -> dict[str, float]:
        """Per query: the logged means, and the guarded stand-in on the unlogged queries."""
        out = dict(self.by_q[field])
        if self.unlogged:
            out.update(dict.fromkeys(self.unlogged, self.stand_in(field)))
        return out


def action_logs(examples: Sequence[Logged]) -> dict[tuple[str, str], ActionLogs]:
    """Per (task, action key) logged: its `ActionLogs`."""
    cands = candidate_keys(examples)
    by = {f: per_query_means(examples, f) for f in ("correct", "cost", "reward")}
    out = {}
    for (task, key), correct in by["correct"].items():
        queries = cands[task]
        unlogged = [q for q, keys in queries.items() if key in keys and q not in correct]
        unservable = sum(1 for keys in queries.values() if key not in keys)
        out[(task, key)] = ActionLogs({f: by[f][(task, key)] for f in by}, len(queries), unservable, unlogged)
    return out


def action_values(examples: Sequence[Logged], logs: dict[tuple[str, str], ActionLogs] | None = None
                  ) -> dict[str, dict[str, tuple[float, float, int]]]:
    """Per task and action: the guarded mean reward per query (`ActionLogs`: queries it could
    not serve count as wrong and free, unlogged ones at a guarded stand-in), its standard error,
    and the number of queries it was logged on. Counting the unservable queries keeps an
    action measured on the half of the queries it can serve comparable with the others."""
    out: dict[str, dict[str, tuple[float, float, int]]] = {}
    for (task, a), f in (action_logs(examples) if logs is None else logs).items():
        n = f.queries
        values = list(f.by_q["reward"].values()) + [0.0] * f.unservable
        if f.unlogged:
            values += [f.stand_in("reward")] * len(f.unlogged)
        v = f.guarded("reward")
        se = math.sqrt(sum((x - v) ** 2 for x in values) / max(n - 1, 1) / n)
        out.setdefault(task, {})[a] = (v, se, f.logged)
    return out


class TableLearner:
    """Per (task, action): self-normalized IPS mean reward. Unseen actions rank last."""

    model_file = "table.json"
    kind = "table"

    def __init__(self, name: str = "table"):
        self.name = name
        self.values: dict[str, dict[str, float]] = {}
        self.counts: dict[str, dict[str, int]] = {}

    def fit(self, examples: Sequence[Logged], logs: dict[tuple[str, str], ActionLogs] | None = None) -> dict:
        """`logs`: `action_logs(examples)`, when already made."""
        values = action_values(examples, logs)
        self.values = {t: {a: v for a, (v, _, _) in by.items()} for t, by in values.items()}
        self.counts = {t: {a: n for a, (_, _, n) in by.items()} for t, by in values.items()}
        return {"cells": sum(len(v) for v in self.values.values())}

    def greedy(self, ctx: Context, actions: Sequence[Action]) -> int:
        table = self.values.get(ctx.task or "none", {})
        return max(range(len(actions)), key=lambda i: (table.get(actions[i].key, -math.inf), -i))

    def save(self, folder: Path) -> list[str]:
        (Path(folder) / self.model_file).write_bytes(orjson.dumps(
            {"values": self.values, "counts": self.counts}, option=orjson.OPT_INDENT_2))
        return [self.model_file]

    @classmethod
    def load(cls, folder: Path, meta: dict) -> "TableLearner":
        self = cls(meta.get("name", "table"))
        data = orjson.loads((Path(folder) / cls.model_file).read_bytes())
        self.values, self.counts = data["values"], data["counts"]
        return self

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {"name": self.name}


class FixedLearner:
    """Per task, one action for every query. Queries whose candidates lack it get the
    best-valued candidate they have.

    Which action: by default the one with the best mean reward in the logs (accuracy -
    lambda x USD). With `floor` set, the constrained choice instead: the cheapest action
    whose accuracy in the logs is at least the best single worker's + `floor` (0: match
    the best single; -0.01: within a point of it), the best single being the single-worker
    action most accurate in the same logs. That is the question "the least cost at the
    best single's accuracy" asked of the train split, with no lambda to guess. With
    `budget` set, the same kind of target asked from the other side: the most accurate
    action costing at most `budget` x the best single's USD, so an allowance is spent on
    accuracy rather than saved.

    The figures are `ActionLogs.guarded`: on logs that are not a sweep, an action logged on
    a few queries is not chosen for their luck (on a sweep they are the plain means)."""

    model_file = "fixed.json"
    kind = "fixed"

    def __init__(self, name: str = "fixed", floor: float | None = None,
                 reference: dict[str, tuple[str, float, float]] | None = None, budget: float | None = None):
        self.name = name
        self.floor, self.budget = floor, budget
        # Per task: the best single (key, accuracy, USD) the floor is relative to, when measured on
        # more logs than `fit` sees (training cuts dominated actions, the best single among them).
        self.reference = reference or {}
        self.values: dict[str, dict[str, float]] = {}
        self.choice: dict[str, str] = {}
        self.why: dict[str, dict] = {}

    def fit(self, examples: Sequence[Logged], logs: dict[tuple[str, str], ActionLogs] | None = None) -> dict:
        """`logs`: `action_logs(examples)`, when already made (training shares one with the learner)."""
        logs = action_logs(examples) if logs is None else logs
        values = action_values(examples, logs)
        self.values = {t: {a: v for a, (v, _, _) in by.items()} for t, by in values.items()}
        if self.floor is None and self.budget is None:
            self.choice = {t: max(by, key=lambda a: (by[a], a)) for t, by in self.values.items()}
            return {"choice": dict(self.choice)}
        acc, cost = action_means(examples, "correct", True, logs), action_means(examples, "cost", True, logs)
        for t in self.values:
            self.choice[t], self.why[t] = target_choice(acc[t], cost[t], self.floor, self.budget,
                                                        self.reference.get(t))
        return {"choice": dict(self.choice), "floor": self.floor, "budget": self.budget, "why": self.why}

    def greedy(self, ctx: Context, actions: Sequence[Action]) -> int:
        task = ctx.task or "none"
        keys = [a.key for a in actions]
        if self.choice.get(task) in keys:
            return keys.index(self.choice[task])
        table = self.values.get(task, {})
        return max(range(len(actions)), key=lambda i: (table.get(keys[i], -math.inf), -i))

    def save(self, folder: Path) -> list[str]:
        (Path(folder) / self.model_file).write_bytes(orjson.dumps(
            {"choice": self.choice, "values": self.values, "floor": self.floor, "budget": self.budget,
             "why": self.why, "reference": self.reference},
            option=orjson.OPT_INDENT_2))
        return [self.model_file]

    @classmethod
    def load(cls, folder: Path, meta: dict) -> "FixedLearner":
        self = cls(meta.get("name", "fixed"))
        data = orjson.loads((Path(folder) / cls.model_file).read_bytes())
        self.choice, self.values = data["choice"], data["values"]
        self.floor, self.budget, self.why = data.get("floor"), data.get("budget"), data.get("why") or {}
        self.reference = {t: tuple(r) for t, r in (data.get("reference") or {}).items()}
        return self

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        out = {"name": self.name, "choice": dict(self.choice)}
        if self.floor is not None or self.budget is not None:
            out.update(floor=self.floor, budget=self.budget, why=self.why)
        return out


class SegmentLearner:
    """Per task and group (the query's `group_by` metadata field), one action for every query
    of the group. Where a task's groups differ in which workers answer them well (MMLU-Pro's
    subjects), one cascade for all of them pays for the hardest group everywhere.

    A group's action is the one with the best accuracy - lam x USD on the group's queries.
    Many small groups choosing on their own logs overfit: the chosen actions look better on
    the logs than on new queries. So the figures that set `lam` are cross-fitted: the queries
    of each of `folds` folds are scored with the choices made on the other folds, and the
    task-wide choice (no groups: the best fixed action; with a floor, the cheapest whose
    task-wide accuracy reaches it, as `FixedLearner`) is scored the same way beside them.
    Without a floor, lam is the training lambda, and the groups are used only if their
    cross-fitted reward beats the task-wide choice's. With a floor, the cheapest by
    cross-fitted cost among the lams (and the task-wide choice) whose cross-fitted accuracy
    reaches the best single's + floor wins (the most accurate when none does). With a budget,
    the most accurate by cross-fitted accuracy among those whose cross-fitted USD is at most
    budget x the best single's (the cheapest when none is). Queries of
    groups with fewer than `min_group` queries, of groups never seen, or without a group
    take the task-wide choice.

    A group's own logs are few, so its choice also weighs the task-wide logs, counted as
    `shrink` queries (an action's group mean is pulled toward its task-wide mean: empirical-Bayes
    shrinkage). Without it, with 100 actions and a hundred queries a group, the choice that
    looks best on a group is mostly the luckiest. Each of `shrinks` is a setting, cross-fitted
    with lam; 0 is the group's logs alone."""

    model_file = "segment.json"
    kind = "segment"

    shrinks = (0.0, 20.0, 50.0, 100.0, 200.0, 400.0)  # queries' worth of task-wide logs, per group

    def __init__(self, name: str = "segment", lam: float = 0.0, floor: float | None = None,
                 reference: dict[str, tuple[str, float, float]] | None = None, folds: int = 5,
                 min_group: int = 20, seed: int = 0, budget: float | None = None,
                 shrinks: Sequence[float] | None = None):
        self.name, self.lam, self.floor, self.folds, self.min_group, self.seed = name, lam, floor, folds, min_group, seed
        self.budget = budget
        if shrinks is not None:
            if not shrinks or not all(0 <= k < math.inf for k in shrinks):
                raise ValueError(f"shrinks must be a non-empty list of finite weights >= 0, not {list(shrinks)}")
            self.shrinks = tuple(float(k) for k in shrinks)
        self.reference = reference or {}
        self.choice: dict[str, dict] = {}  # task -> {"all": key, "groups": {group: key}}
        self.scores: dict[str, dict[str, float]] = {}  # task -> action -> accuracy - lam x USD, task-wide
        self.why: dict[str, dict] = {}

    def fit(self, examples: Sequence[Logged], logs: dict[tuple[str, str], ActionLogs] | None = None) -> dict:
        """`logs`: `action_logs(examples)`, when already made (training shares one with the fixed action)."""
        # Per query, the unlogged ones (a run that did not draw the action there) at guarded stand-ins
        # (`ActionLogs`), so that an action logged on a few queries of a group wins it on no luck.
        logs = action_logs(examples) if logs is None else logs
        acc = {k: f.filled("correct") for k, f in logs.items()}
        cost = {k: f.filled("cost") for k, f in logs.items()}
        groups = {e.query: e.context.group for e in examples}
        singles = best_singles(examples, logs)
        by_task: dict[str, set[str]] = {}
        for e in examples:
            by_task.setdefault(e.context.task or "none", set()).add(e.query)
        for task, queries in sorted(by_task.items()):
            actions = sorted(a for (t, a) in acc if t == task)
            table = _SegmentTable(task, sorted(queries), actions, acc, cost, groups, self.folds, self.min_group,
                                  self.seed)
            reference = self.reference.get(task) or singles.get(task) or (actions[0], 0.0, 0.0)
            if self.floor is not None or self.budget is not None:
                table.target = (self.floor, self.budget, reference)
            pick, self.why[task] = self._setting(table, reference)
            self.choice[task] = table.choose(pick.lam, pick.grouped, pick.shrink)
            self.scores[task] = table.scores(pick.lam)
        return {"choice": self.choice, "why": self.why}

    def _setting(self, table: "_SegmentTable", reference: tuple[str, float, float]) -> tuple["_Setting", dict]:
        """The setting (lam, grouped, shrink) to plan with, each candidate scored by its
        cross-fitted accuracy and USD; ties go to the task-wide choice, then the larger shrink."""
        def setting(lam: float, grouped: bool = True, shrink: float = 0.0) -> _Setting:
            return _Setting(lam, grouped, shrink, *table.crossfit(lam, grouped, shrink))

        wide = setting(self.lam, grouped=False)  # no groups: the task-wide choice
        lams = table.lambdas() if self.floor is not None or self.budget is not None else [self.lam]
        tried = [wide] + [setting(lam, True, k) for lam in lams for k in self.shrinks]
        if self.budget is not None:
            cap = self.budget * reference[2]
            ok = [t for t in tried if t.usd <= cap + 1e-15]
            pick = (max(ok, key=lambda t: (t.accuracy, -t.usd, not t.grouped, t.lam, t.shrink)) if ok
                    else min(tried, key=lambda t: (t.usd, -t.accuracy, t.grouped, -t.shrink)))
            reached = bool(ok)
        elif self.floor is None:
            pick = max(tried, key=lambda t: (t.accuracy - self.lam * t.usd, not t.grouped, t.shrink))
            reached = None
        else:
            need = reference[1] + self.floor
            ok = [t for t in tried if t.accuracy >= need - 1e-12]
            pick = (min(ok, key=lambda t: (t.usd, -t.accuracy, t.grouped, -t.lam, -t.shrink)) if ok
                    else max(tried, key=lambda t: (t.accuracy, -t.usd, not t.grouped, t.shrink)))
            reached = bool(ok)
        why = {"lambda": pick.lam, "grouped": pick.grouped, "shrink": pick.shrink if pick.grouped else None,
               "crossfit_accuracy": pick.accuracy, "crossfit_usd": pick.usd,
               "task_wide_crossfit": [wide.accuracy, wide.usd], "shrinks_tried": list(self.shrinks),
               "groups": table.counts()}
        if self.floor is not None or self.budget is not None:
            why.update(reached=reached, lambdas_tried=len(lams), best_single=reference[0],
                       best_single_accuracy=reference[1], best_single_usd=reference[2])
            if self.budget is not None:
                why.update(budget=self.budget, cap_usd=self.budget * reference[2])
            else:
                why.update(need_accuracy=reference[1] + self.floor)
        return pick, why

    def greedy(self, ctx: Context, actions: Sequence[Action]) -> int:
        task = ctx.task or "none"
        keys = [a.key for a in actions]
        choice = self.choice.get(task, {})
        for key in (choice.get("groups", {}).get(ctx.group), choice.get("all")):
            if key in keys:
                return keys.index(key)
        scores = self.scores.get(task, {})
        return max(range(len(actions)), key=lambda i: (scores.get(keys[i], -math.inf), -i))

    def save(self, folder: Path) -> list[str]:
        (Path(folder) / self.model_file).write_bytes(orjson.dumps(
            {"choice": self.choice, "scores": self.scores, "why": self.why, "lam": self.lam, "floor": self.floor,
             "budget": self.budget, "reference": self.reference, "folds": self.folds, "min_group": self.min_group,
             "seed": self.seed, "shrinks": list(self.shrinks)},
            option=orjson.OPT_INDENT_2))
        return [self.model_file]

    @classmethod
    def load(cls, folder: Path, meta: dict) -> "SegmentLearner":
        data = orjson.loads((Path(folder) / cls.model_file).read_bytes())
        self = cls(meta.get("name", "segment"), lam=data["lam"], floor=data["floor"],
                   reference={t: tuple(r) for t, r in data["reference"].items()}, folds=data["folds"],
                   min_group=data["min_group"], seed=data["seed"], budget=data.get("budget"),
                   shrinks=data.get("shrinks", [0.0]))  # artifacts from before shrinkage chose on the group alone
        self.choice, self.scores, self.why = data["choice"], data["scores"], data["why"]
        return self

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {"name": self.name, "floor": self.floor, "budget": self.budget, "folds": self.folds,
                "min_group": self.min_group, "shrinks": list(self.shrinks), "why": self.why}


@dataclass(frozen=True)
class _Setting:
    """One way the segment learner may plan, with its cross-fitted figures per query."""

    lam: float
    grouped: bool
    shrink: float
    accuracy: float
    usd: float


class _SegmentTable:
    """One task's logs as sums per (action, segment, fold), so each lam is scored in
    O(actions x segments x folds). A segment is a group with at least `min_group` queries;
    the rest of the task's queries form the segment None, which takes the task-wide choice:
    the best at lam, or with a `target` (floor, budget, best single) `target_choice`'s."""

    target: tuple[float | None, float | None, tuple[str, float, float]] | None = None  # floor, budget, best single

    def __init__(self, task: str, queries: list[str], actions: list[str],
                 acc: dict[tuple[str, str], dict[str, float]], cost: dict[tuple[str, str], dict[str, float]],
                 groups: dict[str, str | None], folds: int, min_group: int, seed: int):
        self.actions, self.total = actions, len(queries)
        sizes = Counter(groups.get(q) for q in queries)
        seg = {q: g if g is not None and sizes[g] >= min_group else None for q in queries for g in [groups.get(q)]}
        self.segments = sorted(set(seg.values()), key=lambda s: (s is None, s or ""))
        self.folds = max(2, min(folds, len(queries)))
        index = {s: i for i, s in enumerate(self.segments)}
        cell = {q: (index[seg[q]], zlib.crc32(f"{seed}:{q}".encode()) % self.folds) for q in queries}
        self.n = [[0] * self.folds for _ in self.segments]
        for i, k in cell.values():
            self.n[i][k] += 1
        self.sums: dict[str, list[list[list[float]]]] = {}  # action -> [segment][fold] -> [correct, usd]
        for a in actions:
            c_by, u_by = acc.get((task, a), {}), cost.get((task, a), {})
            sums = [[[0.0, 0.0] for _ in range(self.folds)] for _ in self.segments]
            for q, (i, k) in cell.items():  # a query where the action was no candidate counts as wrong and free
                sums[i][k][0] += c_by.get(q, 0.0)
                sums[i][k][1] += u_by.get(q, 0.0)
            self.sums[a] = sums
        self._sums: dict[tuple, tuple[float, float, int]] = {}

    def _sum(self, a: str, rows: Sequence[int] | None = None, without: int | None = None) -> tuple[float, float, int]:
        """Correct answers, USD and queries of action `a` over the segments `rows` (all by
        default), leaving out fold `without`. Memoized: every setting asks for the same sums."""
        key = (a, None if rows is None else tuple(rows), without)
        if key not in self._sums:
            c = u = 0.0
            n = 0
            for i in range(len(self.segments)) if rows is None else rows:
                for k, (ci, ui) in enumerate(self.sums[a][i]):
                    if k != without:
                        c, u, n = c + ci, u + ui, n + self.n[i][k]
            self._sums[key] = (c, u, n)
        return self._sums[key]

    def _pick(self, lam: float, rows: Sequence[int] | None, without: int | None, shrink: float = 0.0) -> str:
        """The best action at lam on the segments `rows`, their mean pulled toward the
        task-wide mean as if it were `shrink` more queries."""
        def value(a: str) -> tuple:
            c, u, n = self._sum(a, rows, without)
            if not shrink:
                return c - lam * u, -u, a
            wc, wu, wn = self._sum(a, None, without)
            return (c - lam * u + shrink * (wc - lam * wu) / max(wn, 1)) / (n + shrink), -u, a
        return max(self.actions, key=value)

    def _everyone(self, lam: float, without: int | None) -> str:
        if self.target is None:
            return self._pick(lam, None, without)
        sums = {a: self._sum(a, None, without) for a in self.actions}
        acc = {a: c / max(n, 1) for a, (c, _, n) in sums.items()}
        usd = {a: u / max(n, 1) for a, (_, u, n) in sums.items()}
        return target_choice(acc, usd, *self.target)[0]

    def _choices(self, lam: float, without: int | None, grouped: bool = True, shrink: float = 0.0) -> list[str]:
        everyone = self._everyone(lam, without)
        return [everyone if s is None or not grouped else self._pick(lam, [i], without, shrink)
                for i, s in enumerate(self.segments)]

    def choose(self, lam: float, grouped: bool = True, shrink: float = 0.0) -> dict:
        picks = self._choices(lam, None, grouped, shrink)
        return {"all": self._everyone(lam, None),
                "groups": {s: a for s, a in zip(self.segments, picks) if s is not None and grouped}}

    def crossfit(self, lam: float, grouped: bool = True, shrink: float = 0.0) -> tuple[float, float]:
        """Accuracy and USD per query when every fold is planned with the other folds' choices."""
        c = u = 0.0
        for k in range(self.folds):
            for i, a in enumerate(self._choices(lam, k, grouped, shrink)):
                c, u = c + self.sums[a][i][k][0], u + self.sums[a][i][k][1]
        return c / self.total, u / self.total

    def scores(self, lam: float) -> dict[str, float]:
        return {a: (c - lam * u) / self.total for a in self.actions for c, u, _ in [self._sum(a)]}

    def lambdas(self) -> list[float]:
        """0 and a geometric grid around the price of accuracy of these actions: from a tenth
        to a thousand accuracy points per the dearest action's USD per query."""
        dearest = max((self._sum(a)[1] / self.total for a in self.actions), default=0.0)
        if dearest <= 0:
            return [0.0]
        return [0.0] + [0.1 / dearest * 10 ** (i / 20) for i in range(81)]

    def counts(self) -> dict[str, int]:
        return {("(task-wide)" if s is None else s): sum(self.n[i]) for i, s in enumerate(self.segments)}


def action_means(examples: Sequence[Logged], field: str, guarded: bool = False,
                 logs: dict[tuple[str, str], ActionLogs] | None = None) -> dict[str, dict[str, float]]:
    """Per task and action: the mean `field` ("correct" or "cost") per query of the task
    (`ActionLogs.mean`: a query it could not serve counts as wrong and free, as in
    `action_values`); with `guarded`, `ActionLogs.guarded`, the figures choices are made on.
    `logs`: `action_logs(examples)`, when already made."""
    out: dict[str, dict[str, float]] = {}
    for (task, a), f in (action_logs(examples) if logs is None else logs).items():
        out.setdefault(task, {})[a] = f.guarded(field) if guarded else f.mean(field)
    return out


def best_singles(examples: Sequence[Logged], logs: dict[tuple[str, str], ActionLogs] | None = None
                 ) -> dict[str, tuple[str, float, float]]:
    """Per task: the single-worker action most accurate in the logs (ties: the cheaper), as
    (key, accuracy, USD): the best single worker, chosen as the evaluation chooses it. On
    guarded figures (`ActionLogs`), as the fixed action is chosen. `logs`: `action_logs(examples)`,
    when already made (only correctness and cost count: rewards at any lambda give the same)."""
    logs = action_logs(examples) if logs is None else logs
    acc, cost = action_means(examples, "correct", True, logs), action_means(examples, "cost", True, logs)
    return {t: _best_single(by, cost[t]) for t, by in acc.items() if any(a.startswith("single:") for a in by)}


def _best_single(acc: dict[str, float], cost: dict[str, float]) -> tuple[str, float, float]:
    """The most accurate single action among `acc` (ties: the cheaper), as (key, accuracy, USD)."""
    singles = [a for a in acc if a.startswith("single:")] or list(acc)
    best = max(singles, key=lambda a: (acc[a], -cost[a], a))
    return best, acc[best], cost[best]


def floor_choice(acc: dict[str, float], cost: dict[str, float], floor: float,
                 reference: tuple[str, float, float] | None = None) -> tuple[str, dict]:
    """The cheapest action with accuracy >= the best single's + `floor` (ties: the more
    accurate, then the key); the most accurate action when none reaches it. The best single
    is `reference` when given, else the most accurate single action among `acc`."""
    reference = reference or _best_single(acc, cost)
    need = reference[1] + floor
    ok = [a for a in acc if acc[a] >= need - 1e-12]
    pick = (min(ok, key=lambda a: (cost[a], -acc[a], a)) if ok
            else max(acc, key=lambda a: (acc[a], -cost[a], a)))
    return pick, {"best_single": reference[0], "best_single_accuracy": reference[1], "need_accuracy": need,
                  "accuracy": acc[pick], "usd": cost[pick], "best_single_usd": reference[2], "reached": bool(ok)}


def budget_choice(acc: dict[str, float], cost: dict[str, float], budget: float,
                  reference: tuple[str, float, float] | None = None) -> tuple[str, dict]:
    """The most accurate action costing at most `budget` x the best single's USD (ties: the
    cheaper, then the key); the cheapest action when none fits. The best single is
    `reference` when given, else the most accurate single action among `acc`."""
    reference = reference or _best_single(acc, cost)
    cap = budget * reference[2]
    ok = [a for a in acc if cost[a] <= cap + 1e-15]
    pick = (max(ok, key=lambda a: (acc[a], -cost[a], a)) if ok
            else min(acc, key=lambda a: (cost[a], -acc[a], a)))
    return pick, {"best_single": reference[0], "best_single_accuracy": reference[1], "budget": budget,
                  "cap_usd": cap, "accuracy": acc[pick], "usd": cost[pick], "best_single_usd": reference[2],
                  "reached": bool(ok)}


def target_choice(acc: dict[str, float], cost: dict[str, float], floor: float | None, budget: float | None,
                  reference: tuple[str, float, float] | None = None) -> tuple[str, dict]:
    """The fixed action of a constrained objective: `floor_choice` or `budget_choice`."""
    if budget is not None:
        return budget_choice(acc, cost, budget, reference)
    return floor_choice(acc, cost, floor, reference)


def make_learner(name: str, seed: int = 0, **vw_options) -> VWLearner | TableLearner | FixedLearner | SegmentLearner:
    if name == "vw":
        return VWLearner(VWSettings(**vw_options), seed=seed, name="vw")
    if name == "vw-task":
        return VWLearner(VWSettings(**{**vw_options, "text": False}), seed=seed, name="vw-task")
    if name == "table":
        return TableLearner()
    if name == "fixed":
        return FixedLearner()
    if name == "segment":
        return SegmentLearner(seed=seed)
    raise ValueError(f"unknown learner {name!r} (choose from {', '.join(LEARNERS)})")


def load_learner(folder: Path, meta: dict) -> VWLearner | TableLearner | FixedLearner | SegmentLearner:
    kind = meta.get("kind")
    if kind == "vw":
        return VWLearner.load(folder, meta)
    if kind == "table":
        return TableLearner.load(folder, meta)
    if kind == "fixed":
        return FixedLearner.load(folder, meta)
    if kind == "segment":
        return SegmentLearner.load(folder, meta)
    raise ValueError(f"unknown learner kind {kind!r}")
