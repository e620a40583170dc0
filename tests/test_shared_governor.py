"""The shared governor and response cache on a real redis-server (127.0.0.1, a free
port), used by separate worker processes as separate machines would use it."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.errors import PoolError
from conductor.pool import Provider, parse_pool
from tests.conftest import REPO, cli, worker, write_pool
from tests.test_executor import FixedPlanner, solve

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make setup-test installs Debian's)")


def listen() -> "socket.socket":
    """A listening socket on 127.0.0.1, on a port the OS chose."""
    import socket

    return socket.create_server(("127.0.0.1", 0))


def free_port() -> int:
    """A port nothing listens on now, for a server to take."""
    with listen() as s:
        return s.getsockname()[1]


def start_redis(password: str | None = None):
    """A RedisServer on a free port; another one if another process took that one first."""
    from conductor.errors import ConductorError
    from conductor.execute.shared.servers import RedisServer

    for _ in range(5):
        try:
            return RedisServer(password=password, port=free_port())
        except ConductorError:
            continue
    raise RuntimeError("redis-server did not start on any port tried")


@pytest.fixture
def redis_server():
    with start_redis() as server:
        yield server


def run_workers(sim, tmp_path: Path, governor: str, counts: list[tuple[int, int]], **spec) -> list[dict]:
    """bench/scale.py's worker, one process per (offset, n), each with its own data folder."""
    procs = []
    for k, (offset, n) in enumerate(counts):
        s = {"url": sim.url, "concurrency": 8, "governor": governor, "n": n, "offset": offset,
             "run_id": f"w{k}-{offset}", "data_dir": str(tmp_path / f"machine{k}-{offset}"), **spec}
        tmp_path.mkdir(parents=True, exist_ok=True)
        path = tmp_path / f"spec{k}-{offset}.json"
        path.write_bytes(orjson.dumps(s))
        procs.append(subprocess.Popen([sys.executable, str(REPO / "bench" / "scale.py"), "worker", str(path)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
        outs.append(orjson.loads(out.splitlines()[-1]))
    return outs


@pytest.fixture
def bench_sim(tmp_path_factory):
    """A server answering the benchmark's model, whose requests the test counts."""
    import pyarrow as pa

    from conductor.sim import start_sim

    d = tmp_path_factory.mktemp("benchsim")
    (d / "pool.yaml").write_text(yaml.safe_dump({"workers": [
        {"id": "bench", "model": "openai/bench", "simulate": {"latency_ms": {"mean": 5, "sd": 1}}}]}))
    pq.write_table(pa.table({"query_id": ["b0"], "prompt": ["x"], "task": ["math"], "reference": ["1"]}),
                   d / "q.parquet")
    with start_sim(d / "pool.yaml", d / "q.parquet") as sim:
        yield sim


@pytest.mark.slow
def test_two_processes_together_keep_to_one_rate_limit(tmp_path, bench_sim, redis_server):
    rpm = 600  # 10 per second for the two together: alone, each would go at this rate
    run_workers(bench_sim, tmp_path, redis_server.url, [(0, 30), (30, 30)], rpm=rpm)
    log = bench_sim.log()
    assert log["by_status"] == {"200": 60}
    times = sorted(log["accepted_times"]["bench"])
    burst = max(1, rpm // 100)
    per_s = (rpm - burst) / 61.0
    # Arrival times at the server: any stretch of calls fits in the burst plus the paced
    # rate, with 1.5 s for the jitter between release and arrival. Two in-process
    # governors would send twice as fast (about 3 s for the 60 calls instead of 6).
    for i in range(len(times)):
        for j in range(i + 1, len(times)):
            assert j - i + 1 <= burst + per_s * (times[j] - times[i] + 1.5), (i, j, times[j] - times[i])


@pytest.mark.slow
def test_a_shared_budget_is_never_exceeded_across_processes(tmp_path, bench_sim, redis_server):
    budget = 0.01  # about 17 worst-case reservations; the calls cost far less, so it runs out mid-run
    outs = run_workers(bench_sim, tmp_path, redis_server.url, [(0, 150), (150, 150)], budget=budget)
    log = bench_sim.log()
    prompt_tokens, completion_tokens = log["billed_tokens"]["bench"]
    spend = prompt_tokens * 1e-6 + completion_tokens * 2e-6  # the bench pool's prices
    assert spend <= budget
    statuses = [o["statuses"] for o in outs]
    assert sum(s.get("budget_exhausted", 0) for s in statuses) > 0, statuses
    assert all(s.get("ok", 0) > 0 for s in statuses), statuses  # both drew on it, not only the first


def test_a_second_identical_job_on_another_process_is_served_from_the_shared_cache(tmp_path, bench_sim,
                                                                                   redis_server):
    run_workers(bench_sim, tmp_path / "first", redis_server.url, [(0, 40)])
    assert bench_sim.log()["total"] == 40
    bench_sim.reset()
    (tmp_path / "second").mkdir()
    out = run_workers(bench_sim, tmp_path / "second", redis_server.url, [(0, 40)])[0]
    assert bench_sim.log()["total"] == 0
    assert out["statuses"] == {"ok": 40} and out["cache_hits"] == 40


def test_one_retry_after_pauses_every_process(redis_server):
    from conductor.execute.shared.governor import RedisGovernor, SharedLimiter

    async def go():
        told, other = RedisGovernor(redis_server.url), RedisGovernor(redis_server.url)  # two clients
        provider = Provider("p", rpm=6000)
        a, b = SharedLimiter(told, provider), SharedLimiter(other, provider)
        async with a.slot(1):
            a.pause(1.5)  # as the executor does on a 429 with Retry-After: 1.5
        await asyncio.sleep(0.2)
        t = time.monotonic()
        async with b.slot(1):
            waited = time.monotonic() - t
        await told.close()
        await other.close()
        return waited

    assert asyncio.run(go()) >= 1.0


def test_a_reservation_of_a_killed_process_is_charged_in_full_when_its_lease_ends(redis_server):
    from conductor.execute.budget import BudgetExhausted
    from conductor.execute.shared.governor import RedisGovernor, SharedLedger

    async def go():
        provider = Provider("p", budget_usd=1.0, timeout_s=0.1, max_attempts=1)
        dead = SharedLedger(RedisGovernor(redis_server.url), {"p": provider}, None)
        dead._lease["p"] = 0.3  # the process holding it dies before settling
        await dead.reserve("p", 0.7)
        alive = SharedLedger(RedisGovernor(redis_server.url), {"p": provider}, None)
        await asyncio.sleep(0.5)
        with pytest.raises(BudgetExhausted):  # 0.7 counted as spent: 0.4 more can never fit
            await alive.reserve("p", 0.4)
        r = await alive.reserve("p", 0.2)
        await alive.settle(r, 0.05)
        spent, reserved = await alive.shared_spend("p")
        assert (round(spent, 6), round(reserved, 6)) == (0.75, 0.0)

    asyncio.run(go())


def test_a_reservation_kept_waiting_says_why(redis_server, caplog):
    """Near the cap, a killed process's reservation holds the room until its lease ends
    (minutes): the survivors waited without a word, like a hang."""
    from conductor.execute.shared.governor import RedisGovernor, SharedLedger

    async def go():
        provider = Provider("p", budget_usd=1.0, timeout_s=0.1, max_attempts=1)
        dead = SharedLedger(RedisGovernor(redis_server.url), {"p": provider}, None)
        dead._lease["p"] = 1.5  # dies holding 0.7 for 1.5 s
        await dead.reserve("p", 0.7)
        alive = SharedLedger(RedisGovernor(redis_server.url), {"p": provider}, None)
        alive.notice_s = 0.3
        r = await alive.reserve("p", 0.25)  # fits beside it
        await alive.settle(r, 0.25)
        with caplog.at_level("WARNING", logger="conductor.governor"):
            with pytest.raises(BudgetExhausted):  # room only once the lease ends and it is charged
                await alive.reserve("p", 0.1)
        said = [m for m in caplog.messages if "waiting for room in its shared budget" in m]
        assert len(said) == 1 and "$0.250000 spent and $0.700000 reserved of $1.000000" in said[0], caplog.messages

    from conductor.execute.budget import BudgetExhausted

    asyncio.run(go())


def test_the_run_summary_shows_the_shared_budget_a_run_drew_on(tmp_path, fresh_sim, sample_queries, redis_server):
    import re

    import redis

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",),
                      providers={"sim": {"max_concurrency": 8, "timeout_s": 10, "budget_usd": 5.0}})
    doc = yaml.safe_load(pool.read_text())
    doc["governor"] = redis_server.url
    pool.write_text(yaml.safe_dump(doc))
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--run-id", "shown")
    assert r.returncode == 0, r.stderr
    line = next((x for x in r.stdout.splitlines() if x.startswith("budget provider sim")), None)
    assert line is not None, r.stdout
    m = re.search(r"\(shared; this run's part\)\s+\$([0-9.]+) of \$5\.000000", line)
    assert m, line
    server = redis.Redis.from_url(redis_server.url)
    spent = float(server.hget("conductor:gov:budget:default:sim", "spent"))
    server.close()
    assert float(m.group(1)) == pytest.approx(spent, abs=2e-6) and spent > 0  # the only run on it


@pytest.mark.slow
def test_killing_the_governor_fails_calls_clearly_loses_nothing_and_the_rerun_finishes(tmp_path, fresh_sim,
                                                                                     sample_queries, monkeypatch):
    from conductor.runner import RunConfig, run_all

    secret = "s3cr3t-pw-42"
    monkeypatch.setenv("TEST_GOVERNOR_URL", "")
    server = start_redis(password=secret)
    try:
        monkeypatch.setenv("TEST_GOVERNOR_URL", server.url)
        pool = tmp_path / "pool.yaml"
        write_pool(pool, fresh_sim.url, names=("slow",),
                   providers={"sim": {"max_concurrency": 4, "timeout_s": 10, "max_attempts": 2, "rpm": 6000}})
        doc = yaml.safe_load(pool.read_text())
        doc["governor"] = "${TEST_GOVERNOR_URL}"
        pool.write_text(yaml.safe_dump(doc))
        cfg = RunConfig(queries=sample_queries, pool=pool, data_dir=tmp_path / "data", progress=False,
                        run_id="gov-kill")
        killer = threading.Timer(2.0, server.kill)  # 60 calls of 0.3 s, 4 at a time: about 5 s
        killer.start()
        summary = run_all(cfg, planner=FixedPlanner(solve("slow")))
        killer.join()
        out = tmp_path / "data" / "runs" / summary["run_id"]
        traces = pq.read_table(out / "traces.parquet").to_pylist()
        failed = [t for t in traces if t["status"] != "ok"]
        assert failed, "the governor was killed mid-run: some calls must have failed"
        shown = f"redis://:***@127.0.0.1:{server.port}/0"
        for t in failed:
            assert shown in t["error"] and secret not in t["error"], t["error"]
            assert t["failure"] == "connection"
        answered = fresh_sim.log()["by_status"].get("200", 0)
        assert answered == sum(1 for t in traces if t["status"] == "ok")  # every answer paid for is kept
        assert not any(secret in p.read_text(errors="replace") for p in out.rglob("*") if p.is_file()
                       and p.suffix in (".json", ".jsonl"))

        server.start()  # the same port, empty: the server is back
        summary = run_all(cfg, planner=FixedPlanner(solve("slow")))
        assert summary["resumed"]
        results = pq.read_table(out / "results.parquet").to_pylist()
        assert [r["status"] for r in results] == ["ok"] * 60
        log = fresh_sim.log()
        assert log["by_status"].get("200", 0) == 60  # across both runs: no call answered twice
        assert max(log["by_request_key"].values()) == 1
    finally:
        server.stop()


def test_the_governor_url_is_checked_and_its_password_never_shown(monkeypatch):
    doc = {"workers": [worker("fast", "http://127.0.0.1:1/v1")]}
    with pytest.raises(PoolError) as e:
        parse_pool({**doc, "governor": "postgres://admin:hunter2@db:5432/x"})
    assert "governor" in str(e.value) and "hunter2" not in str(e.value) and "***" in str(e.value)
    assert parse_pool({**doc, "governor": "redis://127.0.0.1:6379/0"}).governor == "redis://127.0.0.1:6379/0"
    from conductor.execute.shared import governor_url

    monkeypatch.setenv("CONDUCTOR_GOVERNOR", "memory://")
    assert governor_url("redis://127.0.0.1:6379/0") == "memory://"  # the environment wins


def test_with_a_shared_governor_dagster_steps_claim_no_provider_pool(monkeypatch):
    from assets.concurrency import planner_pools, provider_pools

    monkeypatch.delenv("CONDUCTOR_GOVERNOR", raising=False)
    doc = {"workers": [worker("fast", "http://127.0.0.1:1/v1")]}
    assert provider_pools(parse_pool(doc)) == ["provider-sim"]  # in-process: one step per provider
    shared = parse_pool({**doc, "governor": "redis://127.0.0.1:6379/0"})
    assert provider_pools(shared) == [] and planner_pools("llm", {"worker": "fast"}, shared) == []
    monkeypatch.setenv("CONDUCTOR_GOVERNOR", "redis://127.0.0.1:6379/0")
    assert provider_pools(parse_pool(doc)) == []


class SlowLink:
    """A TCP proxy to the governor that holds each of its answers `delay_s`: Redis across a
    slow network, where settling a call's cost takes as long as a round trip."""

    def __init__(self, target_port: int, delay_s: float):
        self.delay_s, self.target = delay_s, ("127.0.0.1", target_port)
        self.held = 0  # answers held: how many times a client waited on the link
        self.sock = listen()
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src, dst, answers: bool) -> None:
        try:
            while data := src.recv(65536):
                if answers:
                    self.held += 1
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def slow_governor_run(tmp_path, fresh_sim, sample_queries, redis_server):
    """(start, args, link): `start()` begins a run of 16 queries in another process, whose budget is
    settled with Redis across a SlowLink; `args` reruns it. The sim's `slow` worker answers in `ms`."""
    import os

    link = SlowLink(int(redis_server.url.rsplit(":", 1)[1].split("/")[0]), delay_s=0.8)
    queries = tmp_path / "q.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 16), queries)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("slow",),
                      providers={"sim": {"max_concurrency": 4, "timeout_s": 10, "budget_usd": 5.0}})
    doc = yaml.safe_load(pool.read_text())
    doc["governor"] = link.url
    pool.write_text(yaml.safe_dump(doc))
    args = ["run", str(queries), "--pool", str(pool), "--data-dir", str(tmp_path / "data"), "--quiet", "--no-cache"]

    def start(ms: int) -> subprocess.Popen:
        fresh_sim.set_faults("slow", latency_ms=ms, latency_sd_ms=0)
        return subprocess.Popen([sys.executable, "-m", "conductor", *args], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})

    try:
        yield start, args, link
    finally:
        link.close()


