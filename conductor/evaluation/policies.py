"""The policies the evaluation compares, each reduced to per-query means.

Table policies choose rows of the recorded matrix (see `table`):
- single worker: that worker on every query; a question it never answered
  counts as wrong, costs nothing and makes no call (the pipeline plans no step
  for a worker with no recorded answer, so its runs make none there either);
- best single: the single worker with the highest accuracy on the selection
  set (the train split when the test split is evaluated, else the evaluated
  queries), ties to the cheaper; chosen once by our grader and once by the labels;
- oracle: per question the cheapest correct recorded response; a question no
  worker answered correctly costs nothing and makes no call (as the reference
  figures count it); again once per way of judging "correct", over the
  questions that way can judge (the labels' oracle leaves unlabelled ones out);
- uniform random: a worker drawn uniformly per question among those that
  recorded it; reported as its exact expected value, so no seed is involved.

Two accuracies, never mixed: `accuracy` is our grader's, over the queries that
have a reference (`graded` of them); `accuracy_labels` is the recorded labels',
over the queries whose rows all have a label (all of them, unless some `correct`
is null). Both count a query that no worker of the pool recorded: every policy
gets it wrong at no call and no cost, as the pipeline's
runs do, so the table and the pipeline rows share their denominators. A table
without references has no grader figures at all, and no policy chosen by our
grader; one without labels, none by the labels.

The embedded planner runs through the real pipeline instead (`planner`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl

from conductor.evaluation.table import Matrix


@dataclass
class Policy:
    kind: str  # single | best_single | oracle | random | planner | learned | fixed | fixed_cascade
    name: str
    accuracy: float | None  # graded by conductor.grading, over the `graded` queries; None when none is
    accuracy_labels: float | None  # the recorded `correct` labels, over the labelled queries; None when none is
    usd_per_query: float | None
    calls_per_query: float
    tokens_per_query: float
    queries: int
    worker: str | None = None
    coverage: float | None = None  # share of the queries the worker has a recorded response to
    info: dict[str, Any] = field(default_factory=dict)
    graded: int | None = None  # queries with a reference: the denominator of `accuracy`
    # Per graded query id: correct by our grader, and cost; for paired standard errors (not serialized).
    outcomes: dict[str, tuple[bool, float]] | None = field(default=None, repr=False, compare=False)

    @property
    def se(self) -> float | None:
        """Standard error of `accuracy` (queries as independent draws)."""
        if self.accuracy is None or not self.graded:
            return None
        return math.sqrt(self.accuracy * (1 - self.accuracy) / self.graded)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("outcomes", None)
        d["se"] = self.se
        return d


def paired(a: Policy, b: Policy, lam: float = 0.0) -> tuple[float, float] | None:
    """Mean of (a - b) in reward (correct - lam x USD) over the queries both judged, and its
    standard error: the same queries on both sides, so their shared difficulty cancels."""
    if not a.outcomes or not b.outcomes:
        return None
    ids = sorted(set(a.outcomes) & set(b.outcomes))
    if len(ids) < 2:
        return None
    d = [(a.outcomes[q][0] - lam * a.outcomes[q][1]) - (b.outcomes[q][0] - lam * b.outcomes[q][1]) for q in ids]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / (len(d) - 1)
    return mean, math.sqrt(var / len(d))


METRICS = {"grader": "our grader", "label": "labels"}


def table_policies(m: Matrix, eval_ids: list[str], select_ids: list[str]) -> list[Policy]:
    n = len(eval_ids)
    g = len(m.graded_ids.intersection(eval_ids))
    nl = len(m.labelled_ids.intersection(eval_ids))
    rows = m.rows.filter(pl.col("question_id").is_in(eval_ids))
    singles = _singles(rows, m.workers, n, g, nl)
    out = list(singles.values())
    g_sel = len(m.graded_ids.intersection(select_ids))
    nl_sel = len(m.labelled_ids.intersection(select_ids))
    chosen = _singles(m.rows.filter(pl.col("question_id").is_in(select_ids)), m.workers, len(select_ids), g_sel,
                      nl_sel)
    judged = {"grader": (g, g_sel), "label": (nl, nl_sel)}
    for metric, said in METRICS.items():
        if not all(judged[metric]):
            continue  # no reference to grade by (no label): nothing is chosen by our grader (the labels)
        best = max(chosen.values(), key=lambda p: (_acc(p, metric), -(p.usd_per_query or 0.0)))
        pick = singles[best.worker]
        out.append(Policy("best_single", f"best single ({said}): {pick.worker}", pick.accuracy,
                          pick.accuracy_labels, pick.usd_per_query, pick.calls_per_query, pick.tokens_per_query, n,
                          worker=pick.worker, coverage=pick.coverage, graded=g,
                          info={"chosen_by": metric, "chosen_on_queries": len(select_ids),
                                "chosen_accuracy": _acc(best, metric), "chosen_usd": best.usd_per_query},
                          outcomes=_outcomes(rows, pick.worker, m.graded_ids.intersection(eval_ids))))
    graded, labelled = m.graded_ids.intersection(eval_ids), m.labelled_ids.intersection(eval_ids)
    for metric, said in METRICS.items():
        if not judged[metric][0]:
            continue
        out.append(_oracle(rows, graded, labelled, metric, said))
    out.append(_random(rows, n, g, nl))
    return out


def _outcomes(rows: pl.DataFrame, worker: str, graded: set[str] | frozenset[str]) -> dict[str, tuple[bool, float]]:
    """Per graded query: the worker's verdict and cost (a question it never answered: wrong, $0)."""
    mine = {q: (bool(c), float(u)) for q, c, u in rows.filter(pl.col("worker") == worker)
            .select("question_id", pl.col("grader").fill_null(False), "cost").iter_rows()}
    return {q: mine.get(q, (False, 0.0)) for q in graded}


