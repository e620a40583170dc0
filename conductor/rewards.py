"""Rewards per plan and group-normalized advantages per query, as GRPO uses them.

Reward (the published scheme, configurable): 1 correct, 0.5 parsed but wrong,
0 when no answer could be read, the plan was invalid or its execution failed;
minus `cost_penalty` x USD when a cost penalty is set, the USD being what the
plan's answers cost when first paid for (runner._full_costs), so a plan served
from the cache is charged like the first; rewards' `cost_usd` column is instead
what the run paid (0 for cache hits). Plans of queries with
no task or no reference are not graded (reward null). Plans stopped by a budget
are not graded either: they have no answer yet, and a rerun finishes them.

Advantage: for the K plans of one query, (r - mean) / (std + eps), with the
sample standard deviation (as TRL computes it); 0 for a group of one.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from conductor.grading import grade


@dataclass(frozen=True)
class RewardScheme:
    correct: float = 1.0
    wrong: float = 0.5
    unparsed: float = 0.0
    invalid_plan: float = 0.0
    failed: float = 0.0
    cost_penalty: float = 0.0  # reward points per USD
    eps: float = 1e-4


def score(status: str, task: str | None, reference: str | None, answer_text: str | None,
          cost: float | None, scheme: RewardScheme, graded: Grade | None = None) -> dict[str, Any]:
    """Grade one plan's outcome: answer, parsed, correct, reward. `graded`: its answer's grade, when
    the caller graded many at once (grading.grade_all)."""
    if task == "record":  # enrichment rows: scored by their job (conductor.enrich), not by a grader
        return {"answer": None, "parsed": None, "correct": None, "reward": None}
    if status == "budget_exhausted" or task is None or reference is None:
        g = (graded or grade(task, answer_text, None)) if status == "ok" else None
        return {"answer": g.answer if g else None, "parsed": g.parsed if g else None,
                "correct": None, "reward": None}
    if status == "invalid_plan":
        return {"answer": None, "parsed": False, "correct": False, "reward": scheme.invalid_plan}
    if status != "ok":
        base, g = scheme.failed, None
    else:
        g = graded or grade(task, answer_text, reference)
        base = scheme.correct if g.correct else (scheme.wrong if g.parsed else scheme.unparsed)
    reward = base - scheme.cost_penalty * (cost or 0.0)
    return {"answer": g.answer if g else None, "parsed": g.parsed if g else False,
            "correct": bool(g.correct) if g else False, "reward": reward}


def group_advantages(rewards: list[float | None], eps: float = 1e-4) -> list[float | None]:
    scored = [r for r in rewards if r is not None]
    if len(scored) < 2:
        return [None if r is None else 0.0 for r in rewards]
    mean = statistics.fmean(scored)
    std = statistics.stdev(scored)
    return [None if r is None else (r - mean) / (std + eps) for r in rewards]
