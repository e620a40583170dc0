"""Run the simulated server in a subprocess, for tests, benchmarks and the demo."""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

from conductor.localserver import ServerHandle, ServerStartError, start_server
from conductor.sim.config import FAULT_KEYS

READY = "conductor sim: listening on "  # printed by conductor.sim.main
FAULT_FLAGS = FAULT_KEYS
SimStartError = ServerStartError


class SimHandle(ServerHandle):
    name = "simulated server"

    def set_faults(self, model: str = "*", **faults: float | None) -> dict[str, Any]:
        """Override faults for one model or "*" (all); None removes an override."""
        return self._call("POST", "/admin/faults", {"model": model, **faults})

    def clear_faults(self) -> dict[str, Any]:
        """Back to the faults the server started with."""
        return self._call("POST", "/admin/faults", {"clear": True})

    def faults(self) -> dict[str, Any]:
        return self._call("GET", "/admin/faults")


def start_sim(pool_path: str | os.PathLike, queries: str | os.PathLike | Sequence[str | os.PathLike],
              port: int = 0, host: str = "127.0.0.1", *, seed: int = 0, env: dict[str, str] | None = None,
              require_key_env: str | None = None, startup_timeout_s: float = 30.0,
              **faults: float) -> SimHandle:
    """Start `python -m conductor.sim` and wait until it answers /health.

    `faults` are server-wide overrides (see FAULT_FLAGS); `env` adds variables to
    the server's environment (for example the key that `require_key_env` names).
    """
    unknown = sorted(set(faults) - set(FAULT_FLAGS))
    if unknown:
        raise TypeError(f"start_sim: unknown fault {unknown[0]!r} (allowed: {', '.join(FAULT_FLAGS)})")
    if isinstance(queries, (str, os.PathLike)):
        queries = [queries]
    cmd = [sys.executable, "-m", "conductor.sim", "--pool", os.fspath(pool_path),
           "--queries", *map(os.fspath, queries), "--host", host, "--port", str(port), "--seed", str(seed)]
    if require_key_env:
        cmd += ["--require-key-env", require_key_env]
    for k, v in faults.items():
        if v is not None:
            cmd += ["--" + k.replace("_", "-"), str(int(v)) if k == "fail_status" else repr(float(v))]
    return start_server(cmd, READY, SimHandle, host, env=env, startup_timeout_s=startup_timeout_s)
