"""Train the policy from what the pipeline logged: plans, rewards and traces of runs.

One example per executed plan of the embedded planner:
- context: the query's text and task (from the run's query set; never its reference);
- action: the plan's shape and workers, read back from the validated plan;
- propensity: the probability the planner sampled it with (plans.propensity);
- reward: correct (rewards.correct, graded by the pipeline) - lambda x the plan's
  cost in USD. The cost is the sum over its steps of what each answer cost when
  first paid for (traces.original_cost_usd), so a plan that was answered from
  the cache is charged like its twin that was not.

Plans without a propensity (LLM planners log a log-probability instead), not
graded, invalid, or of a shape outside the action space are skipped and counted.

Training then, per task:
1. measures every logged action on the train logs (accuracy and cost per query,
   `learner.ActionLogs`: the queries it was logged on at their means, its unlogged
   queries at its logged mean, a query where it could not be served counting as
   wrong and free) and keeps the accuracy/cost Pareto frontier, plus actions
   within `band` standard errors of it (`actions.pareto`): the candidate set is
   cut by what was measured, never by a rule on the pool's skills. Logs missing
   some (action, query) pair the pool can serve (runs that are not a sweep, or
   skipped plans) are said (`coverage`), and the cut and the fixed action are
   chosen on guarded figures there, so that an action logged on a few queries
   wins on no luck;
2. holds back `holdout` of the queries (or, with `folds` K, each of K parts in
   turn, so that every query is held back once), fits the per-query learner and
   the best fixed action (`learner.FixedLearner`) on the rest, and estimates both
   on the held-back queries (SNIPS, with standard errors);
3. refits both on every query and ships the learned policy only when it did
   better on the held-back queries by more than `ship_margin` paired standard
   errors, else the fixed action (`selection` in the summary). The artifact holds
   both, so evaluation can report each (planner option `use=learned|fixed`).

The fixed action is the one with the best reward, or with `floor` the cheapest
action whose train accuracy reaches the best single worker's + floor, or with
`budget` the most accurate action costing at most that share of the best
single's USD (see `learner.FixedLearner`): a target such as "the best single's
accuracy at a quarter of its cost" asked of the train split directly, from
either side.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import duckdb
import orjson

from conductor.errors import ConductorError
from conductor.policy import artifact as artifacts
from conductor.policy import traininputs
from conductor.policy.actions import Action, ActionSettings, Measured, action_set, from_steps, pareto, servable
from conductor.policy.features import Context, FeatureSettings, context
from conductor.policy.learner import (GUARD_SE, LEARNERS, ActionLogs, FixedLearner, Logged, SegmentLearner,
                                      TableLearner, action_logs, best_singles, candidate_keys, make_learner,
                                      target_choice)
from conductor.policy.metacheck import guarded
from conductor.pool import Pool, load_pool
from conductor.queries import load_queries
from conductor.store import RunDir


@dataclass
class TrainConfig:
    pool: Path
    runs: list[str]
    data_dir: Path = Path("data")
    lam: float = 0.0  # reward points per USD: the objective is accuracy - lam * cost
    out: Path | None = None  # policy root (default: $CONDUCTOR_POLICY_DIR, else data/policy)
    learner: str = "vw"
    seed: int = 0
    features: FeatureSettings = field(default_factory=FeatureSettings)
    actions: ActionSettings = field(default_factory=ActionSettings)
    vw: dict[str, Any] = field(default_factory=dict)  # VWSettings overrides (passes, cb_type, ...)
    holdout: float = 0.25  # share of train queries held back to choose between learned and fixed
    folds: int = 1  # 2 or more: hold back every query once, in this many parts, instead of `holdout`
    # The fixed action: None, the best reward; a number, the cheapest action whose train accuracy is at
    # least the best single worker's + floor (0: match it, -0.01: within a point). See FixedLearner.
    # With a floor, `lam` is replaced by the lambda under which that action is the best (implied_lambda).
    floor: float | None = None
    # Or a cost cap: the most accurate action costing at most this share of the best single's USD per
    # query on train (0.15: 15%). Like a floor, it sets `lam` by implied_lambda. See FixedLearner.
    budget: float | None = None
    ship_margin: float = 1.0  # the learned policy ships only if better than the fixed by this many paired SEs
    band: float = 1.0  # keep actions within this many standard errors of the Pareto frontier
    max_actions: int = 40  # per task, after the Pareto cut
    shrinks: tuple[float, ...] | None = None  # segment learner: the weights of the task-wide logs to cross-fit
    allow_other_pool: bool = False  # train on runs made with another pool key (other workers or dataset)


# Rewards are accuracy - lambda x USD, and their squared deviations are summed: past this a
# lambda overflows floats. A lambda this large already ranks every action by its cost alone.
MAX_LAMBDA = 1e9


@dataclass
class Logs:
    examples: list[Logged]
    queries: int
    skipped: Counter
    runs: list[dict[str, Any]]
    by_action: Counter
    prices: dict[str, Any] = field(default_factory=dict)  # run id -> the prices its costs were paid at, or None
    null_group: int = 0  # queries whose metadata has the --group-by field, but null


def logged_plans(data_dir: Path, run_ids: Sequence[str]) -> list[dict[str, Any]]:
    """One row per plan of the runs: the plan, its reward, its full cost (DuckDB over the runs' Parquet)."""
    if not run_ids:
        raise ConductorError("--runs: name at least one run")
    rows = []
    con = duckdb.connect(":memory:")
    try:
        for run_id in run_ids:
            run = RunDir(data_dir, run_id)
            if not run.exists():
                raise ConductorError(f"run {run_id}: not found under {run.data_dir / 'runs'}")
            for name in ("plans", "rewards", "traces"):
                if not run.table(name).exists():
                    raise ConductorError(f"run {run_id}: no {name}.parquet yet (status "
                                         f"{run.read_manifest().get('status')}); finish the run first")
            q = """
                SELECT p.run_id, p.plan_id, p.query_id, p.query_index, p.task, p.planner, p.valid, p.steps_json,
                       p.propensity, p.info_json, r.correct, r.status,
                       t.cost AS cost_usd, coalesce(t.unpriced, 0) AS unpriced
                FROM read_parquet(?) p
                JOIN read_parquet(?) r USING (plan_id)
                LEFT JOIN (SELECT plan_id, sum(coalesce(original_cost_usd, cost_usd, 0)) AS cost,
                                  count(*) FILTER (WHERE cost_usd IS NULL AND original_cost_usd IS NULL
                                                   AND attempts > 0) AS unpriced
                           FROM read_parquet(?) GROUP BY plan_id) t USING (plan_id)
                ORDER BY p.query_index, p.sample"""
            cur = con.execute(q, [str(run.table("plans")), str(run.table("rewards")), str(run.table("traces"))])
            cols = [d[0] for d in cur.description]
            rows += [dict(zip(cols, r)) for r in cur.fetchall()]
    finally:
        con.close()
    return rows


def collect(cfg: TrainConfig, pool: Pool) -> Logs:
    """Training examples from the runs, with counts of what was skipped and why."""
    rows = logged_plans(cfg.data_dir, cfg.runs)
    prompts: dict[tuple[str, str], tuple[str, str | None]] = {}
    runs = []
    run_prices: dict[str, Any] = {}
    for run_id in cfg.runs:
        manifest = RunDir(cfg.data_dir, run_id).read_manifest()
        qpath = Path(manifest["inputs"]["queries"])
        if not qpath.exists():
            raise ConductorError(f"run {run_id}: its query set {qpath} is gone; the policy needs the query text")
        t = load_queries(qpath).select(["query_id", "prompt", "task", "metadata"]).to_pylist()
        prompts.update({(run_id, r["query_id"]): (r["prompt"], r["task"], r["metadata"]) for r in t})
        key, theirs = _check_run_pool(cfg, run_id, manifest["inputs"].get("pool"), pool)
        run_prices[run_id] = traininputs.run_prices(run_id, manifest, theirs,
                                                      RunDir(cfg.data_dir, run_id).table("traces"))
        runs.append({"run_id": run_id, "queries": str(qpath), "pool": manifest["inputs"].get("pool"),
                     "pool_key": key,
                     "planner": manifest["inputs"].get("planner"), "samples": manifest["inputs"].get("samples")})
    allowed = pool.servable_questions()
    sets: dict[str | None, list[Action]] = {}
    shared: dict[tuple[str, str], list[Action]] = {}  # per (run, query): one candidate list for its examples
    contexts: dict[tuple[str, str], Context] = {}
    skipped: Counter = Counter()
    by_action: Counter = Counter()
    examples = []
    for r in rows:
        if not r["valid"]:  # also a sweep's unused slots (the query has fewer candidates than slots)
            skipped["invalid plan (or an unused sweep slot)"] += 1
            continue
        if r["propensity"] is None:
            skipped["no propensity (not the embedded planner)"] += 1
            continue
        if r["correct"] is None:
            skipped["not graded (no reference, or stopped by a budget)"] += 1
            continue
        action = from_steps(r["steps_json"])
        if action is None or any(not pool.has(w) for w in action.workers):
            skipped["plan shape or worker outside this pool's action space"] += 1
            continue
        prompt, task, metadata = prompts[(r["run_id"], r["query_id"])]
        if r["unpriced"]:
            skipped["cost unknown (a step without a price)"] += 1
            continue
        if task not in sets:
            sets[task] = action_set(pool, task, cfg.actions)
        key = (r["run_id"], r["query_id"])
        if key not in shared:
            shared[key] = servable(sets[task], allowed.get(prompt) if allowed is not None else None)
        cands = shared[key]
        if action not in cands:
            cands = [*cands, action]
        if key not in contexts:
            contexts[key] = context(prompt, task, cfg.features, metadata)
        cost = float(r["cost_usd"] or 0.0)
        reward = (1.0 if r["correct"] else 0.0) - cfg.lam * cost
        examples.append(Logged(contexts[key], cands, cands.index(action), float(r["propensity"]), reward,
                               correct=bool(r["correct"]), cost=cost, query=r["query_id"]))
        by_action[action.key] += 1
    null = sum(1 for (_, _, meta) in prompts.values() if _null_field(meta, cfg.features.group_by))
    return Logs(examples, len({r["query_id"] for r in rows}), skipped, runs, by_action,  # distinct queries
                prices=run_prices, null_group=null)


def _null_field(metadata: str | None, field_: str | None) -> bool:
    """The query's metadata has the field, as null (a data set whose field is empty everywhere)."""
    if not field_ or not metadata:
        return False
    try:
        value = orjson.loads(metadata)
    except orjson.JSONDecodeError:
        return False
    return isinstance(value, dict) and field_ in value and value[field_] is None


def _check_run_pool(cfg: TrainConfig, run_id: str, run_pool: str | None, pool: Pool) -> tuple[str | None, Pool | None]:
    """The run's pool key and pool. A run of another pool key (other workers, or another dataset's
    questions) is refused unless `allow_other_pool`: its plans would train this pool's policy
    without a word. A run whose pool file no longer loads cannot be checked: said, not refused."""
    try:
        theirs = load_pool(run_pool) if run_pool else None
    except ConductorError as e:
        print(f"conductor: warning: run {run_id}: its pool {run_pool} does not load ({e}); cannot check that it "
              f"was made with --pool {cfg.pool}", file=sys.stderr, flush=True)
        return None, None
    if theirs is None:
        return None, None
    key, ours = artifacts.pool_key(theirs), artifacts.pool_key(pool)
    if key != ours:
        what = (f"run {run_id} was made with pool {run_pool} (pool key {key}, dataset "
                f"{(theirs.replay or {}).get('dataset')}), not --pool {cfg.pool} (pool key {ours}, dataset "
                f"{(pool.replay or {}).get('dataset')})")
        if not cfg.allow_other_pool:
            raise ConductorError(f"{what}: its plans are of other workers or other questions; train on this "
                                 f"pool's runs, or pass --allow-other-pool to train on it anyway")
        print(f"conductor: warning: {what}; training on it as --allow-other-pool asks", file=sys.stderr, flush=True)
    return key, theirs


def train(cfg: TrainConfig, pool: Pool | None = None) -> tuple[Path, dict[str, Any]]:
    """Fit the learner on the runs and save the next artifact version; (folder, summary).

    `pool`: cfg.pool loaded, and for a replay pool with its recorded questions
    (conductor.runner.planning_pool); loaded here when not given."""
    if cfg.learner not in LEARNERS:
        raise ConductorError(f"--learner {cfg.learner!r}: choose from {', '.join(LEARNERS)}")
    if not 0 <= cfg.lam <= MAX_LAMBDA:
        raise ConductorError(f"--lambda must be a number from 0 to {MAX_LAMBDA:g} (got {cfg.lam!r}); a lambda of "
                             f"{MAX_LAMBDA:g} already ranks every action by its cost alone")
    if not 0 <= cfg.holdout < 1:
        raise ConductorError(f"--holdout must be at least 0 and below 1 (got {cfg.holdout})")
    if cfg.holdout == 0 and cfg.folds < 2 and cfg.learner != "fixed":
        raise ConductorError("--holdout 0 holds no query back, so the learned policy could not be compared with "
                             "the best fixed action and would ship unchecked; give a share above 0 (default "
                             "0.25) or --folds K. To plan with the learned policy whatever training ships, use "
                             "the planner option use=learned")
    if cfg.folds < 1:
        raise ConductorError(f"--folds must be 1 (hold back --holdout of the queries once) or more (hold back "
                             f"every query once, in that many parts); got {cfg.folds}")
    if cfg.floor is not None and not -1 < cfg.floor < 1:
        raise ConductorError(f"--floor is an accuracy difference from the best single, between -1 and 1 "
                             f"(got {cfg.floor})")
    if cfg.budget is not None and not 0 < cfg.budget < math.inf:
        raise ConductorError(f"--budget is a share of the best single's cost per query, above 0 and finite "
                             f"(got {cfg.budget})")
    if cfg.budget is not None and cfg.floor is not None:
        raise ConductorError("--floor and --budget are two objectives: give one (a floor minimizes cost at an "
                             "accuracy, a budget maximizes accuracy at a cost)")
    if not 0 <= cfg.ship_margin < math.inf:
        raise ConductorError(f"--ship-margin must be a finite number, at least 0 (got {cfg.ship_margin})")
    if cfg.shrinks is not None and (cfg.learner != "segment" or not cfg.shrinks
                                    or not all(0 <= k < math.inf for k in cfg.shrinks)):
        raise ConductorError(f"--shrinks weighs the task-wide logs into each group's choice of --learner segment: "
                             f"one or more finite numbers >= 0 (got {list(cfg.shrinks)} with --learner {cfg.learner})")
    group_by = cfg.features.group_by
    if (cfg.learner == "segment") != bool(group_by):
        raise ConductorError("--learner segment plans per group of queries: give it --group-by FIELD (a field of "
                             "the queries' metadata), and --group-by only with --learner segment")
    root = cfg.out or artifacts.default_root()
    traininputs.check_out(root, "--out" if cfg.out else "the policy root")  # before minutes of fitting
    pool = pool or load_pool(cfg.pool)
    t0 = time.monotonic()
    logs = collect(cfg, pool)
    if not logs.examples:
        why = ", ".join(f"{k}: {v}" for k, v in logs.skipped.items()) or "the runs hold no plans"
        raise ConductorError(f"no training examples in run(s) {', '.join(cfg.runs)} ({why})")
    if group_by and not any(e.context.group is not None for e in logs.examples):
        null = (f": {logs.null_group} queries have it, but null (no value), so there is no group to plan by"
                if logs.null_group else " in its metadata")
        raise ConductorError(f"--group-by {group_by}: no query of run(s) {', '.join(cfg.runs)} has a value for the "
                             f"field {group_by!r}{null}")
    n_queries = len({e.query for e in logs.examples})
    if cfg.folds > n_queries and cfg.learner != "fixed":
        raise ConductorError(f"--folds {cfg.folds}: more parts than the {n_queries} queries with training "
                             f"examples (each part holds at least one query back); give at most {n_queries}")
    prices = traininputs.fitted_prices(logs.prices, pool, cfg.pool)
    covered = coverage(logs.examples)
    for task, c in covered.items():
        print(f"conductor: warning: {coverage_text(task, c)}", file=sys.stderr, flush=True)
    fitted = fit_policy(cfg, logs.examples)
    cfg, learner, examples, selection = fitted.cfg, fitted.learner, fitted.examples, fitted.selection
    try:
        summary = {
            "lambda": cfg.lam,
            "floor": cfg.floor,
            "budget": cfg.budget,
            "floor_lambda": fitted.floor_lambda,
            "runs": logs.runs,
            "plans_used": len(examples),
            "queries": logs.queries,
            "skipped": dict(logs.skipped),
            "outside_frontier": len(logs.examples) - len(examples),
            "estimates": off_policy_estimates(learner, examples),
            "actions_logged": len(logs.by_action),
            "most_logged": dict(logs.by_action.most_common(5)),
            "measured": {t: [_row(m, fitted.logs.get((t, m.action.key))) for m in ms]
                         for t, ms in fitted.measured.items()},
            "frontier": {t: [m.action.key for m in ms] for t, ms in fitted.kept.items()},
            "selection": selection,
            "learner": fitted.fit,
            "seconds": round(time.monotonic() - t0, 2),
        }
        if covered:  # a sweep's summary stays as it was
            summary["coverage"] = covered
        actions = {t: [m.action for m in ms] for t, ms in fitted.kept.items()}
        folder = artifacts.save(root, pool, learner, fixed=fitted.fixed,
                                shipped=selection["shipped"], actions=actions, action_settings=cfg.actions,
                                features=cfg.features, lam=cfg.lam, floor=cfg.floor, budget=cfg.budget,
                                training=summary, fitted_prices=prices)
    finally:
        close = getattr(learner, "close", None)
        if callable(close):
            close()
    return folder, summary


@dataclass
class Fitted:
    """What `fit_policy` made of the examples; `learner` may hold a native model: close it."""

    cfg: TrainConfig  # with lam replaced by the floor's (or budget's) implied lambda, when one is set
    learner: Any
    fixed: FixedLearner
    fit: dict[str, Any]
    selection: dict[str, Any]
    examples: list[Logged]  # those inside the Pareto cut, rewarded at cfg.lam
    measured: dict[str, list[Measured]]
    kept: dict[str, list[Measured]]
    floor_lambda: dict[str, Any] | None
    logs: dict[tuple[str, str], ActionLogs] = field(default_factory=dict)  # per (task, action): `measured`'s basis


def fit_policy(cfg: TrainConfig, logged: Sequence[Logged]) -> Fitted:
    """Steps 1-3 of the module's docstring on examples in memory, whatever logged them."""
    logs = action_logs(logged)
    measured = measure(logged, logs=logs)
    judged = measure(logged, guarded=True, logs=logs)  # the same figures on a sweep
    kept = {t: pareto(ms, cfg.band, cfg.max_actions) for t, ms in judged.items()}
    reference = best_singles(logged, logs)  # on correctness and cost: the same at any lambda
    floor_lambda = None
    if cfg.floor is not None or cfg.budget is not None:
        # The learner optimizes a reward: give it the lambda under which the floor's action is the
        # best fixed one (its price of accuracy), so both aim at the same point of the frontier.
        floor_lambda = implied_lambda(judged, kept, reference, cfg.floor, cfg.budget)
        if floor_lambda is not None:
            cfg = replace(cfg, lam=floor_lambda["lambda"])
    everything = [replace(e, reward=float(bool(e.correct)) - cfg.lam * e.cost) for e in logged]
    examples = restrict(everything, {t: {m.action.key for m in ms} for t, ms in kept.items()})
    selection = choose(cfg, examples, everything)
    learner = _learner(cfg, reference)
    fixed = FixedLearner(floor=cfg.floor, reference=reference, budget=cfg.budget)
    try:
        cut = action_logs(examples)  # rewards at cfg.lam, inside the cut: one for both fits
        fit = _fit(learner, examples, cut)
        fixed.fit(examples, cut)
    except BaseException:
        close = getattr(learner, "close", None)
        if callable(close):
            close()
        raise
    return Fitted(cfg, learner, fixed, fit, selection, examples, measured, kept, floor_lambda, logs)


def measure(examples: Sequence[Logged], guarded: bool = False,
            logs: dict[tuple[str, str], ActionLogs] | None = None) -> dict[str, list[Measured]]:
    """Per task, every logged action's accuracy and cost per query of the task
    (`learner.ActionLogs.mean`: the queries it was logged on at their means, its unlogged
    queries at its logged mean, the queries where it could not be served as wrong and free),
    with `n` the queries that figure rests on (logged and unservable: its standard error's base).
    With `guarded`, the figures choices are made on (its unlogged queries at a guarded
    stand-in; on a sweep the same), with `n` the task's queries.
    `logs`: `learner.action_logs(examples)`, when already made."""
    logs = action_logs(examples) if logs is None else logs
    actions: dict[str, Action] = {}
    for e in examples:
        actions[e.actions[e.chosen].key] = e.actions[e.chosen]
    out: dict[str, list[Measured]] = {}
    for (task, key), f in sorted(logs.items(), key=lambda kv: kv[0]):
        m = (Measured(actions[key], f.queries, f.guarded("correct"), f.guarded("cost")) if guarded
             else Measured(actions[key], f.n, f.mean("correct"), f.mean("cost")))
        out.setdefault(task, []).append(m)
    return out


def coverage(examples: Sequence[Logged]) -> dict[str, dict[str, Any]]:
    """Per task whose logs miss some (action, query) pair the pool can serve: how much they hold.
    A sweep logs every candidate action on every query; other runs (rollouts from a policy,
    uniform draws) log a few per query, and a sweep's skipped plans (invalid, ungraded) leave
    gaps too, so an action's figures rest on fewer queries."""
    cands = candidate_keys(examples)
    logged: dict[str, dict[str, set[str]]] = {}
    for e in examples:
        logged.setdefault(e.context.task or "none", {}).setdefault(e.query, set()).add(e.actions[e.chosen].key)
    out = {}
    for task, by_q in cands.items():
        pairs = sum(len(keys) for keys in by_q.values())
        done = sum(len(logged[task].get(q, set()) & keys) for q, keys in by_q.items())
        if done < pairs:
            out[task] = {"queries": len(by_q), "actions": len(set().union(*by_q.values())),
                         "actions_logged": len(set().union(*logged[task].values())),
                         "pairs": pairs, "pairs_logged": done}
    return out


def coverage_text(task: str, c: dict[str, Any], short: bool = False) -> str:
    """One task's `coverage`, said: what the figures rest on, why pairs may lack a log (the runs
    may be a sweep with a few skipped plans, so neither cause is claimed), and how to log them all."""
    missing = f"{c['pairs'] - c['pairs_logged']} of the {c['pairs']} (action, query) pairs the pool can serve"
    pct = f"{c['pairs_logged'] / max(c['pairs'], 1):.0%}"
    if short:
        return (f"{task}: {missing} have no usable log ({pct} logged; skipped plans, or runs that are not a sweep); "
                f"{c['actions_logged']} of {c['actions']} candidate actions logged; unlogged queries count at an "
                f"action's logged mean less {GUARD_SE:g} SE (`policy rollouts -k all` logs a sweep)")
    return (f"{task}: {missing} on these {c['queries']} queries have no usable log ({pct} logged): plans skipped as "
            f"invalid or ungraded, or runs that are not a sweep. The runs logged {c['actions_logged']} of its "
            f"{c['actions']} candidate actions. An action's figures count its unlogged queries at its logged mean, "
            f"and the queries it cannot be served on as wrong and free; for the Pareto cut and the fixed action, "
            f"its unlogged queries count at its logged mean less {GUARD_SE:g} standard error, so an action logged "
            f"on a few queries wins on no luck. `conductor policy rollouts QUERIES --pool POOL -k all` logs a sweep "
            f"(every action on every query)")


def restrict(examples: Sequence[Logged], keep: dict[str, set[str]]) -> list[Logged]:
    """The examples whose action was kept, each with only the kept candidates."""
    out = []
    cut: dict[int, list[Action]] = {}  # by candidate list: examples of one query share theirs
    for e in examples:
        keys = keep.get(e.context.task or "none", set())
        chosen = e.actions[e.chosen]
        if chosen.key not in keys:
            continue
        cands = cut.get(id(e.actions))
        if cands is None:
            cands = cut[id(e.actions)] = [a for a in e.actions if a.key in keys]
        out.append(Logged(e.context, cands, cands.index(chosen), e.propensity, e.reward, e.correct, e.cost, e.query))
    return out


def _learner(cfg: TrainConfig, reference: dict[str, tuple[str, float, float]] | None = None) -> Any:
    if cfg.learner == "fixed":
        return FixedLearner(floor=cfg.floor, reference=reference, budget=cfg.budget)
    if cfg.learner == "segment":
        return SegmentLearner(lam=cfg.lam, floor=cfg.floor, reference=reference, seed=cfg.seed, budget=cfg.budget,
                              shrinks=cfg.shrinks)
    return make_learner(cfg.learner, seed=cfg.seed, **cfg.vw)


def _fit(learner: Any, examples: Sequence[Logged], logs: dict[tuple[str, str], ActionLogs]) -> dict:
    """Fit `learner`, handing the learners that measure actions `logs` (`action_logs(examples)`,
    made once for them and the fixed action)."""
    if isinstance(learner, (FixedLearner, SegmentLearner, TableLearner)):
        return learner.fit(examples, logs)
    return learner.fit(examples)


def choose(cfg: TrainConfig, examples: Sequence[Logged],
           everything: Sequence[Logged] | None = None) -> dict[str, Any]:
    """Fit the learner and the fixed action on most queries, compare both on the rest, paired
    query by query; the learned policy ships only when it is better by more than `ship_margin`
    standard errors of the difference (else the fixed action: a tie, or noise, ships it).

    The rest is `holdout` of the queries, or with `folds` K of 2 or more every query once:
    each of K parts is held back in turn from fits on the other K - 1, so the comparison
    sees every train query and no single draw of a quarter decides.

    Better means, by default, a higher reward (accuracy - lambda x USD). With a `budget`, a
    higher accuracy, the learned policy costing at most the budget's share of the best single's
    USD on the held-back queries. With a `floor`, the
    question is the floor's: the learned policy must reach the floor on the held-back queries
    (accuracy at least the best single's + floor, the best single chosen on the rest) and
    cost less than the fixed action by more than the margin. `everything`: the logs before the
    Pareto cut (default `examples`), where the best single is measured."""
    everything = examples if everything is None else everything
    if cfg.learner == "fixed":
        return {"shipped": "fixed", "why": "--learner fixed"}
    parts = _parts(cfg, {e.query for e in examples})
    if not parts:
        return {"shipped": "learned", "why": "too few queries to hold any back: the learned policy ships without "
                                             "being compared with the fixed action"}
    per_q: dict[str, dict[str, tuple[float, float, float]]] = {"learned": {}, "fixed": {}, "best_single": {}}
    fits = []
    for held_ids in parts:
        held = [e for e in examples if e.query in held_ids]
        fit_on = [e for e in examples if e.query not in held_ids]
        reference = best_singles([e for e in everything if e.query not in held_ids])
        learner = _learner(cfg, reference)
        fixed = FixedLearner(floor=cfg.floor, reference=reference, budget=cfg.budget)
        try:
            cut = action_logs(fit_on)
            _fit(learner, fit_on, cut)
            fixed.fit(fit_on, cut)
            per_q["learned"].update(outcomes(learner, held))
            per_q["fixed"].update(outcomes(fixed, held))
        finally:
            close = getattr(learner, "close", None)
            if callable(close):
                close()
        singles = {t: w[0] for t, w in reference.items()}
        if cfg.floor is not None or cfg.budget is not None:
            per_q["best_single"].update(outcomes(_Constant(singles), [e for e in everything if e.query in held_ids]))
        fits.append({"fixed": dict(fixed.choice), "best_single": singles, "fixed_why": fixed.why})
    n_held = len(set().union(*parts))
    values = {k: summarize(per_q[k], n_held) for k in ("learned", "fixed")}
    values["fixed"]["choice"] = fits[0]["fixed"]
    out: dict[str, Any] = {"held_back_queries": n_held, "ship_margin": cfg.ship_margin, **values,
                           "how": (f"{len(parts)}-fold cross-fit" if len(parts) > 1
                                   else f"{cfg.holdout:g} of the queries held back")}
    if len(parts) > 1:
        out["folds"] = [{"fixed": f["fixed"], "best_single": f["best_single"]} for f in fits]
    if cfg.budget is None and cfg.floor is None:
        d = paired_diff(per_q["learned"], per_q["fixed"], 0)
        better = d is not None and d[0] > 0 and d[0] > cfg.ship_margin * d[1]
        out.update(rule=f"learned if its reward beats the fixed action's by more than {cfg.ship_margin:g} "
                        f"paired SE on the held-back queries", learned_minus_fixed_reward=d)
    else:
        better, rule, details = (_within_budget if cfg.budget is not None else _reaches_floor)(cfg, per_q)
        out.update(rule=rule, **details, best_single=fits[0]["best_single"], fixed_why=fits[0]["fixed_why"])
    out["shipped"] = "learned" if better else "fixed"
    return out


def _within_budget(cfg: TrainConfig, per_q: dict[str, dict]) -> tuple[bool, str, dict[str, Any]]:
    """The budget's ship rule: within the cost on the held-back queries, and more accurate."""
    d = paired_diff(per_q["learned"], per_q["fixed"], 1)
    usd = {k: sum(v[2] for v in per_q[k].values()) / max(len(per_q[k]), 1) for k in ("learned", "best_single")}
    within = usd["learned"] <= cfg.budget * usd["best_single"] + 1e-15  # a free pool: free only
    better = within and d is not None and d[0] > 0 and d[0] > cfg.ship_margin * d[1]
    return better, (f"learned if it costs at most {cfg.budget:g} of the best single's USD per query on the "
                    f"held-back queries and is more accurate than the fixed action by more than "
                    f"{cfg.ship_margin:g} paired SE"), {
        "budget": cfg.budget, "learned_minus_fixed_accuracy": d,
        "learned_share_of_best_single_usd": usd["learned"] / usd["best_single"] if usd["best_single"] > 0 else None}


def _reaches_floor(cfg: TrainConfig, per_q: dict[str, dict]) -> tuple[bool, str, dict[str, Any]]:
    """The floor's ship rule: at the floor on the held-back queries, and cheaper."""
    vs_best = paired_diff(per_q["learned"], per_q["best_single"], 1)
    saves = paired_diff(per_q["fixed"], per_q["learned"], 2)
    reaches = vs_best is not None and vs_best[0] >= cfg.floor - 1e-12
    better = reaches and saves is not None and saves[0] > 0 and saves[0] > cfg.ship_margin * saves[1]
    return better, (f"learned if it reaches the floor ({cfg.floor:+g} of the best single's accuracy) on the "
                    f"held-back queries and costs less than the fixed action by more than "
                    f"{cfg.ship_margin:g} paired SE"), {
        "floor": cfg.floor, "learned_minus_best_single_accuracy": vs_best, "fixed_minus_learned_usd": saves}


def _parts(cfg: TrainConfig, queries: set[str]) -> list[set[str]]:
    """The query sets held back in turn: one (`holdout`) or `folds` covering every query;
    none when a fit would have no query left."""
    if cfg.folds >= 2:
        parts = [set() for _ in range(cfg.folds)]
        for q in queries:
            parts[_fold(q, cfg.folds, cfg.seed)].add(q)
        parts = [p for p in parts if p]
        return parts if len(parts) >= 2 else []
    held = {q for q in queries if _held_back(q, cfg.holdout, cfg.seed)}
    return [held] if held and held != queries else []


def implied_lambda(measured: dict[str, list[Measured]], kept: dict[str, list[Measured]],
                   reference: dict[str, tuple[str, float, float]], floor: float | None,
                   budget: float | None = None) -> dict[str, Any] | None:
    """The lambda under which the floor's (or budget's) fixed action has the best reward (accuracy - lambda x
    USD) among the kept actions, for the task with the most queries: the middle (geometric) of
    the range where it does, or, when it is not on the convex hull, the lambda where it falls
    least short of the best."""
    task = max(measured, key=lambda t: (max((m.n for m in measured[t]), default=0), t))
    ms = kept[task]
    pick, why = target_choice({m.action.key: m.accuracy for m in ms}, {m.action.key: m.cost for m in ms}, floor,
                              budget, reference.get(task))
    c = next(m for m in ms if m.action.key == pick)
    lo = max([(m.accuracy - c.accuracy) / (m.cost - c.cost) for m in ms
              if m.cost > c.cost and m.accuracy > c.accuracy], default=0.0)
    hi = min([(c.accuracy - m.accuracy) / (c.cost - m.cost) if m.accuracy < c.accuracy else 0.0
              for m in ms if m.cost < c.cost], default=math.inf)
    if lo <= hi:
        lam = 2 * lo if math.isinf(hi) else (hi / 2 if lo == 0 else math.sqrt(lo * hi))
        return {"task": task, "action": pick, "lambda": lam, "range": [lo, hi], "on_hull": True}

    def regret(lam: float) -> float:
        return max(m.accuracy - lam * m.cost for m in ms) - (c.accuracy - lam * c.cost)

    a, b = max(hi, lo / 1e3, 1e-9), lo
    grid = [a * (b / a) ** (i / 200) for i in range(201)]
    lam = min(grid, key=regret)
    return {"task": task, "action": pick, "lambda": lam, "range": [lo, hi], "on_hull": False,
            "regret": regret(lam)}


class _Constant:
    """A policy playing one given action per task (to value the best single on held-back queries)."""

    def __init__(self, choice: dict[str, str]):
        self.choice = choice

    def greedy(self, ctx: Context, actions: Sequence[Action]) -> int:
        keys = [a.key for a in actions]
        key = self.choice.get(ctx.task or "none")
        return keys.index(key) if key in keys else -1


def _greedy_matches(learner: Any, examples: Sequence[Logged]) -> dict[str, list[Logged]]:
    """Per query, the logged examples whose action is the learner's greedy choice."""
    greedy: dict[tuple[int, tuple[str, ...]], int] = {}
    by_query: dict[str, list[Logged]] = {}
    for e in examples:
        key = (id(e.context), tuple(a.key for a in e.actions))
        if key not in greedy:
            greedy[key] = learner.greedy(e.context, e.actions)
        if greedy[key] == e.chosen:
            by_query.setdefault(e.query, []).append(e)
    return by_query


def outcomes(learner: Any, examples: Sequence[Logged]) -> dict[str, tuple[float, float, float]]:
    """Per query: the mean (reward, correct, cost) of the logged examples whose action is the
    learner's greedy one (queries where none is logged are left out)."""
    by_query = _greedy_matches(learner, examples)
    return {q: (sum(e.reward for e in es) / len(es), sum(float(bool(e.correct)) for e in es) / len(es),
                sum(e.cost for e in es) / len(es)) for q, es in by_query.items()}


def paired_diff(a: dict[str, tuple[float, ...]], b: dict[str, tuple[float, ...]],
                i: int) -> tuple[float, float] | None:
    """Mean of a - b in field `i` over the queries both have, with its standard error."""
    common = sorted(set(a) & set(b))
    if not common:
        return None
    d = [a[q][i] - b[q][i] for q in common]
    m = sum(d) / len(d)
    se = math.sqrt(sum((x - m) ** 2 for x in d) / max(len(d) - 1, 1) / len(d))
    return m, se


def policy_value(learner: Any, examples: Sequence[Logged]) -> dict[str, float]:
    """SNIPS estimates of the learner's greedy policy on logged examples: reward, accuracy and
    cost per query, with the reward's standard error."""
    return summarize(outcomes(learner, examples), len({e.query for e in examples}))


def summarize(per_q: dict[str, tuple[float, float, float]], queries: int) -> dict[str, float]:
    """Reward (with its standard error), accuracy and cost per query over per-query outcomes
    (`outcomes`): queries weigh the same whatever their number of matching examples."""
    n = len(per_q)
    if not n:
        return {"reward": -math.inf, "accuracy": 0.0, "usd": 0.0, "reward_se": math.inf, "matched": 0,
                "queries": queries}
    reward, correct, cost = zip(*per_q.values())
    v = sum(reward) / n
    se = math.sqrt(sum((x - v) ** 2 for x in reward) / max(n - 1, 1) / n)
    return {"reward": v, "reward_se": se, "accuracy": sum(correct) / n, "usd": sum(cost) / n,
            "matched": n, "queries": queries}


def _held_back(query: str, share: float, seed: int) -> bool:
    h = int.from_bytes(hashlib.sha256(f"holdout:{seed}:{query}".encode()).digest()[:8], "big")
    return h / 2 ** 64 < share


def _fold(query: str, folds: int, seed: int) -> int:
    h = int.from_bytes(hashlib.sha256(f"fold:{seed}:{query}".encode()).digest()[:8], "big")
    return h * folds >> 64


def _row(m: Measured, logs: ActionLogs | None = None) -> dict[str, Any]:
    """`n`: the queries the figures rest on. An action with unlogged queries (not a sweep) also
    shows how many, what `n` is made of (logged + unservable; the figures count the unlogged
    queries at the logged mean), and the guarded figures the cut and the fixed action were
    chosen on."""
    row = {"action": m.action.key, "n": m.n, "accuracy": round(m.accuracy, 5), "usd": m.cost,
           "se": round(m.se, 5)}
    if logs is not None and logs.unlogged:
        row.update(logged=logs.logged, unservable=logs.unservable, unlogged=len(logs.unlogged),
                   guarded_accuracy=round(logs.guarded("correct"), 5), guarded_usd=logs.guarded("cost"))
    return row


def off_policy_estimates(learner: Any, examples: Sequence[Logged]) -> dict[str, float | int]:
    """On the training logs: the logged plans' mean reward, accuracy and cost, and the learned
    greedy policy's self-normalized IPS estimates (optimistic: measured on the data it was fit to)."""
    greedy: dict[tuple[int, tuple[str, ...]], int] = {}
    num = {"reward": 0.0, "correct": 0.0, "cost": 0.0}
    den = 0.0
    matched = 0
    for e in examples:
        key = (id(e.context), tuple(a.key for a in e.actions))
        if key not in greedy:
            greedy[key] = learner.greedy(e.context, e.actions)
        if greedy[key] == e.chosen:
            w = 1.0 / max(e.propensity, 1e-6)
            num["reward"] += w * e.reward
            num["correct"] += w * float(bool(e.correct))
            num["cost"] += w * e.cost
            den += w
            matched += 1
    n = len(examples)
    out: dict[str, float | int] = {
        "logged_reward": sum(e.reward for e in examples) / n,
        "logged_accuracy": sum(bool(e.correct) for e in examples) / n,
        "logged_usd_per_plan": sum(e.cost for e in examples) / n,
        "greedy_matches": matched,
    }
    if den:
        out.update(greedy_reward_snips=num["reward"] / den, greedy_accuracy_snips=num["correct"] / den,
                   greedy_usd_snips=num["cost"] / den)
    return out


def runs_for_pool(data_dir: Path, pool: Pool) -> list[str]:
    """Complete runs of the embedded planner over this pool (same pool key), from the DuckDB catalog."""
    from conductor.store import refresh_catalog

    data_dir = Path(data_dir)
    if not any((data_dir / "runs").glob("*/rewards.parquet")):
        return []
    db = refresh_catalog(data_dir)
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT run_id, (inputs->>'pool') FROM runs WHERE status = 'complete' "
                           "AND (inputs->>'planner') = 'embedded' ORDER BY created_at, run_id").fetchall()
    key = artifacts.pool_key(pool)
    out = []
    for run_id, pool_path in rows:
        try:
            if pool_path and artifacts.pool_key(load_pool(pool_path)) == key:
                out.append(run_id)
        except ConductorError:
            continue  # its pool file moved or no longer loads: not this pool's run as far as we can tell
    return out