def _acc(p: Policy, metric: str) -> float:
    return (p.accuracy if metric == "grader" else p.accuracy_labels) or 0.0


def _singles(rows: pl.DataFrame, workers: list[str], n: int, g: int, nl: int) -> dict[str, Policy]:
    agg = {r["worker"]: r for r in rows.group_by("worker").agg(
        pl.col("grader").sum().alias("g"), pl.col("label").sum().alias("l"),
        pl.col("cost").sum().alias("usd"), pl.col("tokens").sum().alias("tok"), pl.len().alias("k")).to_dicts()}
    out = {}
    for w in workers:
        r = agg.get(w, {"g": 0, "l": 0, "usd": 0.0, "tok": 0, "k": 0})
        out[w] = Policy("single", w, r["g"] / g if g else None, r["l"] / nl if nl else None,
                        r["usd"] / n if n else None, r["k"] / n if n else 0.0, r["tok"] / n if n else 0.0, n,
                        worker=w, coverage=r["k"] / n if n else None, graded=g)
    return out


def _oracle(rows: pl.DataFrame, graded: set[str], labelled: set[str], metric: str, said: str) -> Policy:
    """Per question the cheapest row correct by `metric`; its accuracy by the other way of
    judging is reported in that way's own column. Over the questions `metric` can judge only:
    on an unlabelled question the labels' oracle can choose nothing, and counting that as
    wrong and free made it look worse and cheaper than it is."""
    over = graded if metric == "grader" else labelled
    n, g, nl = len(over), len(graded & over), len(labelled & over)
    best = (rows.filter(pl.col("question_id").is_in(list(over)) & pl.col(metric))
            .sort(["question_id", "cost", "tokens", "worker"]).group_by("question_id", maintain_order=True).first())
    k = best.height
    by_grader = (k if metric == "grader" else best.get_column("grader").sum()) / g if g else None
    by_label = (k if metric == "label" else best.get_column("label").sum()) / nl if nl else None
    return Policy("oracle", f"oracle ({said})", by_grader, by_label, best.get_column("cost").sum() / n, k / n,
                  best.get_column("tokens").sum() / n, n, info={"correct_by": metric}, graded=g)


def _random(rows: pl.DataFrame, n: int, g: int, nl: int) -> Policy:
    per_q = rows.group_by("question_id").agg(
        pl.col("grader").cast(pl.Float64).mean(), pl.col("label").cast(pl.Float64).mean(),
        pl.col("cost").mean(), pl.col("tokens").cast(pl.Float64).mean())
    s = per_q.select(pl.col("grader", "label", "cost", "tokens").sum()).row(0, named=True)
    return Policy("random", "uniform random (expected)", s["grader"] / g if g else None,
                  s["label"] / nl if nl else None,
                  s["cost"] / n, per_q.height / n, s["tokens"] / n, n, graded=g)
