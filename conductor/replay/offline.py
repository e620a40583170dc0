"""Policy actions played on a replay table's recorded answers in memory, by the executor's rules.

The pipeline runs a plan against the replay server; this answers the same question for
every (action, question) pair at once, for analyses that need many more of them than a run
would be worth (bench/ceiling.py, bench/resplit.py). A step's condition goes through the
executor's `condition_holds`, a `vote` step through the `vote` function worker, the answer
is the last step's that ran, and each call costs its recorded tokens at the worker's price
(completion tokens capped at max_tokens and prompt tokens at their bytes, as the executor
counts them) or the row's recorded `cost_usd`.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable

import polars as pl

from conductor.execute.engine import condition_holds
from conductor.execute.prices import call_cost
from conductor.functions import vote
from conductor.grading import answers_agree, grade
from conductor.plans import validate_plan
from conductor.policy.actions import Action
from conductor.pool import Pool
from conductor.replay.tables import COST_COLUMN, charged_tokens_in, read_table, replay_workers, with_tokens


class Recorded:
    """Per worker id and query id: the response the replay server returns for the query's
    question, whether our grader marks it correct, and what the call costs. The server
    answers by question text, the first row per model in table order (two question ids can
    share a text), so this does too."""

    def __init__(self, table: Path, pool: Pool, references: dict[str, str], task: str):
        self.pool, self.references, self.task = pool, references, task
        worker_of = {model: wid for wid, model in replay_workers(pool).items()}
        price = {w.id: w.price for w in pool.workers}
        cap = {w.id: w.max_tokens() for w in pool.workers}  # the executor counts no more (engine._clamped)
        t = with_tokens(read_table(table, ["question_id", "question", "model", "response"])
                        .filter(pl.col("model").is_in(list(worker_of)))).with_columns(
            charged_tokens_in().alias("tokens_in"))
        text_of = dict(t.filter(pl.col("question_id").is_in(list(references)))
                       .select("question_id", "question").unique("question_id", keep="first").iter_rows())
        wanted = set(text_of.values())
        first: dict[tuple[str, str], tuple[str | None, float]] = {}
        cols = ["question", "model", "response", "tokens_in", "tokens_out"]
        recorded_cost = t.get_column(COST_COLUMN).to_list() if COST_COLUMN in t.columns else [None] * t.height
        for (question, model, response, t_in, t_out), usd in zip(t.select(cols).iter_rows(), recorded_cost):
            if question in wanted and (model, question) not in first:
                wid = worker_of[model]
                if usd is None:
                    usd = call_cost(price[wid], t_in, min(t_out, cap[wid])) or 0.0
                first[(model, question)] = (response, usd)
        self.text: dict[str, dict[str, str]] = defaultdict(dict)
        self.ok: dict[str, dict[str, bool]] = defaultdict(dict)
        self.usd: dict[str, dict[str, float]] = defaultdict(dict)
        for q, question in text_of.items():
            for model, wid in worker_of.items():
                response, usd = first.get((model, question), (None, 0.0))
                if response is None:
                    continue
                self.text[wid][q] = response
                self.ok[wid][q] = grade(task, response, references[q]).correct
                self.usd[wid][q] = usd
        self.agree = functools.lru_cache(maxsize=None)(lambda a, b: answers_agree(task, a, b))

    def play(self, action: Action, ids: Iterable[str]) -> dict[str, tuple[bool, float, Counter]]:
        """Per query id: (correct, USD, calls per worker) of the action's plan. A step whose
        worker has no recorded answer fails the plan (wrong, and what ran is still paid)."""
        steps = action.steps("solve")
        plan = validate_plan(steps, self.pool, max_steps=len(steps))
        out = {}
        for q in ids:
            outputs: dict[int, str] = {}
            calls: Counter = Counter()
            usd, failed = 0.0, False
            for i, step in enumerate(plan.steps):
                if step.when is not None and not condition_holds(step.when, outputs, self.task, self.agree)[0]:
                    continue
                if step.access and not any(j in outputs for j in step.access):
                    continue  # every step it may see was skipped (engine.run_steps)
                if step.worker == "vote":
                    try:
                        outputs[i] = vote([outputs[j] for j in step.access if j in outputs], self.task)
                    except ValueError:  # no answer to vote on: the plan fails
                        failed = True
                        break
                    continue
                if q not in self.text[step.worker]:
                    failed = True
                    break
                calls[step.worker] += 1
                usd += self.usd[step.worker][q]
                outputs[i] = self.text[step.worker][q]
            correct = False
            last = max(outputs, default=None)
            if not failed and last is not None:
                worker = plan.steps[last].worker
                correct = (grade(self.task, outputs[last], self.references[q]).correct if worker == "vote"
                           else self.ok[worker][q])
            out[q] = (bool(correct), usd, calls)
        return out
