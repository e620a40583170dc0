"""`conductor policy`: rollouts for the learned policy, training, and what planning will use.

    conductor policy rollouts QUERIES --pool POOL [--samples 8|all]  K plans per query, executed, graded
    conductor policy train --pool POOL --runs RUN... [--lambda L]  fit and save the next artifact version
    conductor policy show --pool POOL                              the artifact planning uses, if any
    conductor policy eval --pool POOL --queries Q --policies DIR...  `conductor eval` with learned policies
"""

from __future__ import annotations

import argparse
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from conductor import argtypes
from conductor.cli import options
from conductor.errors import ConductorError
from conductor.replay.datasets import SPLITS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policy", help="the learned planner: rollouts, training, inspection",
                       description="The embedded planner's learned policy: a contextual bandit over plan shapes x "
                                   "workers, trained on the rewards of executed rollouts.")
    actions = p.add_subparsers(dest="policy_command", metavar="ACTION", required=True)

    r = actions.add_parser("rollouts", help="K plans per query from the policy's action space, run and graded",
                           description="Plan every query K times with the embedded planner over the policy's "
                                       "action set (uniform draws before any policy is trained, epsilon-greedy "
                                       "draws from the learned policy after), execute, grade. Each plan's "
                                       "propensity is logged; `conductor export` writes the run for TRL or verl.")
    r.add_argument("queries", type=argtypes.path, help="query set (Parquet)")
    options.pool(r)
    r.add_argument("--samples", "-k", default="8",
                   help="plans per query (default 8), or `all`: every candidate action once per query (a sweep, "
                        "which measures each action on the same queries; what training's Pareto cut needs)")
    options.run_id(r)
    options.data_dir(r)
    r.add_argument("--policy", default="auto",
                   help="auto (the newest artifact for this pool under $CONDUCTOR_POLICY_DIR or data/policy), "
                        "none (no learned policy: uniform over the action set), or a policy folder")
    r.add_argument("--explore", type=float, default=None,
                   help="share of draws spread evenly over the candidates (default: 1.0 without a learned "
                        "policy, 0.2 with one)")
    options.seed(r)
    options.max_steps(r)
    options.cost_penalty(r)
    r.add_argument("--serve", action="store_true",
                   help="replay pools: start the replay server at the pool's address for the run's duration")
    options.quiet(r)
    r.set_defaults(func=rollouts)

    t = actions.add_parser("train", help="train the policy on runs' rewards and save a new artifact version",
                           description="Off-policy training on executed plans (rewards joined with plans and "
                                       "traces): reward = correct - LAMBDA x USD, weighted by the logged "
                                       "propensities. Saves <out>/<pool key>/vNNNN/{policy.json, model file}.")
    options.pool(t)
    t.add_argument("--runs", nargs="+", required=True, metavar="RUN_ID")
    t.add_argument("--lambda", dest="lam", type=float, default=0.0, metavar="LAMBDA",
                   help="cost weight: accuracy points given up per USD per query (default 0, at most 1e9)")
    t.add_argument("--allow-other-pool", action="store_true",
                   help="train on runs made with another pool (other workers, or another dataset's questions), "
                        "which is refused otherwise")
    options.data_dir(t)
    t.add_argument("--out", type=argtypes.path, default=None,
                   help="policy root (default: $CONDUCTOR_POLICY_DIR, else data/policy)")
    t.add_argument("--learner", default="vw", choices=("vw", "vw-task", "table", "fixed", "segment"),
                   help="vw: Vowpal Wabbit cb_explore_adf over text n-grams (default); vw-task: without the "
                        "text; table: per-task IPS table; fixed: the best fixed action per task; segment: the "
                        "best fixed action per task and group (--group-by)")
    t.add_argument("--group-by", default=None, metavar="FIELD",
                   help="with --learner segment: the field of the queries' metadata (JSON) naming each "
                        "query's group, such as a subject or a document type")
    t.add_argument("--shrinks", type=float, nargs="+", default=None, metavar="K",
                   help="with --learner segment: each group's choice counts the task-wide logs as K more "
                        "queries; K is cross-fitted among these (default 0 20 50 100 200 400; 0: the group alone)")
    t.add_argument("--holdout", type=float, default=None,
                   help="share of queries held back to choose between the learned policy and the best fixed "
                        "action (default 0.25)")
    t.add_argument("--folds", type=int, default=1, metavar="K",
                   help="instead of --holdout: hold back each of K parts of the queries in turn (K fits), so "
                        "the choice sees every query (default 1: one held-back share)")
    t.add_argument("--floor", type=float, default=None, metavar="DELTA",
                   help="the fixed action is the cheapest whose train accuracy is at least the best single "
                        "worker's + DELTA (0: match it; -0.01: within a point), instead of the best reward; "
                        "the learner's lambda is then the one under which that action is the best")
    t.add_argument("--budget", type=float, default=None, metavar="SHARE",
                   help="the fixed action is the most accurate whose train cost per query is at most SHARE "
                        "of the best single worker's (0.15: 15%%), instead of the best reward; the learned "
                        "policy ships only within that cost on the held-back queries. Not with --floor")
    t.add_argument("--ship-margin", type=float, default=1.0, metavar="SE",
                   help="ship the learned policy only when it beats the fixed action on the held-back "
                        "queries by more than this many paired standard errors (default 1)")
    t.add_argument("--cb-type", default="mtr", choices=("mtr", "dr", "ips"),
                   help="VW's estimator: mtr (importance-weighted regression, default), dr, ips")
    t.add_argument("--passes", type=options.int_in(1, 10_000), default=None,
                   help="VW passes over the data (1 to 10000)")
    options.seed(t)
    t.set_defaults(func=train, resumes=False)  # Ctrl-C keeps nothing: see _stops_start_over

    e = actions.add_parser("eval", help="the evaluation report (conductor eval) with learned policies added",
                           description="Everything `conductor eval` reports (every single worker, best single, "
                                       "oracle, uniform random, the prior planner) plus each learned policy given, "
                                       "planned greedily through the pipeline against the replay server; several "
                                       "policies (a lambda sweep) are drawn as one curve.")
    options.pool(e, "replay pool file")
    e.add_argument("--queries", type=argtypes.path, required=True, help="query set (`conductor replay queries`)")
    e.add_argument("--split", choices=SPLITS, default="test")
    e.add_argument("--policies", type=argtypes.path, nargs="+", required=True, metavar="DIR",
                   help="policy artifact folders (a version folder, or a pool's folder for its newest)")
    options.report_out(e, "report folder (default: data/eval/<dataset>-<split>)")
    e.add_argument("--no-planner", action="store_true", help="leave out the prior planner's run")
    options.planner_limit(e, "run the planners on N of the queries (default: all)")
    e.add_argument("--no-fixed", action="store_true",
                   help="leave out each artifact's best fixed action and the best fixed cascade")
    e.add_argument("--target", action="append", default=[], metavar="DELTA:SHARE",
                   help="a target to check: accuracy at least the best single's + DELTA at most SHARE of its "
                        "cost per query (e.g. 0:0.25, or -0.01:0.15 for within a point at 15%%); repeatable")
    options.seed(e)
    e.set_defaults(func=evaluate, resumes=False)  # its planner runs start over

    s = actions.add_parser("show", help="the policy artifact planning would use for a pool")
    options.pool(s)
    s.add_argument("--policy", default=None, help="a policy folder (default: $CONDUCTOR_POLICY_DIR or data/policy)")
    s.set_defaults(func=show)


