"""Command line of the simulated server, shared by `conductor sim` and
`python -m conductor.sim` (which `start_sim` runs without loading other commands)."""

from __future__ import annotations

import argparse
import sys

from conductor.argtypes import PORT, SEED
from conductor.errors import ConductorError
from conductor.sim.config import FAULT_KEYS, SimConfigError, check_fault, read_keys, served_models

READY = "conductor sim: listening on "
_FAULT_HELP = {
    "rpm": "requests per minute per model (sliding window); above it 429",
    "rpm_window_s": "length of the rpm window in seconds (default 60; shorter for tests)",
    "error_rate": "fraction of requests answered 500/502/503",
    "rate_limit_rate": "fraction of requests answered 429 with Retry-After 1",
    "hang_rate": "fraction of requests that sleep --hang-s before answering",
    "hang_s": "seconds a hanging request sleeps (default 30)",
    "drop_rate": "fraction of requests whose connection is closed without a response",
    "latency_ms": "mean latency in ms (lognormal; default from the pool, else 20)",
    "latency_sd_ms": "latency standard deviation in ms",
    "per_token_ms": "extra latency per completion token in ms",
    "fail_status": "answer every request with this HTTP error status (400-599)",
    "retry_after_ms": "the wait that --rate-limit-rate's 429s ask for (default 1000)",
    "refusal_rate": "fraction of requests answered 200 with content null and a refusal (billed, as a content filter)",
    "malformed_json": "fraction of structured (JSON record) replies broken: unparseable or schema-invalid",
    "usage_factor": "reported usage = billed tokens x this (negative or huge to test usage lies; default 1)",
    "batch_expire": "fraction of each batch's lines left undone; the batch then ends 'expired'",
    "batch_line_error_rate": "fraction of batch lines answered 500 in the batch's error file",
    "batch_fail_rate": "fraction of batches that fail validation (status 'failed', no line done)",
    "batch_delay_s": "seconds from batch submission to completion (default 0: done at the first poll)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool", required=True, help="pool YAML; its openai/<name> llm and planner workers are served")
    p.add_argument("--queries", required=True, nargs="+", metavar="PATH",
                   help="query-set Parquet files or folders of them (the questions the sim can answer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=PORT, default=8911, help="0 picks a free port")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--allow-remote", action="store_true", help="allow a host other than loopback")
    p.add_argument("--require-key-env", metavar="NAME",
                   help="demand the key held by env var NAME for every model without its own")
    g = p.add_argument_group("faults (override the pool's simulate settings for every model)")
    for key in FAULT_KEYS:
        g.add_argument("--" + key.replace("_", "-"), dest=key, type=int if key == "fail_status" else float,
                       default=None, help=_FAULT_HELP[key])


def run(args: argparse.Namespace) -> int:
    import asyncio

    from conductor.localserver import is_loopback, serve
    from conductor.pool import load_pool
    from conductor.sim.index import load_index
    from conductor.sim.server import SimServer, build_app

    if not args.allow_remote and not is_loopback(args.host):
        raise ConductorError(f"--host {args.host}: the simulated pool binds loopback only; "
                             "pass --allow-remote to serve other hosts")
    pool = load_pool(args.pool)
    try:
        models = served_models(pool)
    except SimConfigError as e:  # which file to fix: the message alone names only workers
        raise SimConfigError(f"pool file {args.pool}: {e}") from None
    index = load_index(args.queries)
    overrides = {k: check_fault(k, getattr(args, k), "--" + k.replace("_", "-"))
                 for k in FAULT_KEYS if getattr(args, k) is not None}
    keys = read_keys(models, args.require_key_env)
    server = SimServer(models, index, seed=args.seed, overrides={"*": overrides} if overrides else None, keys=keys)
    try:
        import uvloop  # optional: faster event loop when installed
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    banner = [f"  model {name} (worker {spec.worker_id}){'  [key required]' if server.requires_key(name) else ''}"
              for name, spec in server.models.items()]
    banner.append(f"  {len(index)} known questions; Ctrl-C stops")
    runner(serve(build_app(server), args.host, args.port, READY, banner))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conductor.sim", description="Run the simulated worker pool.")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except (ConductorError, SimConfigError) as e:
        print(f"conductor sim: error: {e}", file=sys.stderr)
        return 2
