"""Command line of the replay server, shared by `conductor replay serve` and
`python -m conductor.replay` (which `start_replay` runs without loading other commands)."""

from __future__ import annotations

import argparse
import sys

from conductor.argtypes import PORT
from conductor.errors import ConductorError

READY = "conductor replay: listening on "
DEFAULT_PORT = 8912


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool", required=True, help="replay pool file (written by `conductor replay pool`)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=PORT, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0 picks a free port")
    p.add_argument("--allow-remote", action="store_true", help="allow a host other than loopback")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from conductor.localserver import is_loopback, serve
    from conductor.pool import load_pool
    from conductor.replay.server import build_app, load_server

    if not args.allow_remote and not is_loopback(args.host):
        raise ConductorError(f"--host {args.host}: the replay server binds loopback only; "
                             "pass --allow-remote to serve other hosts")
    pool = load_pool(args.pool)
    server = load_server(pool)
    idx = server.index
    banner = [f"  {server.name}: {len(idx.models)} models, {len(idx.question_ids)} questions, "
              f"{len(idx.responses)} recorded responses; Ctrl-C stops"]
    if "fingerprint" not in pool.replay:  # written before pools recorded their table's
        banner.append(f"  note: {args.pool} records no fingerprint of its table (written before pools did), so a "
                      f"change to the table since is not noticed; rewrite it with `conductor replay pool` to have "
                      f"it checked")
    asyncio.run(serve(build_app(server), args.host, args.port, READY, banner))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conductor.replay",
                                description="Serve recorded model responses over an OpenAI-compatible API.")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ConductorError as e:
        print(f"conductor replay: error: {e}", file=sys.stderr)
        return 2