def rollouts(args: argparse.Namespace) -> int:
    from conductor.cli.render import run_summary
    from conductor.policy.artifact import find
    from conductor.pool import load_pool
    from conductor.rewards import RewardScheme
    from conductor.runner import RunConfig, run_all

    if args.explore is not None and not 0 <= args.explore <= 1:
        raise ConductorError(f"--explore must be between 0 and 1 (got {args.explore})")
    pool = load_pool(args.pool)
    learned = None if args.policy in ("none", "prior") else find(pool, None if args.policy == "auto" else args.policy)
    if args.policy not in ("none", "prior", "auto") and learned is None:
        raise ConductorError(f"--policy {args.policy}: no policy artifact there for this pool")
    explore = args.explore if args.explore is not None else (0.2 if learned else 1.0)
    # Resolved, so a resume names the same folder from any working directory and spelling
    options = {"candidates": "bandit", "explore": explore, "policy": str(learned.resolve()) if learned else "none"}
    _check_references(args.queries)
    _check_recorded(pool, args.queries)
    samples = _samples(args.samples, pool, args.queries)
    if args.samples == "all":
        options = {"sweep": True, "policy": "none"}
    options["policy"] = _check_resume(args, options["policy"])
    cfg = RunConfig(queries=args.queries, pool=args.pool, data_dir=args.data_dir, run_id=args.run_id,
                    samples=samples, planner="embedded", planner_options=options, seed=args.seed,
                    max_steps=args.max_steps, rewards=RewardScheme(cost_penalty=args.cost_penalty),
                    progress=not args.quiet)
    if args.samples == "all":
        print(f"rollouts: a sweep, every candidate action once per query ({samples} slots per query)", flush=True)
    else:
        print(f"rollouts: {samples} plans per query, {_drawn(learned, samples, explore)}, explore {explore:g}",
              flush=True)
    if args.serve:
        with _serving(pool):
            summary = run_all(cfg)
    else:
        summary = run_all(cfg)
    print(run_summary(summary))
    print(f"\nexport it:  conductor export --run {summary['run_id']} --data-dir {args.data_dir} --format trl "
          f"--out data/export/{summary['run_id']}")
    print(f"train on it: conductor policy train --pool {args.pool} --runs {summary['run_id']} "
          f"--data-dir {args.data_dir}")
    return 0


