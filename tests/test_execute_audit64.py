"""Audit 64, F1 and F6: a step whose call never left is no call, and a shared governor
outage is said once, not once per attempt.

Real parts only: `conductor run` as a user starts it, a simulated LLM server over HTTP
that counts the requests it receives, and a real redis-server as the shared governor,
killed (and started again) while the run goes on. Every server here listens on
127.0.0.1, on a free port."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import REPO, SAMPLE, worker

GOVERNOR_LINE = re.compile(r"shared governor \S+ unreachable \(")
NOT_SENT_LINE = re.compile(r"^([0-9,]+) steps? failed on the shared governor \((?:none of them sent a request|it sent no request)\): it was unreachable;", re.M)

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def free_port() -> int:
    """A loopback port free now (a restarted redis-server must come back on the same one)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def start_redis():
    from conductor.errors import ConductorError
    from conductor.execute.shared.servers import RedisServer

    for _ in range(5):
        try:
            return RedisServer(port=free_port())
        except ConductorError:
            continue
    raise RuntimeError("redis-server did not start on any port tried")


@pytest.fixture
def fresh(fresh_sim):
    """The session's simulated server (tests/conftest.py), its log and faults cleared."""
    return fresh_sim


def queries(tmp_path: Path, n: int) -> Path:
    out = tmp_path / f"q{n}.parquet"
    pq.write_table(pq.read_table(SAMPLE).slice(0, n), out)
    return out