def wait_for_sim(sim, p, enough) -> None:
    deadline = time.monotonic() + 120
    while not enough(sim.log()) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.02)


@pytest.mark.slow
def test_sigterm_keeps_answers_whose_cost_is_still_being_settled_with_the_governor(fresh_sim, slow_governor_run):
    """The drain waited for calls until their answers came back, not until they were kept: an
    answer whose settlement still awaited the governor was cancelled, and the rerun paid again."""
    import signal

    start, args, link = slow_governor_run
    p = start(600)
    wait_for_sim(fresh_sim, p, lambda log: log["total"] >= 6)
    p.send_signal(signal.SIGTERM)  # answers coming back, their settlements on the slow link
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and "call(s) in flight so their answers are kept" in err, err
    fresh_sim.clear_faults()
    link.delay_s = 0.0
    r = cli(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    log = fresh_sim.log()
    assert max(log["by_request_key"].values()) == 1 and log["by_status"].get("200") == 16, log["by_status"]


@pytest.mark.slow
def test_calls_cut_off_by_a_second_signal_while_settling_are_counted_lost_in_flight(fresh_sim, slow_governor_run):
    """A second signal stops at once; a call cut off then is sent again by the rerun and counted in
    its `lost in flight` line. One cut off while its cost was being settled with the governor was
    journaled as settled at $0: sent again, billed twice, and counted nowhere (audit51 N5)."""
    import re
    import signal

    start, args, link = slow_governor_run
    p = start(300)
    wait_for_sim(fresh_sim, p, lambda log: log["by_status"].get("200", 0) >= 4)
    p.send_signal(signal.SIGTERM)  # answers in hand, their settlements on the slow link ...
    time.sleep(0.4)
    p.send_signal(signal.SIGTERM)  # ... cut off by the second signal
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    fresh_sim.clear_faults()
    link.delay_s = 0.0
    r = cli(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    twice = sum(n - 1 for n in fresh_sim.log()["by_request_key"].values() if n > 1)
    lost = re.search(r"lost in flight\s+(\d+) call", r.stdout)
    assert (int(lost.group(1)) if lost else 0) == twice, (twice, r.stdout)