def _drawn(learned: Path | None, samples: int, explore: float) -> str:
    """How the plans are drawn, as `_choose` and `planning.draw` draw them."""
    if learned:
        how = "greedy" if explore == 0 else "epsilon-greedy"
        return f"learned policy {learned} ({how})"
    if explore == 1:
        return "no learned policy (uniform over the action set)"
    if samples == 1 and explore == 0:
        return "no learned policy (the prior's best action of the set, greedy)"
    return "no learned policy (the prior's softmax over the action set" + (
        f", a share {explore:g} of draws uniform)" if explore else ")")


def _check_resume(args: argparse.Namespace, policy: str) -> str:
    """Rerunning a run whose --policy now resolves to another artifact (a newer version was
    trained meanwhile): name both, since the runner can only say the inputs differ. Folders are
    compared resolved (the refusal names an absolute path; a relative one is the same folder);
    returns the policy as the run recorded it, so the runner finds the same inputs."""
    from conductor.store import RunDir

    run = RunDir(args.data_dir, args.run_id) if args.run_id else None
    if run is None or not run.exists():
        return policy
    used = ((run.read_manifest().get("inputs") or {}).get("planner_options") or {}).get("policy")
    if used is None or used == policy:
        return policy
    if "none" not in (used, policy) and Path(used).resolve() == Path(policy).resolve():
        return used

    def named(p: str) -> str:
        return "none (no learned policy)" if p == "none" else f"{Path(p).name} ({p})"

    raise ConductorError(f"run {args.run_id} was planned with the policy {named(used)}, but --policy {args.policy} "
                         f"now resolves to {named(policy)}; to resume the run pass --policy {used}, or choose "
                         f"another --run-id for a new run")