def pool_file(tmp_path: Path, url: str, provider: dict, governor: str | None = None, **params) -> Path:
    w = worker("slow", url)
    w["params"].update(params)
    doc = {"providers": {"sim": provider}, "workers": [w]}
    if governor:
        doc["governor"] = governor
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def start_run(tmp_path: Path, q: Path, pool: Path, run_id: str) -> subprocess.Popen:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    env.pop("CONDUCTOR_GOVERNOR", None)
    env.pop("CONDUCTOR_CACHE", None)
    return subprocess.Popen([sys.executable, "-m", "conductor", "run", str(q), "--pool", str(pool),
                             "--data-dir", str(tmp_path / "data"), "--run-id", run_id, "--quiet"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_requests(sim, p: subprocess.Popen, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while sim.log()["total"] < n and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sim.log()["total"] >= n, "the run sent too few requests before the governor was to stop"


def tables(tmp_path: Path, run_id: str) -> tuple[list[dict], list[dict]]:
    out = tmp_path / "data" / "runs" / run_id
    return pq.read_table(out / "traces.parquet").to_pylist(), pq.read_table(out / "results.parquet").to_pylist()


def summary_calls(stdout: str) -> int:
    m = re.search(r"^calls\s+([0-9,]+)\s+\(cache hits", stdout, re.M)
    assert m, stdout
    return int(m.group(1).replace(",", ""))


def not_sent_on_governor(t: dict) -> bool:
    return t["status"] == "error" and "shared governor" in (t["error"] or "") and "the call was not sent" in t["error"]


@needs_redis
def test_a_governor_outage_counts_only_the_requests_sent_and_is_said_once(tmp_path, fresh):
    """F1 + F6: the governor killed mid-run. `calls` (the CLI summary, results.calls,
    traces.attempts) is the number of requests the LLM server received, not the steps that
    tried; stderr says the outage once and the calls it kept back in one count, not one line
    per attempt; the closing summary's failure groups are as before."""
    server = start_redis()
    try:
        pool = pool_file(tmp_path, fresh.url, governor=server.url,
                         provider={"max_concurrency": 4, "timeout_s": 10, "max_attempts": 3,
                                   "rpm": 60000, "tpm": 100000000, "budget_usd": 5.0})
        p = start_run(tmp_path, queries(tmp_path, 60), pool, "outage")
        wait_for_requests(fresh, p, 8)
        server.kill()
        stdout, stderr = p.communicate(timeout=300)
    finally:
        server.stop()
    assert p.returncode == 4, stdout + stderr  # too many plans failed: rerun once the server is back
    received = fresh.log()["total"]
    traces, results = tables(tmp_path, "outage")
    unsent = [t for t in traces if not_sent_on_governor(t)]
    assert unsent, "the governor was killed mid-run: some calls must not have been sent"
    assert all(t["attempts"] == 0 for t in unsent), [t["attempts"] for t in unsent]
    assert sum(t["attempts"] for t in traces) == received
    assert sum(r["calls"] for r in results) == received
    assert summary_calls(stdout) == received  # the CLI printed `calls 120` for 65 requests

    both = stdout + stderr
    assert len(GOVERNOR_LINE.findall(stderr)) == 1, stderr  # the outage, once (was one line per attempt)
    assert stderr.count("charged in full") <= 1, stderr  # the reservations left unsettled: one line
    counts = NOT_SENT_LINE.findall(stderr)
    assert counts and int(counts[0].replace(",", "")) == len(unsent), stderr
    assert both.count("the call was not sent") <= 1, both  # only the summary's "e.g." keeps the message
    assert "failures by worker and kind:" in stdout and re.search(r"on the shared governor redis://\S+ \(no request sent to the provider\): governor, [0-9]+ plan\(s\)", stdout), stdout


@needs_redis
def test_a_governor_that_comes_back_mid_run_is_said_once_each_way(tmp_path, fresh):
    """F6: down, then back while the calls waiting on it still retry: one line when it goes,
    one when it answers again; and still no call counted that was not sent."""
    server = start_redis()
    try:
        pool = pool_file(tmp_path, fresh.url, governor=server.url,
                         provider={"max_concurrency": 4, "timeout_s": 10, "max_attempts": 12,
                                   "rpm": 60000, "tpm": 100000000})
        p = start_run(tmp_path, queries(tmp_path, 40), pool, "flap")
        wait_for_requests(fresh, p, 8)
        server.kill()
        time.sleep(1.5)
        server.start()  # the same port: the server is back
        stdout, stderr = p.communicate(timeout=300)
    finally:
        server.stop()
    received = fresh.log()["total"]
    traces, results = tables(tmp_path, "flap")
    # a step whose tries failed on the governor, then sent once it was back: 1 attempt, not its tries
    assert sum(t["attempts"] for t in traces) == received
    assert sum(r["calls"] for r in results) == received
    assert summary_calls(stdout) == received
    assert len(GOVERNOR_LINE.findall(stderr)) == 1, stderr
    assert len(re.findall(r"shared governor \S+ answers again after [0-9]+ s", stderr)) == 1, stderr
    assert "the call was not sent" not in stderr, stderr
    unsent = [t for t in traces if not_sent_on_governor(t)]
    counts = NOT_SENT_LINE.findall(stderr)
    assert (int(counts[0].replace(",", "")) if counts else 0) == len(unsent), stderr


def test_a_retry_refused_by_the_budget_still_counts_the_request_it_sent(tmp_path, fresh):
    """F1, the budget path: the first request is cut off by timeout_s (charged at its worst case,
    as it may be billed), and the retry no longer fits the budget. The request that was sent is
    a call: in traces.attempts, results.calls and the CLI's `calls`, as the server received it."""
    fresh.set_faults("slow", latency_ms=3000, latency_sd_ms=0)
    # worst case: max_tokens 1000 x $2/Mtok = $0.002, plus the prompt's bytes x $1/Mtok: one fits, two do not
    pool = pool_file(tmp_path, fresh.url, provider={"max_concurrency": 1, "timeout_s": 1, "budget_usd": 0.003},
                     max_tokens=1000)
    p = start_run(tmp_path, queries(tmp_path, 1), pool, "budget")
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 3, stdout + stderr  # stopped by the budget
    received = fresh.log()["total"]
    assert received == 1
    traces, results = tables(tmp_path, "budget")
    refused = [t for t in traces if t["status"] == "budget_exhausted"]
    assert len(refused) == 1 and refused[0]["attempts"] == 1, traces
    assert sum(r["calls"] for r in results) == 1
    assert summary_calls(stdout) == 1
