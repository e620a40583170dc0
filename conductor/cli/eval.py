"""`conductor eval`: compare the embedded planner with every single worker, the best
single worker, the oracle and uniform random on a replay pool; write the report."""

from __future__ import annotations

import argparse

from conductor import argtypes
from conductor.cli import options
from conductor.replay.datasets import SPLITS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate policies on a replay pool: report (Markdown + chart)",
                       description="For every single worker, the best single worker, the per-question oracle, "
                                   "uniform random and the embedded planner (run through the pipeline against "
                                   "a replay server): accuracy, mean USD, calls and tokens per query. Writes "
                                   "report.md, chart.png and policies.json.")
    options.pool(p, "replay pool file (`conductor replay pool`)")
    p.add_argument("--queries", type=argtypes.path, required=True, help="query set (`conductor replay queries`)")
    p.add_argument("--split", choices=SPLITS, default="all",
                   help="evaluate on this split; with test, the best single worker is chosen on train")
    options.report_out(p, "report folder (default: data/eval/<name>-<split>, the name the pool's replay: block gives)")
    p.add_argument("--no-planner", action="store_true", help="table policies only; do not run the planner")
    options.planner_limit(p, "run the planner on N of the queries (a fixed spread-out subset; default: all)")
    p.add_argument("--planner-option", action="append", default=[], metavar="KEY=VALUE",
                   help="embedded planner setting, repeatable (e.g. cost_weight=20)")
    options.seed(p)
    p.set_defaults(func=main, resumes=False)  # its planner runs start over


def main(args: argparse.Namespace) -> int:
    from conductor.cli.render import eval_report
    from conductor.evaluation import EvalConfig, evaluate

    report = evaluate(EvalConfig(
        pool=args.pool, queries=args.queries, split=args.split, out=args.out, planner=not args.no_planner,
        planner_limit=args.planner_limit, planner_options=options.parse_options(args.planner_option),
        seed=args.seed))
    print(eval_report(report))
    print_notes(report.meta)
    return 0


def print_notes(meta: dict) -> None:
    """What the figures above rest on that the table does not show (also in report.md)."""
    from conductor.evaluation.report import prompt_cut_text

    cut = prompt_cut_text(meta)
    if cut:
        print(f"note: {cut}")
