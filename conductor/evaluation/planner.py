"""The embedded planner as an evaluated policy, run through the real pipeline:
`conductor.runner`'s stages (plan, execute, grade, report) against a replay
server started for the purpose, through the executor, over real HTTP.

The run lives in <out>/planner-run/ (a run folder like any other, with its own
DuckDB catalog); it is replaced on every evaluation, because each evaluation
starts its server on a fresh port.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from conductor import yamlkeys
from conductor.errors import ConductorError
from conductor.evaluation.policies import Policy
from conductor.pool import Pool
from conductor.replay.tables import replay_source, replay_workers
from conductor.stats import run_totals

RUN_DIR = "planner-run"
_MARKER = ".conductor-eval"


def sample_ids(ids: list[str], limit: int | None, seed: int) -> list[str]:
    """A fixed, spread-out subset: the `limit` ids with the smallest seeded hash, in query order."""
    if limit is None or limit >= len(ids):
        return list(ids)
    keyed = sorted(ids, key=lambda q: hashlib.sha256(f"{seed}:{q}".encode()).digest())[:limit]
    keep = set(keyed)
    return [q for q in ids if q in keep]


def run_planner(pool: Pool, queries: pa.Table, out: Path, *, planner_options: dict[str, Any],
                seed: int = 0, run_id: str = "eval", run_dir: str = RUN_DIR, kind: str = "planner",
                name: str | None = None) -> tuple[Policy, dict[str, Any]]:
    """Plan and execute `queries` over the replay pool; the planner's policy row and run facts.

    `run_dir` names the scratch folder under `out` (one per evaluated planner setting)."""
    from conductor import runner
    from conductor.replay.process import start_replay

    work = _fresh_dir(Path(out) / run_dir)
    qpath = work / "queries.parquet"
    pq.write_table(queries, qpath)
    t0 = time.monotonic()
    with start_replay(pool.path) as server:
        pool_path = _pool_at(pool, server.url, work / "pool.yaml")
        cfg = runner.RunConfig(queries=qpath, pool=pool_path, data_dir=work, run_id=run_id,
                               planner="embedded", planner_options=dict(planner_options), seed=seed,
                               cache=False, progress=False)
        summary = runner.run_all(cfg)
        log = server.log()
    wall = time.monotonic() - t0
    run_dir = Path(summary["outputs"])
    n = queries.num_rows
    rewards = pq.read_table(run_dir / "rewards.parquet", columns=["query_id", "correct"])
    results = pq.read_table(run_dir / "results.parquet", columns=["query_id", "cost_usd"])
    plans = pq.read_table(run_dir / "plans.parquet", columns=["valid", "info_json", "workers"])
    totals = run_totals(run_dir)
    correct = totals.correct
    # Our grader's accuracy is over the queries with a reference; none: there is no figure.
    graded = n - queries.column("reference").null_count
    cost, tokens = totals.cost_usd, totals.tokens
    infos = [orjson.loads(i) if i else {} for i in plans.column("info_json").to_pylist()]
    shapes = Counter(i.get("template", "invalid") for i in infos)
    policies = Counter(i.get("policy", "prior") for i in infos if i)
    used = Counter(w for ws in plans.column("workers").to_pylist() for w in (ws or ()))
    facts = {
        "run": str(run_dir), "run_id": summary["run_id"], "queries": n, "wall_time_s": round(wall, 2),
        "valid_plans": totals.valid_plans,
        "shapes": dict(shapes),
        "statuses": summary["statuses"],
        "server_outcomes": log.get("by_outcome", {}),
        "most_used_workers": dict(used.most_common(6)),
        "most_used_actions": dict(Counter(i.get("action") for i in infos if i.get("action")).most_common(6)),
        "planned_by": dict(policies),
        "planner_options": planner_options,
    }
    has_ref = {q for q, r in zip(queries.column("query_id").to_pylist(), queries.column("reference").to_pylist())
               if r is not None}
    spent = dict(zip(results.column("query_id").to_pylist(),
                     (c or 0.0 for c in results.column("cost_usd").to_pylist())))
    outcomes = {q: (bool(c), spent.get(q, 0.0)) for q, c in zip(rewards.column("query_id").to_pylist(),
                                                               rewards.column("correct").to_pylist())
                if q in has_ref}
    policy = Policy(kind, name or f"embedded planner (pipeline, {n} queries)", correct / graded if graded else None,
                    None, cost / n, totals.calls / n, tokens / n, n, info=facts,
                    graded=graded, outcomes=outcomes)
    return policy, facts


def _pool_at(pool: Pool, url: str, path: Path) -> Path:
    """A copy of the pool file whose replay workers point at `url`, with the table path made absolute."""
    raw = yamlkeys.load(Path(pool.path).read_text())
    replayed = set(replay_workers(pool))
    for w in raw["workers"]:
        if w.get("id") in replayed:
            w["api_base"] = url
    raw["replay"] = {**raw["replay"], "table": str(replay_source(pool).table)}
    path.write_text(yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    return path


def _fresh_dir(path: Path) -> Path:
    """Empty `path` for a new run; refuse to touch a folder this evaluation did not make."""
    if path.exists():
        if not (path / _MARKER).exists():
            raise ConductorError(f"{path} exists and was not made by `conductor eval`; "
                                 f"move it or choose another --out")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / _MARKER).write_text("scratch run of `conductor eval`; replaced on every evaluation\n")
    return path
