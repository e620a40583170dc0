"""`make demo`: start the simulated pool on loopback, run the sample query set
through the whole pipeline, print the summary and a SQL query over the outputs,
and stop the server."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from conductor import argtypes
from conductor.cli.render import run_summary
from conductor.runner import RunConfig, run_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conductor.demo")
    ap.add_argument("--queries", type=argtypes.path, default=Path("data/queries/sample.parquet"))
    ap.add_argument("--pool", type=argtypes.path, default=Path("data/pools/sim.yaml"))
    ap.add_argument("--data-dir", type=argtypes.path, default=Path("data"))
    ap.add_argument("--port", type=int, default=8911,
                    help="simulated server port; a fixed port keeps the pool, hence the run id and cache keys, "
                         "the same from one demo to the next (0: any free port)")
    args = ap.parse_args(argv)

    from conductor.sim.process import start_sim

    with start_sim(args.pool, [args.queries], port=args.port) as sim:
        print(f"simulated pool serving on {sim.url}", flush=True)
        os.environ["CONDUCTOR_SIM_URL"] = sim.url  # the demo pool's api_base reads it
        summary = run_all(RunConfig(queries=args.queries, pool=args.pool, data_dir=args.data_dir))
    print()
    print(run_summary(summary))
    print("\nAccuracy and cost per task (conductor sql):")
    from conductor.cli import main as cli

    return cli(["sql", "--data-dir", str(args.data_dir),
                "SELECT task, count(*) AS plans, round(avg(correct::INT), 3) AS accuracy, "
                "round(sum(cost_usd), 6) AS usd FROM rewards "
                f"WHERE run_id = '{summary['run_id']}' GROUP BY ALL ORDER BY task"])


if __name__ == "__main__":
    sys.exit(main())
