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

Planning asks for the greedy action and an epsilon-greedy distribution over
the candidates: (1 - eps) on the greedy action plus eps spread evenly, the
distribution VW's `--epsilon` exploration uses, so the propensity logged with
a sampled plan is exactly its probability under the sampler.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import orjson

from conductor.policy.actions import Action
from conductor.policy.features import Context

LEARNERS = ("vw", "vw-task", "table", "fixed")
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


def action_values(examples: Sequence[Logged]) -> dict[str, dict[str, tuple[float, float, int]]]:
    """Per task and action: the mean reward over the task's queries, its standard error, and
    the number of queries it was logged on. Queries the action was never logged on count as
    reward 0 (wrong, $0), as a single worker's unanswered questions do in the evaluation:
    otherwise an action measured on the half of the queries it can serve would be compared
    with actions measured on all of them."""
    n_task: dict[str, set[str]] = {}
    for e in examples:
        n_task.setdefault(e.context.task or "none", set()).add(e.query)
    out: dict[str, dict[str, tuple[float, float, int]]] = {}
    for (task, a), by_q in per_query_means(examples).items():
        n = len(n_task[task])
        values = list(by_q.values()) + [0.0] * (n - len(by_q))
        v = sum(values) / n
        se = math.sqrt(sum((x - v) ** 2 for x in values) / max(n - 1, 1) / n)
        out.setdefault(task, {})[a] = (v, se, len(by_q))
    return out


class TableLearner:
    """Per (task, action): self-normalized IPS mean reward. Unseen actions rank last."""

    model_file = "table.json"
    kind = "table"

    def __init__(self, name: str = "table"):
        self.name = name
        self.values: dict[str, dict[str, float]] = {}
        self.counts: dict[str, dict[str, int]] = {}

    def fit(self, examples: Sequence[Logged]) -> dict:
        values = action_values(examples)
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
    best single's accuracy" asked of the train split, with no lambda to guess."""

    model_file = "fixed.json"
    kind = "fixed"

    def __init__(self, name: str = "fixed", floor: float | None = None,
                 reference: dict[str, tuple[str, float, float]] | None = None):
        self.name = name
        self.floor = floor
        # Per task: the best single (key, accuracy, USD) the floor is relative to, when measured on
        # more logs than `fit` sees (training cuts dominated actions, the best single among them).
        self.reference = reference or {}
        self.values: dict[str, dict[str, float]] = {}
        self.choice: dict[str, str] = {}
        self.why: dict[str, dict] = {}

    def fit(self, examples: Sequence[Logged]) -> dict:
        values = action_values(examples)
        self.values = {t: {a: v for a, (v, _, _) in by.items()} for t, by in values.items()}
        if self.floor is None:
            self.choice = {t: max(by, key=lambda a: (by[a], a)) for t, by in self.values.items()}
            return {"choice": dict(self.choice)}
        acc, cost = action_means(examples, "correct"), action_means(examples, "cost")
        for t in self.values:
            self.choice[t], self.why[t] = floor_choice(acc[t], cost[t], self.floor, self.reference.get(t))
        return {"choice": dict(self.choice), "floor": self.floor, "why": self.why}

    def greedy(self, ctx: Context, actions: Sequence[Action]) -> int:
        task = ctx.task or "none"
        keys = [a.key for a in actions]
        if self.choice.get(task) in keys:
            return keys.index(self.choice[task])
        table = self.values.get(task, {})
        return max(range(len(actions)), key=lambda i: (table.get(keys[i], -math.inf), -i))

    def save(self, folder: Path) -> list[str]:
        (Path(folder) / self.model_file).write_bytes(orjson.dumps(
            {"choice": self.choice, "values": self.values, "floor": self.floor, "why": self.why,
             "reference": self.reference},
            option=orjson.OPT_INDENT_2))
        return [self.model_file]

    @classmethod
    def load(cls, folder: Path, meta: dict) -> "FixedLearner":
        self = cls(meta.get("name", "fixed"))
        data = orjson.loads((Path(folder) / cls.model_file).read_bytes())
        self.choice, self.values = data["choice"], data["values"]
        self.floor, self.why = data.get("floor"), data.get("why") or {}
        self.reference = {t: tuple(r) for t, r in (data.get("reference") or {}).items()}
        return self

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        out = {"name": self.name, "choice": dict(self.choice)}
        if self.floor is not None:
            out.update(floor=self.floor, why=self.why)
        return out


def action_means(examples: Sequence[Logged], field: str) -> dict[str, dict[str, float]]:
    """Per task and action: the mean `field` ("correct" or "cost") over all the task's
    queries, a query the action was never logged on counting as wrong and free (as in
    `action_values`)."""
    n_task: dict[str, set[str]] = {}
    for e in examples:
        n_task.setdefault(e.context.task or "none", set()).add(e.query)
    out: dict[str, dict[str, float]] = {}
    for (task, a), by_q in per_query_means(examples, field).items():
        out.setdefault(task, {})[a] = sum(by_q.values()) / len(n_task[task])
    return out


def best_singles(examples: Sequence[Logged]) -> dict[str, tuple[str, float, float]]:
    """Per task: the single-worker action most accurate in the logs (ties: the cheaper), as
    (key, accuracy, USD): the best single worker, chosen as the evaluation chooses it."""
    acc, cost = action_means(examples, "correct"), action_means(examples, "cost")
    out = {}
    for t, by in acc.items():
        singles = [a for a in by if a.startswith("single:")]
        if singles:
            best = max(singles, key=lambda a: (by[a], -cost[t][a], a))
            out[t] = (best, by[best], cost[t][best])
    return out


def floor_choice(acc: dict[str, float], cost: dict[str, float], floor: float,
                 reference: tuple[str, float, float] | None = None) -> tuple[str, dict]:
    """The cheapest action with accuracy >= the best single's + `floor` (ties: the more
    accurate, then the key); the most accurate action when none reaches it. The best single
    is `reference` when given, else the most accurate single action among `acc`."""
    if reference is None:
        singles = [a for a in acc if a.startswith("single:")] or list(acc)
        best = max(singles, key=lambda a: (acc[a], -cost[a], a))
        reference = (best, acc[best], cost[best])
    need = reference[1] + floor
    ok = [a for a in acc if acc[a] >= need - 1e-12]
    pick = (min(ok, key=lambda a: (cost[a], -acc[a], a)) if ok
            else max(acc, key=lambda a: (acc[a], -cost[a], a)))
    return pick, {"best_single": reference[0], "best_single_accuracy": reference[1], "need_accuracy": need,
                  "accuracy": acc[pick], "usd": cost[pick], "best_single_usd": reference[2], "reached": bool(ok)}


def make_learner(name: str, seed: int = 0, **vw_options) -> VWLearner | TableLearner | FixedLearner:
    if name == "vw":
        return VWLearner(VWSettings(**vw_options), seed=seed, name="vw")
    if name == "vw-task":
        return VWLearner(VWSettings(**{**vw_options, "text": False}), seed=seed, name="vw-task")
    if name == "table":
        return TableLearner()
    if name == "fixed":
        return FixedLearner()
    raise ValueError(f"unknown learner {name!r} (choose from {', '.join(LEARNERS)})")


def load_learner(folder: Path, meta: dict) -> VWLearner | TableLearner | FixedLearner:
    kind = meta.get("kind")
    if kind == "vw":
        return VWLearner.load(folder, meta)
    if kind == "table":
        return TableLearner.load(folder, meta)
    if kind == "fixed":
        return FixedLearner.load(folder, meta)
    raise ValueError(f"unknown learner kind {kind!r}")
