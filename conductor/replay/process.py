"""Run the replay server in a subprocess, for tests, `conductor eval` and
`conductor policy rollouts --serve`."""

from __future__ import annotations

import os
import sys

from conductor.errors import ConductorError
from conductor.localserver import ServerHandle, start_server
from conductor.replay.main import READY


class ReplayHandle(ServerHandle):
    name = "replay server"


def start_replay(pool_path: str | os.PathLike, port: int = 0, host: str = "127.0.0.1", *,
                 startup_timeout_s: float = 60.0) -> ReplayHandle:
    """Start `python -m conductor.replay` for a replay pool and wait until it answers /health."""
    cmd = [sys.executable, "-m", "conductor.replay", "--pool", os.fspath(pool_path),
           "--host", host, "--port", str(port)]
    return start_server(cmd, READY, ReplayHandle, host, startup_timeout_s=startup_timeout_s)


def serve_pool(pool) -> ReplayHandle:
    """The replay server on the one loopback address (with an explicit port) that a replay
    pool's workers call; a pool calling anything else is refused, naming what it calls."""
    from urllib.parse import urlsplit

    from conductor.replay.tables import replay_workers

    if pool.replay is None:
        raise ConductorError("the pool is not a replay pool (it has no replay: block)")
    bases = {pool.worker(w).api_base for w in replay_workers(pool)}
    if len(bases) != 1:
        raise ConductorError(f"the pool's replay workers call {len(bases)} addresses; expected one")
    url = urlsplit(bases.pop())
    if url.hostname not in ("127.0.0.1", "localhost") or url.port is None:
        raise ConductorError(f"the pool's replay workers call {url.geturl()}; the replay server starts on "
                             f"loopback only, with an explicit port")
    try:
        return start_replay(pool.path, port=url.port, host=url.hostname)
    except ConductorError as e:
        raise ConductorError(f"{e} (is a replay server already listening there? then use it instead)") from None
