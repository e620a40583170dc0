"""The learned policy end to end on recorded data: a sweep of every candidate action on
the train split through the real pipeline, training per lambda, a second (on-policy)
round, and evaluation on the held-out test split against the best single worker
chosen on train, graded by the same grader.

    python bench/policy.py --docs                            # gsm8k and mmlu_pro, the issue's targets
    python bench/policy.py --datasets gsm8k --lambdas 0 30
    python bench/policy.py --datasets gsm8k --lambdas --floors 0 --budgets   # the floor only, no lambda
    python bench/policy.py --tables my_logs.parquet --lambdas 0 30   # any recorded table (see the README)
    python bench/policy.py --datasets mmlu_pro --learner segment --group-by category --work data/bench-policy-segment

Per dataset (everything under --work, default data/bench-policy/<dataset>):
1. The replay pool and the train and test query sets (`conductor replay pool|queries`).
2. A sweep on train: every candidate action (singles, cascades, votes) once per
   query, through the pipeline against the replay server (`conductor policy
   rollouts --samples all`).
3. Per lambda, per floor and per budget: train on the sweep (round 1: Pareto cut on the
   measured actions, learned vs best fixed action on held-back train queries); one
   on-policy round of --samples epsilon-greedy draws from it; retrain on both (round 2).
   A floor (`--floors`, by default the targets' accuracy deltas) trains the fixed
   action as the cheapest one whose train accuracy reaches the best single's + floor;
   a budget (`--budgets`, by default the targets' cost shares) as the most accurate
   one costing at most that share of the best single's cost: each target asked of
   the train split from both sides, never of test.
4. `conductor policy eval` on the test split with the round-1 artifacts: every single
   worker, the best single (chosen on train), the oracle, the prior planner, the
   best fixed cascade on train, per lambda the learned policy and the best fixed
   action (the shipped one marked), paired standard errors, the targets met or not.
   Then the round-2 artifacts (shipped policies only), compared with round 1.

Prints a Markdown summary and writes it to <work>/summary.md with summary.json.
Reruns resume: finished runs are reused (their ids derive from the inputs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

DEFAULT_LAMBDAS = {"gsm8k": [0, 10, 30, 60, 100], "mmlu_pro": [0, 3, 10, 30]}
TARGETS = {  # the issue's, relative to the best single chosen on train (accuracy delta, cost share)
    "gsm8k": ["0:0.25"],
    "mmlu_pro": ["-0.01:0.15", "0:0.5"],
}


def main(argv: list[str] | None = None) -> int:
    from conductor import argtypes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--datasets", nargs="+", default=None, choices=["gsm8k", "mmlu_pro"],
                    help="shared tables (default: both, unless --tables is given)")
    ap.add_argument("--tables", nargs="+", type=argtypes.path, default=[], metavar="PATH",
                    help="recorded tables at any path (each named by its file stem; tasks from their task column)")
    ap.add_argument("--task", default=None, help="task of rows of --tables that name none")
    ap.add_argument("--prices", type=argtypes.path, default=None,
                    help="price table for --tables (default: prices.csv of the replay folder)")
    ap.add_argument("--lambdas", nargs="*", type=argtypes.number_in(0.0, 1e9), default=None,
                    help="default: a sweep per dataset")
    ap.add_argument("--floors", nargs="*", type=argtypes.number_in(-0.99, 0.99), default=None, metavar="DELTA",
                    help="accuracy floors relative to the best single on train (default: the targets' deltas)")
    ap.add_argument("--budgets", nargs="*", type=argtypes.number_in(0.001, 1000.0), default=None, metavar="SHARE",
                    help="cost caps, shares of the best single's cost on train (default: the targets' shares)")
    ap.add_argument("--target", action="append", default=None, metavar="DELTA:SHARE",
                    help="targets to check (default: the issue's for the shared tables)")
    ap.add_argument("--replay-dir", type=argtypes.path, default=None,
                    help="folder of the shared tables and prices.csv (default: $CONDUCTOR_REPLAY_DIR, else "
                         "../shared/replay)")
    ap.add_argument("--work", type=argtypes.path, default=REPO / "data" / "bench-policy")
    ap.add_argument("--samples", type=argtypes.int_in(1, 4096), default=4,
                    help="plans per query of the on-policy round")
    ap.add_argument("--explore", type=argtypes.number_in(0.0, 1.0), default=0.3, help="epsilon of the on-policy round")
    ap.add_argument("--port", type=argtypes.int_in(1, 65535), default=8931,
                    help="the replay server's port (fixed, so reruns resume)")
    ap.add_argument("--learner", default="vw", choices=("vw", "vw-task", "table", "segment"),
                    help="the per-query learner trained beside the best fixed action (default vw)")
    ap.add_argument("--group-by", default=None, metavar="FIELD",
                    help="with --learner segment: the metadata field naming each query's group (mmlu_pro: category)")
    ap.add_argument("--folds", type=argtypes.int_in(1, 1000), default=1, metavar="K",
                    help="training's choice between learned and fixed: 1, a held-back quarter (default); K, every "
                         "train query once in K parts (`policy train --folds`)")
    ap.add_argument("--docs", action="store_true", help="copy the charts to docs/img/policy_<dataset>.png")
    ap.add_argument("--sweep-only", action="store_true",
                    help="run (or resume) the sweep on train and stop: the slow part, reused by a later full run")
    ap.add_argument("--summary-only", action="store_true",
                    help="rebuild summary.md from the datasets' result.json files under --work; run nothing")
    from conductor.cli.options import join_dash_values

    args = ap.parse_args(join_dash_values(sys.argv[1:] if argv is None else list(argv)))
    if args.summary_only and args.sweep_only:
        ap.error("--summary-only and --sweep-only exclude each other")
    if (args.learner == "segment") != bool(args.group_by):
        ap.error("--learner segment needs --group-by FIELD, and --group-by needs --learner segment")
    if args.summary_only:
        results = {p.parent.name: json.loads(p.read_text()) for p in sorted(args.work.glob("*/result.json"))}
        return _write_summary(args.work, results)

    for flag, paths in (("--tables", args.tables), ("--prices", [args.prices] if args.prices else [])):
        for path in paths:
            if not path.expanduser().is_file():
                ap.error(f"{flag} {path}: not found" if not path.expanduser().exists() else
                         f"{flag} {path}: is a folder; give the file")

    from conductor.errors import ConductorError
    from conductor.evaluation import Target
    from conductor.replay.datasets import REPLAY_ENV
    from conductor.replay.tables import default_replay_dir, table_spec

    replay_dir = args.replay_dir or default_replay_dir()
    datasets = args.datasets if args.datasets is not None else ([] if args.tables else ["gsm8k", "mmlu_pro"])
    missing = [ds for ds in datasets if not (replay_dir / f"{ds}.parquet").is_file()]
    if missing:
        print(f"shared replay table {missing[0]}.parquet not found in {replay_dir}; pass --replay-dir DIR or set "
              f"${REPLAY_ENV}, or give your own tables with --tables PATH", file=sys.stderr)
        return 2
    try:
        for t in args.target or []:
            Target.parse(t)
        specs = [table_spec(dataset=ds, replay_dir=replay_dir) for ds in datasets]
        specs += [table_spec(table=t, task=args.task, prices=args.prices, replay_dir=replay_dir) for t in args.tables]
    except ConductorError as e:  # --task or --target: named in the message
        ap.error(str(e))
    plan = []  # (spec, objectives, targets), all checked before the first dataset's sweep
    for spec in specs:
        ds = spec.name
        lambdas = args.lambdas if args.lambdas is not None else DEFAULT_LAMBDAS.get(ds, [0, 10, 30, 100])
        targets = args.target if args.target is not None else TARGETS.get(ds, [])
        floors = (args.floors if args.floors is not None
                  else sorted({t.accuracy_delta for t in map(Target.parse, targets)}))
        budgets = (args.budgets if args.budgets is not None
                   else sorted({t.cost_share for t in map(Target.parse, targets)}))
        if not lambdas and not floors and not budgets:
            ap.error(f"nothing to train for {ds}: give --lambdas, --floors or --budgets (or --target)")
        plan.append((spec, [("lambda", v) for v in lambdas] + [("floor", v) for v in floors]
                     + [("budget", v) for v in budgets], targets))
    results = {}
    for spec, objectives, targets in plan:
        ds = spec.name
        results[ds] = bench(spec, args.work / ds, objectives, targets, args)
        if args.sweep_only:
            continue
        (args.work / ds / "result.json").write_text(json.dumps(results[ds], indent=2, default=str))
    if args.sweep_only:
        print(json.dumps(results, indent=2))
        return 0
    return _write_summary(args.work, results)


def _write_summary(work: Path, results: dict) -> int:
    text = summary_markdown(results)
    work.mkdir(parents=True, exist_ok=True)
    (work / "summary.md").write_text(text)
    (work / "summary.json").write_text(json.dumps(results, indent=2, default=str))
    print(text)
    return 0


def bench(spec, work: Path, objectives: list[tuple[str, float]], targets: list[str], args) -> dict:
    """`objectives`: ("lambda" | "floor" | "budget", value) pairs, each trained twice (two rounds)."""
    import pyarrow.parquet as pq

    from conductor.evaluation import EvalConfig, Target, evaluate
    from conductor.evaluation.policies import paired
    from conductor.evaluation.report import objective
    from conductor.policy.actions import action_set
    from conductor.policy.features import FeatureSettings
    from conductor.policy.training import TrainConfig, train
    from conductor.pool import load_pool
    from conductor.replay.build import pool_document, query_table, write_pool
    from conductor.replay.process import start_replay
    from conductor.runner import RunConfig, planning_pool, run_all

    t0 = time.monotonic()
    ds = spec.name
    work.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}/v1"
    pool = write_pool(work / "pool.yaml", pool_document(spec, api_base=url))
    files = {}
    for split in ("all", "train", "test"):
        files[split] = work / f"{ds}-{split}.parquet"
        if not files[split].exists():
            pq.write_table(query_table(spec, split), files[split])
    data, root = work / "data", work / "policy"
    log: dict = {"rollouts": [], "lambdas": {}}

    def rollouts(run_id: str, options: dict, samples: int, seed: int) -> dict:
        s = run_all(RunConfig(queries=files["train"], pool=pool, data_dir=data, run_id=run_id, samples=samples,
                              planner="embedded", planner_options=options, seed=seed, progress=False))
        print(f"  {run_id}: {s['plans']} plans, {s['wall_time_s']:.0f} s", flush=True)
        log["rollouts"].append({"run_id": run_id, "plans": s["plans"], "seconds": s["wall_time_s"]})
        return s

    tasks = set(pq.read_table(files["train"], columns=["task"]).column("task").to_pylist())
    recorded = planning_pool(load_pool(pool))
    k = max(len(action_set(recorded, t)) for t in tasks)
    print(f"{ds}: sweep on train ({k} candidate actions per query)", flush=True)
    r1, r2 = {}, {}
    with start_replay(pool, port=args.port):
        rollouts("sweep", {"sweep": True, "policy": "none"}, k, 0)
        if args.sweep_only:
            return {"dataset": ds, "sweep": log["rollouts"][-1]}
        learner = {"learner": args.learner, "features": FeatureSettings(group_by=args.group_by), "folds": args.folds}
        for kind, value in objectives:
            tag = f"{value:g}" if kind == "lambda" else f"{kind}{value:g}"  # a run id: no "+"
            if args.learner != "vw":  # its on-policy round is another run
                tag = f"{args.learner}-{tag}"
            if args.folds > 1:
                tag = f"{tag}-folds{args.folds}"
            how = {"lam" if kind == "lambda" else kind: value, **learner}
            r1[tag], s1 = train(TrainConfig(pool=pool, runs=["sweep"], data_dir=data, out=root / f"round1-{tag}",
                                            **how), pool=recorded)
            rid = f"onpolicy-{tag}"
            rollouts(rid, {"policy": str(r1[tag]), "candidates": "bandit", "explore": args.explore},
                     args.samples, 0)  # the README's figures' draws: --seed reached the planner only from stop 41
            r2[tag], s2 = train(TrainConfig(pool=pool, runs=["sweep", rid], data_dir=data,
                                            out=root / f"round2-{tag}", **how), pool=recorded)
            log["lambdas"][tag] = {"round1": str(r1[tag]), "round2": str(r2[tag]), "lambda": s1["lambda"],
                                   "floor": s1["floor"], "budget": s1["budget"], "floor_lambda": s1["floor_lambda"],
                                   "frontier": s1["frontier"], "selection_round1": s1["selection"],
                                   "selection_round2": s2["selection"], "train_s": s1["seconds"] + s2["seconds"]}
            print(f"  {objective(s1)}: frontier "
                  f"{sum(len(v) for v in s1['frontier'].values())} actions, ships "
                  f"{s1['selection']['shipped']} (round 2: {s2['selection']['shipped']})", flush=True)
    rep = evaluate(EvalConfig(pool=pool, queries=files["all"], split="test", out=work / "eval",
                              policies=list(r1.values()), targets=[Target.parse(t) for t in targets]))
    rep2 = evaluate(EvalConfig(pool=pool, queries=files["all"], split="test", out=work / "eval-round2",
                               planner=False, fixed=False, shipped_only=True, policies=list(r2.values())))
    best = rep.find("best_single", "grader")
    oracle = rep.find("oracle", "grader")
    planner = rep.find("planner")
    cascade = next((p for p in rep.policies if p.kind == "fixed_cascade"), None)
    top = max((p for p in rep.policies if p.kind == "single"), key=lambda p: p.accuracy or 0)

    def row(p) -> dict:
        d = {"name": p.name, "accuracy": p.accuracy, "se": p.se, "usd": p.usd_per_query,
             "cost_share": p.usd_per_query / best.usd_per_query, "calls": p.calls_per_query,
             "vs_best_single": paired(p, best)}
        if p.kind in ("learned", "fixed"):
            d.update({"lambda": p.info.get("lambda"), "floor": p.info.get("floor"), "budget": p.info.get("budget"),
                      "objective": objective(p.info)})
        return d

    rounds = []
    for tag in r1:
        one = next(p for p in rep.policies if p.info.get("artifact") == str(r1[tag]) and p.info.get("shipped"))
        two = next(p for p in rep2.policies if p.kind in ("learned", "fixed") and p.info.get("artifact") == str(r2[tag]))
        rounds.append({"tag": tag, "objective": objective(one.info), "round1": row(one), "round2": row(two),
                       "round2_minus_round1": paired(two, one)})
    out = {"dataset": ds, "objectives": [f"{k} {v:g}" for k, v in objectives], "log": log, "report": str(rep.report_path),
           "chart": str(rep.chart_path), "best_single": row(best), "oracle": row(oracle), "prior": row(planner),
           "fixed_cascade": row(cascade) if cascade else None, "top_single_on_test": row(top),
           "comparisons": rep.meta.get("comparisons"), "targets": rep.meta.get("targets"), "rounds": rounds,
           "policies": [row(p) | {"kind": p.kind, "shipped": p.info.get("shipped")}
                        for p in rep.policies if p.kind in ("learned", "fixed")]}
    if args.docs and rep.chart_path is not None and not rep.meta.get("chart_error"):  # never a placeholder
        dest = REPO / "docs" / "img" / f"policy_{ds}.png"
        shutil.copyfile(rep.chart_path, dest)
        out["docs_chart"] = str(dest)
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def summary_markdown(results: dict) -> str:
    def pm(pair):
        return "—" if not pair else f"{pair[0]:+.4f} ± {pair[1]:.4f}"

    def cell(r):
        return f"{r['accuracy']:.4f} ± {r['se']:.4f} at ${r['usd']:.6f} ({r['cost_share']:.0%})"

    out = []
    for ds, r in results.items():
        b = r["best_single"]
        out += [f"### {ds} (test split, our grader; best single chosen on train)", "",
                f"- best single: {b['name']}, {cell(b)}; most accurate single on test: "
                f"{r['top_single_on_test']['name']} {r['top_single_on_test']['accuracy']:.4f}",
                f"- oracle {cell(r['oracle'])}; prior planner {cell(r['prior'])}"
                + (f"; {r['fixed_cascade']['name']}: {cell(r['fixed_cascade'])}, vs best single "
                   f"{pm(r['fixed_cascade']['vs_best_single'])}" if r["fixed_cascade"] else ""), ""]
        out += ["| objective | policy | shipped | accuracy ± SE at USD (share of best single) | vs best single "
                "(paired) |", "|---|---|---|---|---:|"]
        for p in r["policies"]:
            out.append(f"| {p['objective']} | {p['kind']} | {'yes' if p['shipped'] else ''} | {cell(p)} | "
                       f"{pm(p['vs_best_single'])} |")
        out += ["", "| objective | shipped vs best fixed (reward, paired) | within one SE | round 2 − round 1 "
                    "(accuracy, paired) | round 2 |", "|---|---:|---|---:|---|"]
        by_key = {(c["lambda"], c.get("floor"), c.get("budget")): c for c in r["comparisons"] or []}
        for rd in r["rounds"]:
            c = by_key.get((rd["round1"]["lambda"], rd["round1"]["floor"], rd["round1"].get("budget")), {})
            out.append(f"| {rd['objective']} | {pm(c.get('shipped_vs_fixed'))} | "
                       f"{'yes' if c.get('within_one_se_of_fixed') else 'no'} | {pm(rd['round2_minus_round1'])} | "
                       f"{cell(rd['round2'])} |")
        out.append("")
        for t in r["targets"] or []:
            verdict = "met" if t.get("met") else "NOT MET"
            out.append(f"- target {t['name']}: **{verdict}**; "
                       f"{'meets it' if t.get('met') else 'closest'}: {t.get('policy')}, "
                       f"{t.get('accuracy', 0):.4f} at {t.get('cost_share', 0):.1%} of the cost "
                       f"(gap {t.get('accuracy_gap', 0):+.4f}; paired vs best single {pm(t.get('vs_best_single'))})")
        out += ["", f"({r['seconds']:.0f} s; report {r['report']})", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
