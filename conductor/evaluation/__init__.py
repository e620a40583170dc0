"""Evaluation of a replay pool: every single worker, the best single worker, the
per-question oracle, uniform random, the embedded planner (its prior) and any
learned policies given (a lambda sweep draws a curve), each as accuracy, mean
USD, calls and tokens per query; written as Markdown, JSON and a chart.

`conductor eval` and the Dagster asset `eval_report` are thin front ends over
`evaluate`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from conductor.errors import ConductorError
from conductor.evaluation.planner import run_planner, sample_ids
from conductor.evaluation.policies import Policy, table_policies
from conductor.evaluation.report import chart, markdown
from conductor.evaluation.table import build_matrix
from conductor.pool import load_pool
from conductor.queries import load_queries
from conductor.replay.tables import SPLITS, read_table, replay_source, split_of


@dataclass
class EvalConfig:
    pool: Path
    queries: Path
    split: str = "all"
    out: Path | None = None  # default: data/eval/<dataset>-<split>
    planner: bool = True  # run the embedded planner through the pipeline
    planner_limit: int | None = None  # run it on this many of the queries (a fixed spread-out subset)
    planner_options: dict[str, Any] = field(default_factory=dict)
    policies: list[Path] = field(default_factory=list)  # learned policy artifacts, each run through the pipeline
    seed: int = 0


@dataclass
class EvalReport:
    policies: list[Policy]
    meta: dict[str, Any]
    markdown: str
    report_path: Path
    chart_path: Path
    json_path: Path

    def find(self, kind: str, by: str | None = None) -> Policy:
        """The policy of a kind (for best_single and oracle: chosen `by` 'grader' or 'label')."""
        for p in self.policies:
            if p.kind == kind and (by is None or by in (p.info.get("chosen_by"), p.info.get("correct_by"))):
                return p
        raise KeyError(kind)


def evaluate(cfg: EvalConfig) -> EvalReport:
    t0 = time.monotonic()
    if cfg.split not in SPLITS:
        raise ConductorError(f"--split {cfg.split!r}: choose from {', '.join(SPLITS)}")
    if cfg.planner_limit is not None and cfg.planner_limit < 1:
        raise ConductorError(f"--planner-limit must be at least 1 (got {cfg.planner_limit})")
    pool = load_pool(cfg.pool)
    source = replay_source(pool)
    queries = load_queries(cfg.queries)
    all_ids = queries.column("query_id").to_pylist()
    ids = all_ids if cfg.split == "all" else [q for q in all_ids if split_of(q) == cfg.split]
    if not ids:
        raise ConductorError(f"query set {cfg.queries}: no queries in the {cfg.split} split")
    queries = queries.filter(pc.is_in(queries.column("query_id"), pa.array(ids)))
    if cfg.split == "test":  # choose the best single worker without looking at the test split
        table_ids = read_table(source.table, ["question_id"]).filter(pl.col("split") == "train")
        select_ids = table_ids.get_column("question_id").unique(maintain_order=True).to_list()
        selection = f"the train split ({len(select_ids)} questions of the table), never on test"
    else:
        select_ids, selection = ids, "the evaluated queries themselves"
    matrix = build_matrix(pool, queries, set(ids) | set(select_ids))
    policies = table_policies(matrix, ids, select_ids)
    evaluated = matrix.rows.filter(pl.col("question_id").is_in(ids))
    judged = evaluated.filter(pl.col("grader").is_not_null())
    tasks = queries.column("task").to_pylist()
    meta: dict[str, Any] = {
        "dataset": source.dataset, "split": cfg.split, "queries": len(ids), "pool": str(cfg.pool),
        "queries_path": str(cfg.queries), "table": str(source.table), "workers": len(matrix.workers),
        "task": matrix.task, "tasks": {t: tasks.count(t) for t in sorted(set(tasks), key=str)},
        "graded_queries": len(matrix.graded_ids.intersection(ids)),
        "selection": selection, "grading_s": round(matrix.grading_s, 2),
        # Agreement of our grader with the labels, on the rows it can judge (None: no reference anywhere).
        "agreement": (judged.select((pl.col("grader") == pl.col("label")).mean()).item()
                      if judged.height else None),
        "rows": evaluated.height, "graded_rows": judged.height,
        "recorded_cost_rows": int(evaluated.get_column("cost_recorded").sum()),
        "recorded_cost_by_task": {t: int(n) for t, n in evaluated.filter(pl.col("cost_recorded"))
                                  .group_by("task").len().sort("task").iter_rows()},
    }
    out = Path(cfg.out) if cfg.out else Path("data") / "eval" / f"{source.dataset}-{cfg.split}"
    out.mkdir(parents=True, exist_ok=True)
    subset = sample_ids(ids, cfg.planner_limit, cfg.seed)
    sub_q = queries.filter(pc.is_in(queries.column("query_id"), pa.array(subset)))
    if cfg.planner:
        # The prior, unless the options name a policy: the learned ones are rows of their own.
        options = {"policy": "none", **cfg.planner_options}
        planned, facts = run_planner(pool, sub_q, out, planner_options=options, seed=cfg.seed,
                                     run_id=f"eval-{source.dataset}-{cfg.split}")
        if len(subset) < len(ids):
            facts["subset_reference"] = _subset_reference(table_policies(matrix, subset, select_ids))
        policies.insert(0, planned)
        meta["planner"] = facts
    learned = [_learned(pool, sub_q, out, Path(p), i, cfg, source.dataset) for i, p in enumerate(cfg.policies)]
    if learned:
        learned.sort(key=lambda p: p.info["lambda"])
        policies[:0] = learned
        meta["learned"] = [p.info for p in learned]
        if len(subset) < len(ids) and "subset_reference" not in meta.get("planner", {}):
            meta["learned_subset_reference"] = _subset_reference(table_policies(matrix, subset, select_ids))
    meta["wall_time_s"] = round(time.monotonic() - t0, 2)
    title = (f"{source.dataset} ({cfg.split}, {len(ids)} queries): accuracy against cost per query")
    # Our grader's accuracy where anything has a reference; else (a table without any) the labels'.
    meta["chart_accuracy"] = "grader" if meta["graded_queries"] else "labels"
    chart_path = chart(policies, out / "chart.png", title, by=meta["chart_accuracy"],
                       cost_basis=_cost_basis(meta))
    text = markdown(meta, policies, chart_path.name)
    report_path = out / "report.md"
    report_path.write_text(text, encoding="utf-8")
    json_path = out / "policies.json"
    json_path.write_bytes(orjson.dumps({"meta": meta, "policies": [p.to_dict() for p in policies]},
                                       option=orjson.OPT_INDENT_2, default=str))
    return EvalReport(policies, meta, text, report_path, chart_path, json_path)


def _learned(pool, queries: pa.Table, out: Path, folder: Path, i: int, cfg: EvalConfig, dataset: str) -> Policy:
    """One learned policy artifact, planned greedily (K=1) through the pipeline."""
    from conductor.policy.artifact import find, read_meta

    found = find(pool, folder)
    if found is None:
        raise ConductorError(f"--policy {folder}: no policy artifact there for this pool")
    meta = read_meta(found)
    lam = float(meta["lambda"])
    name = f"learned policy, lambda {lam:g} ({meta['learner']['name']} v{meta['version']:04d})"
    policy, facts = run_planner(pool, queries, out, planner_options={**cfg.planner_options, "policy": str(found)},
                                seed=cfg.seed, run_id=f"eval-{dataset}-{cfg.split}-learned-{i}",
                                run_dir=f"learned-run-{i}", kind="learned", name=name)
    policy.info.update({"lambda": lam, "artifact": str(found), "learner": meta["learner"]["name"],
                        "version": meta["version"], "trained_on": [r["run_id"] for r in meta["training"]["runs"]]})
    return policy


def _cost_basis(meta: dict[str, Any]) -> str:
    if not meta["recorded_cost_rows"]:
        return "estimated tokens x prices"
    if meta["recorded_cost_rows"] == meta["rows"]:
        return "recorded cost_usd"
    return "recorded cost_usd where present, else tokens x prices"


def _subset_reference(ps: list[Policy]) -> dict[str, Any]:
    """The table policies on the planner's subset, by our grader (by the labels when nothing has a reference)."""
    by = "grader" if any(p.kind == "oracle" and p.info["correct_by"] == "grader" for p in ps) else "label"
    best = next(p for p in ps if p.kind == "best_single" and p.info["chosen_by"] == by)
    oracle = next(p for p in ps if p.kind == "oracle" and p.info["correct_by"] == by)
    rnd = next(p for p in ps if p.kind == "random")
    if by == "label":
        return {"by": by, "best_single": best.worker, "best_single_accuracy": best.accuracy_labels,
                "best_single_usd": best.usd_per_query, "oracle_accuracy": oracle.accuracy_labels,
                "oracle_usd": oracle.usd_per_query, "random_accuracy": rnd.accuracy_labels,
                "random_usd": rnd.usd_per_query}
    return {"by": by, "best_single": best.worker, "best_single_accuracy": best.accuracy,
            "best_single_usd": best.usd_per_query,
            "oracle_accuracy": oracle.accuracy, "oracle_usd": oracle.usd_per_query,
            "random_accuracy": rnd.accuracy, "random_usd": rnd.usd_per_query}


__all__ = ["EvalConfig", "EvalReport", "Policy", "evaluate"]