def describe(folder: Path, pool: Pool | None = None) -> str:
    """A few lines about an artifact, for the CLI; with `pool`, whether it fits that pool and
    whether the pool's prices moved since training."""
    meta = artifacts.read_meta(folder)
    t = meta["training"]
    acts = meta["actions"]["by_task"]
    lines = [f"policy   {folder}",
             f"version  v{meta['version']:04d} (format {meta['format_version']}), pool {meta['pool']['key']}, "
             f"learner {meta['learner']['name']}, lambda {meta['lambda']:g}",
             f"goal     {meta.get('objective', 'accuracy - lambda * USD per query')}",
             "actions  " + ", ".join(f"{task}: {len(keys)}" for task, keys in acts.items()),
             f"trained  on {t['plans_used']} plans of {t['queries']} queries from run(s) "
             f"{', '.join(r['run_id'] for r in t['runs'])} in {t['seconds']:.1f} s"]
    if t.get("skipped"):
        lines.append("skipped  " + ", ".join(f"{k}: {v}" for k, v in t["skipped"].items()))
    path = Path(folder) / artifacts.META_FILE
    if t.get("coverage"):
        lines += guarded(path, "training.coverage", lambda: [f"coverage {coverage_text(task, c, short=True)}"
                                                             for task, c in t["coverage"].items()])
    lines += guarded(path, "fixed.why", lambda: _target_text(meta.get("fixed") or {}))
    if meta["learner"].get("kind") == "segment":
        lines += guarded(path, "learner.why", lambda: _groups_text(meta["learner"].get("why", {}),
                                                                   meta.get("features", {}).get("group_by")))
    sel = t.get("selection") or {}
    shipped = meta.get("shipped", "learned")
    if sel:
        lines.append(f"ships    {shipped} ({guarded(path, 'training.selection', lambda: _selection_text(sel))})")
    # The fixed action saved in the artifact (fitted on every train query), which may differ from
    # the one the selection above fitted without its held-back queries.
    fixed = (meta.get("fixed") or (meta["learner"] if meta["learner"].get("kind") == "fixed" else {})).get("choice")
    if fixed:
        lines.append("fixed    " + ", ".join(f"{task}: {key}" for task, key in fixed.items())
                     + (" (fitted on every train query; planning uses it)" if shipped == "fixed" else
                        " (fitted on every train query; planning uses it only with the planner option use=fixed)"))
    if pool is not None:
        wrong = artifacts.mismatch(folder, meta, pool)
        if wrong:
            lines.append(f"NOT FOR THIS POOL: {wrong}; planning with it is refused")
        else:
            artifacts.check_workers(folder, meta, pool)  # refused as planning refuses it
            changes = artifacts.price_changes(meta, pool)
            if changes:
                lines.append(f"PRICES CHANGED since training (USD per million input/output tokens): "
                             f"{'; '.join(changes)}; its lambda ({meta['lambda']:g}) trade-offs were fitted under "
                             f"the old prices: retrain to fit the new ones")
    return "\n".join(lines)


