"""`conductor eval`: compare the embedded planner with every single worker, the best
single worker, the oracle and uniform random on a replay pool; write the report."""

from __future__ import annotations

import argparse
from pathlib import Path

from conductor.replay.tables import SPLITS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate policies on a replay pool: report (Markdown + chart)",
                       description="For every single worker, the best single worker, the per-question oracle, "
                                   "uniform random and the embedded planner (run through the pipeline against "
                                   "a replay server): accuracy, mean USD, calls and tokens per query. Writes "
                                   "report.md, chart.png and policies.json.")
    p.add_argument("--pool", type=Path, required=True, help="replay pool file (`conductor replay pool`)")
    p.add_argument("--queries", type=Path, required=True, help="query set (`conductor replay queries`)")
    p.add_argument("--split", choices=SPLITS, default="all",
                   help="evaluate on this split; with test, the best single worker is chosen on train")
    p.add_argument("--out", type=Path, default=None,
                   help="report folder (default: data/eval/<name>-<split>, the name the pool's replay: block gives)")
    p.add_argument("--no-planner", action="store_true", help="table policies only; do not run the planner")
    p.add_argument("--planner-limit", type=int, default=None, metavar="N",
                   help="run the planner on N of the queries (a fixed spread-out subset; default: all)")
    p.add_argument("--planner-option", action="append", default=[], metavar="KEY=VALUE",
                   help="embedded planner setting, repeatable (e.g. cost_weight=20)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from conductor.cli.run import parse_options
    from conductor.evaluation import EvalConfig, evaluate
    from conductor.evaluation.report import headline, policy_table

    report = evaluate(EvalConfig(
        pool=args.pool, queries=args.queries, split=args.split, out=args.out, planner=not args.no_planner,
        planner_limit=args.planner_limit, planner_options=parse_options(args.planner_option), seed=args.seed))
    m = report.meta
    agrees = (f"grader agrees with the labels on {m['agreement']:.1%} of {m['graded_rows']} rows"
              if m["agreement"] is not None else "no reference: accuracy from the recorded labels only")
    tasks = ", ".join(f"{t} {k}" for t, k in m["tasks"].items())
    print(f"{m['dataset']}, split {m['split']}: {m['queries']} queries, {m['workers']} workers "
          f"(tasks: {tasks}; {agrees}; recorded cost_usd on {m['recorded_cost_rows']} of {m['rows']} rows)\n")
    print(policy_table(headline(report.policies)))
    print(f"\nreport {report.report_path}\nchart  {report.chart_path}\ndata   {report.json_path}")
    return 0
