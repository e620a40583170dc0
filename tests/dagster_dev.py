"""`dagster dev` as a user starts it, for the tests that need the real UI server and
daemon: on a free loopback port, in its own process group (so a test can stop it, or
kill it as a crash would), and the GraphQL calls that tell when its code location is up."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.conftest import REPO

LOCATION = "pipelines.definitions"  # the code location's name, from workspace.yaml
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def graphql(port: int, query: str) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": query}).encode(),
                                 headers={"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=10) as r:
        return json.loads(r.read())


def location_loaded(port: int) -> bool:
    try:
        data = graphql(port, "{ workspaceOrError { __typename ... on Workspace { locationEntries { name "
                             "loadStatus locationOrLoadError { __typename ... on PythonError { message } } } } } }")
    except OSError:
        return False
    entries = data["data"]["workspaceOrError"].get("locationEntries") or []
    for e in entries:
        if e["locationOrLoadError"] and e["locationOrLoadError"]["__typename"] == "PythonError":
            raise AssertionError(f"code location failed to load: {e['locationOrLoadError']['message']}")
    return any(e["name"] == LOCATION and e["loadStatus"] == "LOADED"
               and e["locationOrLoadError"]["__typename"] == "RepositoryLocation" for e in entries)


def _default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def start(env: dict, port: int, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dagster", "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=_default_signals)


def wait_loaded(port: int, log_path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not location_loaded(port):
        assert time.monotonic() < deadline, f"code location not loaded; see {log_path}"
        time.sleep(1)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop `dagster dev` and everything it started (SIGKILL: as a crash would)."""
    try:
        os.killpg(proc.pid, sig)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def kill_every_process_of(home: Path, timeout: float = 30) -> None:
    """SIGKILL every process whose environment names this DAGSTER_HOME, and wait until they are gone:
    a crash or a reboot ends a run's worker too, even one `killpg` of `dagster dev` missed (in a
    fresh clone beside a busy core, the cut-off run once went on to succeed after the kill)."""
    from tests.procs import environ, processes

    marker = f"DAGSTER_HOME={home}".encode()
    deadline = time.monotonic() + timeout
    while True:
        found = [p.pid for p in processes() if p.pid != os.getpid() and marker in environ(p.pid)]
        if not found:
            return
        for p in found:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert time.monotonic() < deadline, f"processes of {home} outlived SIGKILL: {found}"
        time.sleep(0.2)