def _target_text(fixed: dict[str, Any]) -> list[str]:
    """Per task, a floor no action reached or a budget no action fits: said, not only in policy.json."""
    out = []
    for task, w in ((fixed.get("why") or {}).items()):
        if not isinstance(w, dict) or w.get("reached") is not False:
            continue
        if "need_accuracy" in w:
            out.append(f"floor    {task}: NOT REACHED on train: no action reaches {w['need_accuracy']:.4f} (the best "
                       f"single's {w['best_single_accuracy']:.4f} {fixed.get('floor'):+g}); the fixed action is the "
                       f"most accurate, {w['accuracy']:.4f}")
        else:
            out.append(f"budget   {task}: NOT MET on train: no action costs at most {usd(w['cap_usd'])}; the fixed "
                       f"action is the cheapest, {usd(w['usd'])}")
    return out


def _groups_text(why: dict[str, dict], field: str | None) -> list[str]:
    """Per task, what the segment learner's cross-fitting chose: groups or not, and with what shrinkage."""
    out = []
    for task, w in why.items():
        wide = w["task_wide_crossfit"]
        figures = (f"cross-fitted {w['crossfit_accuracy']:.4f} at {usd(w['crossfit_usd'])}, task-wide "
                   f"{wide[0]:.4f} at {usd(wide[1])}")
        if w["grouped"]:
            sized = sum(1 for g in w["groups"] if g != "(task-wide)")
            out.append(f"groups   {task}: {sized} groups by {field}, shrink {w.get('shrink') or 0:g} "
                       f"(of {' '.join(f'{k:g}' for k in w.get('shrinks_tried', [0]))}), lambda {w['lambda']:g}; "
                       f"{figures}")
        else:
            out.append(f"groups   {task}: one action for every group (grouping gained nothing cross-fitted); {figures}")
    return out


