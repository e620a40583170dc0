"""Statistics over finished runs' files: accuracy and cost per task of one run, and
per worker and task over every run (the observed skills a pool file can be tuned with)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

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
