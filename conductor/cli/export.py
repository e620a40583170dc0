"""`conductor export`: a run's rollouts as training data for TRL or verl (Parquet + JSONL)."""

from __future__ import annotations

import argparse
from pathlib import Path

from conductor import argtypes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a run's rollouts for RL trainers (TRL GRPO, verl)",
                       description="Write DIR/train.parquet and DIR/train.jsonl (the same rows) and DIR/export.json: "
                                   "per plan the planner prompt (chat messages), the plan as the completion, "
                                   "reward, group advantage, log-probability or propensity, and cost. trl: one row "
                                   "per plan (prompt, completion, reward); verl: one row per query (data_source, "
                                   "prompt, ability, reward_model, extra_info) with the K rollouts as lists. "
                                   "A sweep's unused slots are left out. export.json is written last: a folder "
                                   "without it holds an incomplete export.")
    p.add_argument("--run", required=True, metavar="RUN_ID", help="the run to export")
    p.add_argument("--data-dir", type=argtypes.path, default=Path("data"), help="where the runs live (default data)")
    p.add_argument("--format", choices=("trl", "verl"), required=True)
    p.add_argument("--out", type=argtypes.path, required=True, metavar="DIR", help="folder to write")
    p.add_argument("--pool", type=argtypes.path, default=None,
                   help="pool file whose workers the prompt lists (default: the run's own pool file)")
    p.add_argument("--cost-penalty", type=float, default=None, metavar="LAMBDA",
                   help="recompute rewards as 1 / 0.5 / 0 minus LAMBDA x USD, and the advantages with them "
                        "(default: the run's rewards as graded)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from conductor.export import export_run

    e = export_run(args.data_dir, args.run, args.format, args.out, pool_path=args.pool, cost_penalty=args.cost_penalty)
    left_out = f"; {e.unused} unused sweep slots left out" if e.unused else ""
    print(f"{args.format}: {e.rows} rows ({e.plans} plans{left_out})\n  {e.parquet}\n  {e.jsonl}\n  {e.meta}")
    return 0