def _selection_text(sel: dict[str, Any]) -> str:
    if "learned" not in sel:
        return sel.get("why", "")

    def f(v: dict[str, Any]) -> str:  # no SE (or no estimate) with one or two held-back queries
        num = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
        return f"{num(v.get('reward'))} ± {num(v.get('reward_se'))}"

    how = f", {sel['how']}" if sel.get("how") else ""
    n = sel["held_back_queries"]
    # The estimates are over the queries whose logs hold each policy's choice ("matched").
    short = [f"{k} {sel[k]['matched']}" for k in ("learned", "fixed")
             if isinstance(sel[k].get("matched"), int) and sel[k]["matched"] < n]
    over = f" (estimates over those whose logs hold its choice: {', '.join(short)})" if short else ""
    text = (f"on {n} held-back queries{how}{over}: learned {f(sel['learned'])}, "
            f"fixed {f(sel['fixed'])} (as fitted without them: "
            f"{', '.join(f'{t}: {k}' for t, k in sel['fixed']['choice'].items())})")
    return text + (f"; rule: {sel['rule']}" if sel.get("rule") else "")


def usd(x: float) -> str:
    """Three significant digits, never rounded to $0.000000: $0.0000800, $0.00144."""
    if x <= 0:
        return "$0"
    return f"${x:.{max(0, 2 - math.floor(math.log10(x)))}f}"


def dumps(obj: Any) -> str:
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2, default=str).decode()
