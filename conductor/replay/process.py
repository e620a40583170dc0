"""Run the replay server in a subprocess, for tests and `conductor eval`."""

from __future__ import annotations

import os
import sys

from conductor.localserver import ServerHandle, ServerStartError, start_server
from conductor.replay.main import READY

ReplayStartError = ServerStartError


class ReplayHandle(ServerHandle):
    name = "replay server"


def start_replay(pool_path: str | os.PathLike, port: int = 0, host: str = "127.0.0.1", *,
                 startup_timeout_s: float = 60.0) -> ReplayHandle:
    """Start `python -m conductor.replay` for a replay pool and wait until it answers /health."""
    cmd = [sys.executable, "-m", "conductor.replay", "--pool", os.fspath(pool_path),
           "--host", host, "--port", str(port)]
    return start_server(cmd, READY, ReplayHandle, host, startup_timeout_s=startup_timeout_s)
