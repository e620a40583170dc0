"""`make demo` with its port taken (audit63 F8): `make sim`, which the README lists beside it,
holds the same port 8911, and the demo ended in a Python traceback. It now says which port,
the likely cause and the fix, and exits non-zero having written nothing."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO, SAMPLE

@contextlib.contextmanager
def _held_by_a_socket():
    """Another process's listener, as far as the demo can tell."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


@contextlib.contextmanager
def _held_by_make_sim():
    """What `make sim` runs: the simulated pool, serving the demo's pool."""
    from conductor.sim import start_sim

    with start_sim(REPO / "data" / "pools" / "sim.yaml", [SAMPLE], port=0) as sim:
        yield int(sim.url.rsplit(":", 1)[1].split("/")[0])


@pytest.mark.parametrize("holder", [_held_by_make_sim, _held_by_a_socket], ids=["make sim", "another process"])
def test_demo_on_a_taken_port_says_what_to_do_without_a_traceback(tmp_path, holder):
    with holder() as port:
        r = subprocess.run([sys.executable, "-m", "conductor.demo", "--port", str(port),
                            "--data-dir", str(tmp_path / "data")],
                           cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr, r.stderr
    assert "`make sim` is running" in r.stderr and "another process" in r.stderr, r.stderr
    assert "make demo SIM_PORT=8912" in r.stderr and "new run" in r.stderr, r.stderr
    assert not (tmp_path / "data").exists()  # nothing begun
