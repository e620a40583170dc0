"""The evaluation report as a Dagster asset: `conductor.evaluation.evaluate` on a
replay pool, with the Markdown report (chart embedded) and the chart's path as
metadata. Skips, saying why, where the shared replay folder or the pool and
query files are missing."""

import base64
from pathlib import Path
from typing import Optional

import orjson
from dagster import AssetExecutionContext, Config, MetadataValue, Output, asset
from pydantic import Field

from conductor.evaluation import EvalConfig, evaluate
from conductor.replay.datasets import DEFAULT_DIR_HELP
from conductor.replay.tables import REPLAY_ENV, default_replay_dir
from assets.resources import StorageResource


class EvalReportConfig(Config):
    dataset: str = Field(default="gsm8k", description="gsm8k | mmlu_pro")
    replay_dir: Optional[str] = Field(
        default=None, description=f"shared replay folder (default: {DEFAULT_DIR_HELP})")
    pool: Optional[str] = Field(default=None,
                                description="replay pool file (default: <data_dir>/pools/replay-<dataset>.yaml)")
    queries: Optional[str] = Field(default=None, description="query set (default: <data_dir>/replay/<dataset>.parquet)")
    split: str = Field(default="all", description="all | train | test (test: best single chosen on train)")
    out: Optional[str] = Field(default=None, description="report folder (default: <data_dir>/eval/<dataset>-<split>)")
    create_missing: bool = Field(
        default=False, description="write the pool file and the query set from the replay folder when missing")
    run_planner: bool = Field(default=True, description="run the embedded planner through the pipeline")
    planner_limit: Optional[int] = Field(default=None, description="run the planner on this many queries")
    planner_options_json: str = Field(default="{}", description="embedded planner settings as a JSON object")
    seed: int = 0


@asset(description="Every single worker, the best single worker, the oracle, uniform random and the embedded "
                   "planner on a replay pool: accuracy, USD, calls and tokens per query, and a chart.")
def eval_report(context: AssetExecutionContext, config: EvalReportConfig, storage: StorageResource) -> Output[dict]:
    replay_dir = Path(config.replay_dir) if config.replay_dir else default_replay_dir()
    data = Path(storage.data_dir)  # CONDUCTOR_DATA_DIR: the defaults live there, not under the working directory
    pool = Path(config.pool) if config.pool else data / "pools" / f"replay-{config.dataset}.yaml"
    queries = Path(config.queries) if config.queries else data / "replay" / f"{config.dataset}.parquet"
    out = Path(config.out) if config.out else data / "eval" / f"{config.dataset}-{config.split}"
    if not replay_dir.is_dir():
        return _skip(context, f"the shared replay folder {replay_dir} is absent (set {REPLAY_ENV} or the "
                              f"replay_dir config); nothing to evaluate")
    missing = [p for p in (pool, queries) if not p.exists()]
    if missing and not config.create_missing:
        return _skip(context, f"{' and '.join(map(str, missing))} not found: set create_missing, or run "
                              f"`conductor replay pool --dataset {config.dataset} --out {pool}` and "
                              f"`conductor replay queries --dataset {config.dataset} --out {queries}`")
    if missing:
        _create(replay_dir, config.dataset, pool, queries)
    report = evaluate(EvalConfig(
        pool=pool, queries=queries, split=config.split, out=out,
        planner=config.run_planner, planner_limit=config.planner_limit,
        planner_options=orjson.loads(config.planner_options_json or "{}"), seed=config.seed))
    embedded = report.markdown
    if report.chart_path is not None:  # None: not even the placeholder was saved (the report says why)
        png = base64.b64encode(report.chart_path.read_bytes()).decode()
        embedded = embedded.replace(f"]({report.chart_path.name})", f"](data:image/png;base64,{png})")
    best_l, oracle_l = report.find("best_single", "label"), report.find("oracle", "label")
    meta = {
        "report": MetadataValue.md(embedded),
        "report_path": MetadataValue.path(str(report.report_path.resolve())),
        "queries": report.meta["queries"],
        "best_single": best_l.worker,
        "best_single_accuracy_labels": best_l.accuracy_labels,
        "oracle_accuracy_labels": oracle_l.accuracy_labels,
    }
    if report.chart_path is not None:
        meta["chart"] = MetadataValue.path(str(report.chart_path.resolve()))
    if report.meta["graded_queries"]:  # our grader's figures: only where the table has references
        best, oracle = report.find("best_single", "grader"), report.find("oracle", "grader")
        meta.update(best_single=best.worker, best_single_accuracy=best.accuracy, oracle_accuracy=oracle.accuracy)
    if config.run_planner:
        planner = report.find("planner")
        meta.update(planner_accuracy=planner.accuracy, planner_usd_per_query=planner.usd_per_query)
    return Output({"report": str(report.report_path), "meta": report.meta,
                   "policies": [p.to_dict() for p in report.policies]}, metadata=meta)


def _skip(context: AssetExecutionContext, reason: str) -> Output[dict]:
    context.log.warning(f"eval_report skipped: {reason}")
    return Output({"skipped": reason}, metadata={"skipped": MetadataValue.text(reason)})


def _create(replay_dir: Path, dataset: str, pool: Path, queries: Path) -> None:
    import pyarrow.parquet as pq

    from conductor.replay.build import pool_document, query_table, write_pool
    from conductor.replay.tables import table_spec

    spec = table_spec(dataset=dataset, replay_dir=replay_dir)
    if not pool.exists():
        write_pool(pool, pool_document(spec))
    if not queries.exists():
        queries.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(query_table(spec), queries)