def _check_references(queries: Path) -> None:
    """Refused before any plan runs: with no reference nothing is graded, and training would
    find no example after the whole run (a table without gold answers, such as RouterBench's)."""
    from conductor.queries import load_queries

    refs = load_queries(queries).column("reference").to_pylist()
    if not any(r is not None and r.strip() for r in refs):
        raise ConductorError(f"{queries}: no query has a reference, so no plan could be graded and "
                             f"`conductor policy train` would find no training examples (not graded: no "
                             f"reference); a table without gold answers evaluates routing by its labels "
                             f"(`conductor eval`) but cannot train the learned policy")


def _check_recorded(pool, queries: Path) -> None:
    """Rollouts through a replay pool of questions it never recorded would all be invalid
    plans, and the run would still end 'ok' and offer itself for training."""
    if pool.replay is None:
        return
    from conductor.queries import load_queries
    from conductor.replay.tables import servable

    known = servable(pool)
    table = load_queries(queries)
    unknown = [q for q, p in zip(table.column("query_id").to_pylist(), table.column("prompt").to_pylist())
               if p not in known]
    if unknown:
        raise ConductorError(f"{queries}: {len(unknown)} of {table.num_rows} queries are not questions the replay "
                             f"pool {pool.path} recorded (e.g. {', '.join(map(str, unknown[:3]))}); write the "
                             f"queries with `conductor replay queries` from the pool's table")


def _samples(value: str, pool, queries: Path) -> int:
    """--samples: a count, or `all`: the largest candidate set among the queries' tasks."""
    if value == "all":
        from conductor.policy.actions import action_set
        from conductor.queries import load_queries

        tasks = set(load_queries(queries).column("task").to_pylist())
        return max(max(len(action_set(pool, t)) for t in tasks), 1)
    from conductor.runner import MAX_SAMPLES

    try:
        k = int(value)
    except ValueError:
        raise ConductorError(f"--samples {value!r}: expected a number or `all`") from None
    if not 1 <= k <= MAX_SAMPLES:
        raise ConductorError(f"--samples is plans per query: 1 to {MAX_SAMPLES} (got {k})")
    return k


def _serving(pool):
    """The replay server at the address the pool's replay workers call."""
    from conductor.replay.process import serve_pool

    try:
        return serve_pool(pool)
    except ConductorError as e:
        raise ConductorError(f"--serve: {e}") from None


def train(args: argparse.Namespace) -> int:
    from conductor.policy.features import FeatureSettings
    from conductor.policy.training import TrainConfig, describe, dumps
    from conductor.policy.training import train as fit
    from conductor.pool import load_pool
    from conductor.runner import planning_pool

    if args.folds >= 2 and args.holdout is not None:
        raise ConductorError(f"--holdout {args.holdout:g} and --folds {args.folds}: give one (--folds holds every "
                             f"query back once, in {args.folds} parts)")
    if args.learner == "fixed":  # nothing to compare: it ships the fixed action, held-back queries or not
        given = [f for f, v in (("--folds", args.folds if args.folds != 1 else None),
                                ("--holdout", args.holdout), ("--ship-margin", None if args.ship_margin == 1.0
                                                              else args.ship_margin)) if v is not None]
        for flag in given:
            print(f"conductor: warning: {flag} has no effect with --learner fixed: it ships the best fixed action "
                  f"on all the queries, and holds none back to compare it with", file=sys.stderr, flush=True)
    vw = {"cb_type": args.cb_type}
    if args.passes is not None:
        vw["passes"] = args.passes
    twice = sorted({r for r in args.runs if args.runs.count(r) > 1})
    if twice:  # its logs would count twice in training
        raise ConductorError(f"--runs names {', '.join(twice)} more than once")
    with _stops_start_over():
        folder, summary = fit(TrainConfig(pool=args.pool, runs=args.runs, data_dir=args.data_dir, lam=args.lam,
                                          out=args.out, learner=args.learner, seed=args.seed,
                                          holdout=0.25 if args.holdout is None else args.holdout, folds=args.folds,
                                          floor=args.floor, budget=args.budget, ship_margin=args.ship_margin,
                                          features=FeatureSettings(group_by=args.group_by),
                                          shrinks=None if args.shrinks is None else tuple(args.shrinks),
                                          allow_other_pool=args.allow_other_pool,
                                          vw=vw if args.learner.startswith("vw") else {}),
                              pool=planning_pool(load_pool(args.pool)))
    print(describe(folder))
    print("estimates " + dumps(summary["estimates"]))
    print("selection " + dumps(summary["selection"]))
    return 0


