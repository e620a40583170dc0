"""Statistics over finished runs' files: one run's totals (what every summary of a run
reports: the CLI, the Dagster assets and checks, the evaluation), accuracy and cost per
task of one run, and per worker and task over every run (the observed skills a pool
file can be tuned with)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

@dataclass(frozen=True)
class RunTotals:
    plans: int
    valid_plans: int
    statuses: dict[str, int]
    calls: int
    cache_hits: int
    graded: int  # plans with a verdict (a reference and a task)
    correct: int
    mean_reward: float | None
    # every step whose price is known, in plans with an unpriced step too: with plans_without_price
    # above 0, a lower bound (what budgets charged), never those plans' priced steps dropped.
    # Planning calls are counted apart.
    cost_usd: float
    plans_without_price: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.graded if self.graded else None

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def run_totals(run_path: Path) -> RunTotals:
    """The totals of one run, from its plans, results and (once graded) rewards files."""
    run_path = Path(run_path)
    plans = pq.read_table(run_path / "plans.parquet", columns=["valid"])
    results = pq.read_table(run_path / "results.parquet",
                            columns=["status", "cost_usd", "calls", "cache_hits", "prompt_tokens",
                                     "completion_tokens"])
    rewards_path = run_path / "rewards.parquet"  # absent until the run is graded
    rewards = (pq.read_table(rewards_path, columns=["correct", "reward"]) if rewards_path.exists()
               else pa.table({"correct": pa.array([], pa.bool_()), "reward": pa.array([], pa.float64())}))
    correct = rewards.column("correct").drop_null()

    def total(table: pa.Table, column: str) -> Any:
        return pc.sum(table.column(column)).as_py() or 0

    return RunTotals(
        plans=plans.num_rows, valid_plans=total(plans, "valid"),
        statuses={d["values"]: d["counts"] for d in pc.value_counts(results.column("status")).to_pylist()},
        calls=total(results, "calls"), cache_hits=total(results, "cache_hits"),
        graded=len(correct), correct=pc.sum(correct).as_py() or 0,
        mean_reward=pc.mean(rewards.column("reward")).as_py(),
        cost_usd=_known_cost(run_path, results),
        plans_without_price=pc.sum(pc.is_null(results.column("cost_usd"))).as_py() or 0,
        prompt_tokens=total(results, "prompt_tokens"), completion_tokens=total(results, "completion_tokens"))


def _known_cost(run_path: Path, results: pa.Table) -> float:
    """The sum over the steps of known price. results' cost_usd is null for a plan with one
    unpriced step, so summing it dropped that plan's priced steps: with every plan of a run
    holding one, the total was $0 while its other calls had been paid."""
    traces = run_path / "traces.parquet"
    if not traces.exists():  # written with results.parquet; without it, the plans of known price alone
        return float(pc.sum(results.column("cost_usd")).as_py() or 0)
    return float(pc.sum(pq.read_table(traces, columns=["cost_usd"]).column("cost_usd")).as_py() or 0)


BY_TASK = pa.schema([("task", pa.string()), ("plans", pa.int64()), ("graded", pa.int64()),
                     ("accuracy", pa.float64()), ("cost_usd", pa.float64()), ("cost_per_plan_usd", pa.float64())])


def by_task(rewards_path: Path) -> list[dict]:
    """One row per task of a run's rewards: plans, graded plans, accuracy and cost."""
    t = pq.read_table(rewards_path, columns=["task", "correct", "cost_usd"])
    t = t.set_column(0, "task", pc.fill_null(t.column("task"), "none"))
    t = t.append_column("correct_i", pc.cast(t.column("correct"), pa.int64()))
    g = t.group_by("task").aggregate([("task", "count"), ("correct", "count"), ("correct_i", "mean"),
                                      ("cost_usd", "sum")]).sort_by("task")
    return [{"task": r["task"], "plans": r["task_count"], "graded": r["correct_count"],
             "accuracy": r["correct_i_mean"], "cost_usd": r["cost_usd_sum"],
             "cost_per_plan_usd": (r["cost_usd_sum"] or 0.0) / r["task_count"]}
            for r in g.to_pylist()]


WORKER_STATS = pa.schema([
    ("worker", pa.string()), ("provider", pa.string()), ("task", pa.string()), ("plans", pa.int64()),
    ("steps", pa.int64()), ("accuracy_when_used", pa.float64()), ("cost_usd", pa.float64()),
    ("mean_latency_s", pa.float64()), ("error_rate", pa.float64())])

WORKER_STATS_SQL = """
WITH used AS (
    SELECT run_id, plan_id, worker, any_value(provider) AS provider, count(*) AS steps,
           sum(cost_usd) AS cost_usd,
           avg(latency_s) FILTER (WHERE NOT coalesce(cache_hit, false)) AS latency_s,
           count(*) FILTER (WHERE status NOT IN ('ok', 'skipped')) AS errors
    FROM read_parquet({traces}, union_by_name = true)
    WHERE worker IS NOT NULL AND status <> 'skipped'
    GROUP BY run_id, plan_id, worker)
SELECT u.worker, u.provider, coalesce(r.task, 'none') AS task, count(*) AS plans, sum(u.steps) AS steps,
       avg(r.correct::INTEGER) AS accuracy_when_used, sum(u.cost_usd) AS cost_usd,
       avg(u.latency_s) AS mean_latency_s, sum(u.errors) / sum(u.steps) AS error_rate
FROM used u JOIN read_parquet({rewards}, union_by_name = true) r USING (run_id, plan_id)
GROUP BY ALL HAVING count(*) >= {min_plans}
ORDER BY u.worker, task
"""


def worker_stats(runs: Path, min_plans: int = 1) -> pa.Table:
    """Per worker and task over every run under `runs`, leaving out pairs seen in fewer
    than `min_plans` plans; empty (with its columns) before any run finished."""
    if not (any(runs.glob("*/traces.parquet")) and any(runs.glob("*/rewards.parquet"))):
        return WORKER_STATS.empty_table()
    sql = WORKER_STATS_SQL.format(traces=_quoted(runs / "*" / "traces.parquet"),
                                  rewards=_quoted(runs / "*" / "rewards.parquet"), min_plans=int(min_plans))
    with duckdb.connect(":memory:") as con:
        return con.execute(sql).to_arrow_table().cast(WORKER_STATS)


def _quoted(path: Path) -> str:
    return "'" + str(path).replace("'", "''") + "'"
