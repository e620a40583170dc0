"""`make demo`: start the simulated pool on loopback, run the sample query set
through the whole pipeline, print the summary and a SQL query over the outputs,
and stop the server.

The run goes through `conductor run` itself, so the demo exits as it does (4 when
plans failed, 130 on Ctrl-C, 143 on SIGTERM) and prints its notes and failures:
a demo that printed accuracy 0.000 and exited 0 hid a broken pool (audit78 F1-F3)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from conductor import argtypes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conductor.demo")
    ap.add_argument("--queries", type=argtypes.path, default=Path("data/queries/sample.parquet"))
    ap.add_argument("--pool", type=argtypes.path, default=Path("data/pools/sim.yaml"))
    ap.add_argument("--data-dir", type=argtypes.path, default=Path("data"))
    ap.add_argument("--port", type=int, default=8911,
                    help="simulated server port; a fixed port keeps the pool, hence the run id and cache keys, "
                         "the same from one demo to the next (0: any free port)")
    args = ap.parse_args(argv)

    from conductor.localserver import ServerStartError
    from conductor.sim.process import start_sim

    try:
        sim = start_sim(args.pool, [args.queries], port=args.port)
    except ServerStartError as e:  # a message, not a traceback (audit63 F8)
        print(not_started(e, args.port), file=sys.stderr)
        return 1
    from conductor.cli import main as cli

    with sim:
        print(f"simulated pool serving on {sim.url}\n", flush=True)
        os.environ["CONDUCTOR_SIM_URL"] = sim.url  # the demo pool's api_base reads it
        code = cli(["run", str(args.queries), "--pool", str(args.pool), "--data-dir", str(args.data_dir)])
    if code not in (0, 3, 4):  # no run summary to query: bad input, a storage error, interrupted
        return code
    print("\nAccuracy and cost per task (conductor sql):")
    # the run just made or resumed: the most recently updated run of the demo's query set and pool
    shown = cli(["sql", "--data-dir", str(args.data_dir),
                 "SELECT task, count(*) AS plans, round(avg(correct::INT), 3) AS accuracy, "
                 "round(sum(cost_usd), 6) AS usd FROM rewards WHERE run_id = (SELECT run_id FROM runs "
                 f"WHERE (inputs->>'queries') = '{_sql_text(args.queries)}' "
                 f"AND (inputs->>'pool') = '{_sql_text(args.pool)}' ORDER BY updated_at DESC LIMIT 1) "
                 "GROUP BY ALL ORDER BY task"])
    return code or shown


def _sql_text(path: Path) -> str:
    return str(path.resolve()).replace("'", "''")


def not_started(e: Exception, port: int) -> str:
    """What to do when the simulated pool did not start; a port in use is the usual cause."""
    if "in use" not in str(e).lower():
        return f"demo: the simulated pool did not start: {e}"
    other = 8912 if port != 8912 else 8913
    return (f"demo: port {port} on 127.0.0.1 is already in use, so the simulated pool cannot listen there.\n"
            f"Most likely `make sim` is running (it serves the same pool on port 8911 by default), "
            f"or another process holds the port.\n"
            f"Stop it, or run the demo on another port: `make demo SIM_PORT={other}` "
            f"(or `python -m conductor.demo --port {other}`).\n"
            f"The run id depends on the port, so another port makes a new run: it does not resume "
            f"the one made on port {port}.")


if __name__ == "__main__":
    sys.exit(main())