@contextmanager
def _stops_start_over():
    """Ctrl-C or SIGTERM while training: nothing is kept (the version folder is written whole, at
    the end), so a rerun trains from the start; the generic message would promise a resume."""
    import signal

    came: list[int] = []
    before = signal.getsignal(signal.SIGTERM)
    mine = callable(before) and threading.current_thread() is threading.main_thread()
    if mine:
        def on_term(signum, frame):
            came.append(signum)
            before(signum, frame)

        signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except BaseException as e:
        # DuckDB (reading the runs) turns Ctrl-C into its own error
        if not isinstance(e, KeyboardInterrupt) and type(e).__name__ != "InterruptException":
            raise
        stopped = ConductorError(f"{'terminated' if came else 'interrupted'}: policy train keeps nothing until "
                                 f"it writes the new version, so nothing was saved; rerun the same command to "
                                 f"train again from the start")
        stopped.exit_code = 143 if came else 130
        raise stopped from None
    finally:
        if mine:
            signal.signal(signal.SIGTERM, before)


def evaluate(args: argparse.Namespace) -> int:
    from conductor.cli.eval import print_notes
    from conductor.cli.render import eval_report
    from conductor.evaluation import EvalConfig, Target
    from conductor.evaluation import evaluate as run_eval

    targets = [Target.parse(t) for t in args.target]
    _check_policies(args.pool, args.policies)
    report = run_eval(EvalConfig(pool=args.pool, queries=args.queries, split=args.split, out=args.out,
                                 planner=not args.no_planner, planner_limit=args.planner_limit,
                                 policies=list(args.policies), seed=args.seed, fixed=not args.no_fixed,
                                 targets=targets))
    print(eval_report(report, learned=True))
    print_notes(report.meta)
    return 0


def _check_policies(pool_path: Path, folders: list[Path]) -> None:
    """Before the evaluation's runs: an artifact of another pool is refused naming the user's
    --pool (the runs plan over a scratch copy of it), and a price change since training is said."""
    from conductor.policy.artifact import find, mismatch, read_meta, warn_prices
    from conductor.pool import load_pool

    pool = load_pool(pool_path)
    for folder in folders:
        found = find(pool, folder)
        if found is None:
            continue  # the evaluation names it
        meta = read_meta(found)
        wrong = mismatch(found, meta, pool)
        if wrong:
            raise ConductorError(f"{wrong}; train one for this pool with `conductor policy train`")
        warn_prices(found, meta, pool)


def show(args: argparse.Namespace) -> int:
    from conductor.policy.artifact import META_FILE, default_root, find, pool_key
    from conductor.policy.training import describe
    from conductor.pool import load_pool

    pool = load_pool(args.pool)
    if args.policy is not None and not Path(args.policy).exists():
        raise ConductorError(f"--policy {args.policy}: no such folder")
    if args.policy is not None and not Path(args.policy).is_dir():
        raise ConductorError(f"--policy {args.policy}: is a file; give a policy folder (a version folder vNNNN, "
                             f"a pool's folder, or a policy root)")
    folder = find(pool, args.policy)
    if folder is None and args.policy is not None:
        # What planning with policy=FOLDER does (run, rollouts and eval refuse it), not the prior.
        raise ConductorError(f"--policy {args.policy}: no policy artifact there for this pool ({pool_key(pool)}): "
                             f"no {META_FILE} in it and no version folder under it; planning with it is refused")
    if folder is None:
        print(f"no policy for this pool under {default_root()}: the embedded planner plans with its prior")
        return 0
    print(describe(folder, pool))
    return 0
