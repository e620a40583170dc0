"""Batch mode under a budget with a shared governor that goes away mid-run: the calls a
user is shown (the CLI's `calls`, results.calls, traces.attempts) are the requests the
provider received, batch lines and online retries alike.

The first stage's batch is reserved and submitted (two workers: a batch each, and
solve-then-check plans), then the governor (a real redis-server) is killed while it runs. Its lines answered 500 are retried (online
or in a new batch), and that retry's reservation cannot reach the governor: those steps
sent one request. The plans' next steps never leave. Every server listens on 127.0.0.1."""

from __future__ import annotations

import logging
import re
import shutil
import socket
import threading
import time
from functools import partial
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import SAMPLE, cli, worker

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

# the closing line: the steps the outage failed, and how many of them sent no request
GOVERNOR_FAILED_LINE = re.compile(r"^([0-9,]+) steps? failed on the shared governor \(([^)]*)\): it was unreachable;",
                                  re.M)


def start_redis():
    from conductor.errors import ConductorError
    from conductor.execute.shared.servers import RedisServer

    for _ in range(5):
        with socket.create_server(("127.0.0.1", 0)) as s:
            port = s.getsockname()[1]
        try:
            return RedisServer(port=port)
        except ConductorError:
            continue
    raise RuntimeError("redis-server did not start on any port tried")


def received(log: dict) -> int:
    """Requests the simulated provider received: online ones and batch lines (answered or not)."""
    return log["total"] + sum(log["batch_lines"].values())


def summary_calls(stdout: str) -> int:
    m = re.search(r"^calls\s+([0-9,]+)\s+\(cache hits", stdout, re.M)
    assert m, stdout
    return int(m.group(1).replace(",", ""))


def kept_back(t: dict) -> bool:
    """A step whose last try was not sent because the shared governor could not be reached."""
    return t["status"] == "error" and "shared governor" in (t["error"] or "") and "the call was not sent" in t["error"]


@pytest.mark.parametrize("retry", ["online", "batch"])
def test_batch_calls_are_the_requests_sent_when_the_governor_goes_away(tmp_path, fresh_sim, retry, monkeypatch,
                                                                       caplog):
    import conductor.runner
    from conductor.execute.engine import ExecOptions

    # The run goes through the CLI's entry function in this process (no interpreter to start), and
    # the steps the governor keeps back give up after 5 s of outage, not the default 30: either
    # way every one of them ends failed on the governor, which is what is counted below.
    caplog.set_level(logging.WARNING, logger="conductor.governor")
    monkeypatch.setattr(conductor.runner, "ExecOptions", partial(ExecOptions, governor_wait_s=5.0))
    monkeypatch.delenv("CONDUCTOR_GOVERNOR", raising=False)
    fresh_sim.set_faults(batch_delay_s=3.0, batch_line_error_rate=0.5)
    queries = tmp_path / "q.parquet"
    pq.write_table(pq.read_table(SAMPLE).slice(0, 20), queries)
    server = start_redis()
    try:
        pool = tmp_path / "pool.yaml"
        pool.write_text(yaml.safe_dump({"governor": server.url, "providers": {"sim": {
            "max_concurrency": 8, "timeout_s": 10, "max_attempts": 3, "budget_usd": 5.0, "mode": "batch",
            "batch_poll_s": 0.2, "batch_collect_s": 0.3, "batch_retry": retry}},
            "workers": [worker(n, fresh_sim.url) for n in ("fast", "weak")]}, sort_keys=False))

        ended = threading.Event()

        def kill_once_submitted():
            while fresh_sim.log()["batches_created"] < 1 and not ended.is_set():
                time.sleep(0.02)
            server.kill()  # while that batch runs (batch_delay_s)

        killer = threading.Thread(target=kill_once_submitted, daemon=True)
        killer.start()
        r = cli("run", queries, "--pool", pool, "--data-dir", tmp_path / "data", "--run-id", "gone", "--quiet",
                "--no-cache")
        ended.set()
        killer.join(timeout=30)
        # the governor's lines are logged (a process without logging set up prints them on stderr)
        stdout, stderr = r.stdout, r.stderr + "".join(f"{m}\n" for m in caplog.messages)
        assert fresh_sim.log()["batches_created"] >= 1, "the first stage's batches were not submitted"
    finally:
        server.stop()
    assert r.returncode != 0, stdout + stderr  # plans failed on the governor: rerun once it is back
    sent = received(fresh_sim.log())
    out = tmp_path / "data" / "runs" / "gone"
    traces = pq.read_table(out / "traces.parquet").to_pylist()
    results = pq.read_table(out / "results.parquet").to_pylist()
    assert sum(t["attempts"] for t in traces) == sent, [(t["status"], t["attempts"], t["error"]) for t in traces]
    assert sum(r["calls"] for r in results) == sent
    assert summary_calls(stdout) == sent

    # What the run went through: steps sent once, then kept back; steps never sent.
    kept = [t for t in traces if kept_back(t)]
    assert any(t["attempts"] == 1 for t in kept), "no line answered 500 was retried while the governor was down"
    assert any(t["attempts"] == 0 for t in kept), "no later step was kept back by the governor"
    # the closing line counts them apart: it said "20 calls not sent" for 10 steps that each sent a request
    never = sum(t["attempts"] == 0 for t in kept)
    assert GOVERNOR_FAILED_LINE.findall(stderr) == [
        (f"{len(kept):,}", f"{never:,} of them sent no request; the other {len(kept) - never:,} had sent one "
                           f"before a retry was held back")], stderr
