"""The learned policy as a Dagster asset: trained from the rewards the pipeline
produced, closing the loop rollouts -> rewards -> policy -> better plans.

It depends on the `rewards` asset and reads the data from the runs (the DuckDB
catalog lists them; the Parquet files hold them), not from an IO manager: every
complete run of the embedded planner over the configured pool is used, unless
the config names runs. The next `conductor run` (or partition) with the
embedded planner plans with the new artifact.
"""

from pathlib import Path
from typing import List, Optional

from dagster import AssetExecutionContext, AssetKey, Config, MetadataValue, Output, asset
from pydantic import Field

from conductor.policy.artifact import read_meta
from conductor.policy.features import FeatureSettings
from conductor.policy.training import TrainConfig, coverage_text, runs_for_pool, train
from conductor.pool import load_pool
from conductor.runner import planning_pool
from assets.resources import PoolResource, StorageResource


class PolicySettings(Config):
    lam: float = Field(default=0.0, description="cost weight: the objective is accuracy - lam x USD per query")
    runs: Optional[List[str]] = Field(default=None, description="runs to learn from (default: every complete "
                                                                "embedded-planner run over the pool)")
    learner: str = Field(default="vw", description="vw | vw-task | table | fixed | segment (needs group_by)")
    group_by: Optional[str] = Field(default=None, description="segment learner: the metadata field naming each "
                                                              "query's group")
    floor: Optional[float] = Field(default=None, description="instead of lam: the fixed action is the cheapest "
                                                             "reaching the best single's train accuracy + floor")
    budget: Optional[float] = Field(default=None, description="instead of lam: the fixed action is the most "
                                                              "accurate costing at most this share of the best "
                                                              "single's (0.15: 15%); not with floor")
    folds: int = Field(default=1, description="1: a held-back quarter chooses learned or fixed; K: every query "
                                              "held back once, in K parts")
    shrinks: Optional[List[float]] = Field(default=None, description="segment learner: the weights (in queries) of "
                                                                     "the task-wide logs in each group's choice, "
                                                                     "cross-fitted (default 0 20 50 100 200 400)")
    out: Optional[str] = Field(default=None, description="policy root (default: <data_dir>/policy)")
    seed: int = 0


@asset(deps=[AssetKey("rewards")], group_name="conductor",
       description="The embedded planner's learned policy (a contextual bandit, Vowpal Wabbit) trained on the "
                   "rewards of every embedded-planner run over the pool; saved as a new artifact version that "
                   "planning picks up.")
def policy(context: AssetExecutionContext, config: PolicySettings, pool: PoolResource,
           storage: StorageResource) -> Output[dict]:
    data_dir = Path(storage.data_dir)
    pool_path = Path(pool.path)
    runs = list(config.runs or runs_for_pool(data_dir, load_pool(pool_path)))
    if not runs:
        reason = (f"no complete run of the embedded planner over {pool_path} under {data_dir / 'runs'}: "
                  f"materialize the pipeline (with samples > 1 for exploration) first")
        context.log.warning(f"policy skipped: {reason}")
        return Output({"skipped": reason}, metadata={"skipped": MetadataValue.text(reason)})
    folder, summary = train(TrainConfig(pool=pool_path, runs=runs, data_dir=data_dir, lam=config.lam,
                                        out=Path(config.out) if config.out else data_dir / "policy",
                                        learner=config.learner, seed=config.seed, floor=config.floor,
                                        budget=config.budget, folds=config.folds,
                                        shrinks=None if config.shrinks is None else tuple(config.shrinks),
                                        features=FeatureSettings(group_by=config.group_by)),
                            pool=planning_pool(load_pool(pool_path)))
    est = summary["estimates"]
    return Output({"artifact": str(folder), "runs": runs, "summary": summary}, metadata={
        "artifact": MetadataValue.path(str(folder.resolve())),
        "lambda": summary["lambda"],
        "goal": read_meta(folder)["objective"],
        "learner": config.learner,
        "runs": MetadataValue.json(runs),
        "plans_used": summary["plans_used"],
        "outside_frontier": summary["outside_frontier"],
        "shipped": summary["selection"]["shipped"],
        "frontier": MetadataValue.json(summary["frontier"]),
        "queries": summary["queries"],
        "skipped": MetadataValue.json(summary["skipped"]),
        "coverage": MetadataValue.text(_coverage(summary)),
        "logged_accuracy": est["logged_accuracy"],
        "greedy_accuracy_snips_train": est.get("greedy_accuracy_snips"),
        "greedy_usd_snips_train": est.get("greedy_usd_snips"),
        "train_seconds": summary["seconds"],
    })


def _coverage(summary: dict) -> str:
    """What the figures rest on, as `policy train` says it and `policy show` prints it."""
    gaps = summary.get("coverage") or {}
    if not gaps:
        return "complete: every (action, query) pair the pool can serve is logged"
    return "; ".join(coverage_text(task, c, short=True) for task, c in gaps.items())
