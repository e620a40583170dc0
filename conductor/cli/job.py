"""`conductor job`: enrichment jobs (check a job file, write its query set, run it)."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from conductor import argtypes
from conductor.cli import options
from conductor.errors import ConductorError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("job", help="enrichment jobs: typed records per input row, incremental",
                       description="Run an enrichment job file (YAML): each new or changed input row "
                                   "becomes one typed record in DATA_DIR/runs/RUN_ID/records.parquet, and "
                                   "the catalog view named after the job holds the newest record per id.")
    jsub = p.add_subparsers(dest="job_command", metavar="ACTION", required=True)
    r = jsub.add_parser("run", help="run a job: only new or changed rows call a provider",
                        description="Exit status: 0 done, 2 bad input, 3 stopped by a budget, rows or the judge (rerun to finish), "
                                    "4 valid share below the job's quality.min_valid_share, 5 a storage error (free "
                                    "space and rerun), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM): rerun to resume.")
    r.add_argument("job", type=argtypes.path, help="job file (YAML)")
    options.data_dir(r)
    r.add_argument("--run-id", type=argtypes.run_id, help="name of the run (default: <job>-<UTC time>)")
    r.add_argument("--full-refresh", action="store_true",
                   help="recompute every row, reusing no record and bypassing the response cache: every row "
                        "is sent and paid for again")
    r.add_argument("--keep-work", action="store_true",
                   help="keep the run's work/ folder (its journal) once the records are written; by default it "
                        "is removed, as no later run reads it")
    options.quiet(r)
    r.set_defaults(func=run)
    c = jsub.add_parser("check", help="validate a job file, its input and the prompts' lengths; makes no call")
    c.add_argument("job", type=argtypes.path)
    c.set_defaults(func=check)
    q = jsub.add_parser("queries", help="write the query set the job sends (query_id, prompt, task, reference)")
    q.add_argument("job", type=argtypes.path)
    q.add_argument("--out", type=argtypes.path, required=True, help="Parquet file to write")
    q.set_defaults(func=queries)


def check(args: argparse.Namespace) -> int:
    from conductor.enrich import load_job
    from conductor.enrich.context import check_budget, check_context
    from conductor.enrich.table import load_rows, render
    from conductor.pool import load_pool

    job = load_job(args.job)
    rows = load_rows(job)
    pool, ids, prompts = load_pool(job.pool_path), rows.get_column(job.id_column).to_list(), render(job, rows)
    check_context(job, pool, ids, prompts)
    check_budget(job, pool, ids, prompts)
    kind = f"{len(job.fields)} field(s)" if job.fields else "plain text"
    print(f"job {job.name}: ok ({rows.height} rows, {kind}, {job.mode} mode)")
    return 0


def queries(args: argparse.Namespace) -> int:
    from conductor.enrich import load_job, render_queries
    from conductor.store import write_table

    _check_out(args.out)
    job = load_job(args.job)
    table = render_queries(job)
    try:
        write_table(args.out, table)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
            raise  # a full or failing disk: the CLI's own message and exit 5
        why = os.strerror(e.errno) if e.errno else str(e)  # pyarrow's strerror names its temporary file
        raise ConductorError(f"--out {args.out}: cannot write it ({why}); give a file in a folder you can "
                             f"write to") from None
    print(f"wrote {table.num_rows} queries to {args.out}")
    return 0


def _check_out(out: Path) -> None:
    """The query set is Parquet, the only format `conductor run` reads: `q.csv` would be Parquet
    under a CSV name. A folder is named, not an IsADirectoryError."""
    if out.is_dir():
        raise ConductorError(f"--out {out}: is a folder; give a file name (e.g. {out / 'queries.parquet'})")
    if out.suffix.lower() != ".parquet":
        raise ConductorError(f"--out {out}: the query set is written as Parquet; give a .parquet name "
                             f"(e.g. {out.with_suffix('.parquet')})")


def run(args: argparse.Namespace) -> int:
    from conductor.enrich import load_job
    from conductor.cli.render import job_summary
    from conductor.enrich.run import run_job

    job = load_job(args.job)
    summary = run_job(job, data_dir=args.data_dir, run_id=args.run_id, full_refresh=args.full_refresh,
                      progress=not args.quiet, keep_work=args.keep_work)
    print(job_summary(summary))
    code = summary["exit_code"]
    if summary["statuses"].get("budget_exhausted"):
        print(f"\nconductor: {summary['statuses']['budget_exhausted']} row(s) stopped by a budget. Raise it (job "
              f"file budget_usd or the pool file) and rerun: finished rows are kept and only those are sent.",
              file=sys.stderr)
    elif summary.get("judge_budget_exhausted"):
        print(f"\nconductor: {summary['judge_budget_exhausted']} record(s) left unjudged by the budget, or not yet "
              f"rescored under a changed judge (the judge spends what the job's budget_usd leaves after "
              f"extraction). "
              f"Raise it and rerun: the rerun judges them.", file=sys.stderr)
    elif code == 4:
        share, floor = summary["metrics"]["valid_share"], job.quality["min_valid_share"]
        print(f"\nconductor: only {share:.1%} of rows have a valid record, below the job's "
              f"quality.min_valid_share {floor:.1%}; see the statuses and errors in the records", file=sys.stderr)
    return code
