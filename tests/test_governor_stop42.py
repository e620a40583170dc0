"""The shared Redis governor (audit76 F1-F3), on a real redis-server on an OS-chosen
127.0.0.1 port: a 429 saying the provider's limit is spent holds every process sharing
it, settles kept through an outage reach the budget when the server is back, and the
budget scope is checked."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from conductor.execute.shared.servers import RedisServer, _wait_port
from conductor.pool import Provider
from tests.conftest import REPO, run_cli, write_pool

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


class DurableRedis(RedisServer):
    """redis-server writing every change to its append-only file, so that one killed and
    started again on its port comes back with the budgets it held, as a production one does."""

    def start(self) -> None:
        cmd = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
               "--appendfsync", "always", "--dir", self._dir.name, "--protected-mode", "no"]
        log = Path(self._dir.name) / "redis.log"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        _wait_port(self.port, self.proc, "redis-server", log)


def shared_pool(path: Path, sim_url: str, governor: str | None = None, **provider) -> Path:
    pool = write_pool(path, sim_url, names=("fast",),
                      providers={"sim": {"max_concurrency": 8, "timeout_s": 10, **provider}})
    if governor:
        doc = yaml.safe_load(pool.read_text())
        doc["governor"] = governor
        pool.write_text(yaml.safe_dump(doc))
    return pool


@pytest.mark.slow  # two runs paced by a server allowing 5 requests a second
def test_two_runs_sharing_a_governor_against_a_tight_server_limit_fail_no_plan(tmp_path, fresh_sim,
                                                                                sample_queries):
    """The server allows 10 requests per 2 s and says so in its 429s' x-ratelimit headers. Before,
    the shared governor never paused on them: each 429 waited alone, all came back at once, and a
    third to a half of the plans of each run failed after 6 attempts (exit 4)."""
    fresh_sim.set_faults("fast", rpm=10, rpm_window_s=2)
    with RedisServer() as redis_server:
        pool = shared_pool(tmp_path / "pool.yaml", fresh_sim.url)
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "CONDUCTOR_GOVERNOR": redis_server.url}
        runs = [subprocess.Popen([sys.executable, "-m", "conductor", "run", str(sample_queries), "--pool", str(pool),
                                  "--data-dir", str(tmp_path / "data"), "--run-id", rid, "--no-cache", "--quiet"],
                                 cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for rid in ("a", "b")]
        done = [p.communicate(timeout=300) for p in runs]
    for p, (out, err) in zip(runs, done):
        assert p.returncode == 0, err[-2000:]
    for rid in ("a", "b"):
        results = pq.read_table(tmp_path / "data" / "runs" / rid / "results.parquet").to_pylist()
        assert len(results) == 60 and {r["status"] for r in results} == {"ok"}, rid


def test_settles_kept_through_an_outage_reach_the_shared_budget_when_it_is_back():
    """Answered calls whose settles failed while Redis was down stayed charged at their worst case
    for good (their leases then charged them in full): the budget filled up with calls never paid."""
    from conductor.execute.shared.governor import RedisGovernor, SharedLedger

    provider = Provider("p", budget_usd=1.0, timeout_s=10, max_attempts=1)

    async def go(server: DurableRedis):
        ledger = SharedLedger(RedisGovernor(server.url), {"p": provider}, None)
        first, second = await ledger.reserve("p", 0.3), await ledger.reserve("p", 0.3)
        server.kill()
        await ledger.settle(first, 0.01)  # answered while the server is down
        await ledger.settle(second, 0.02)
        server.start()
        third = await ledger.reserve("p", 0.1)  # the server answers again: the kept settles are sent
        await ledger.settle(third, 0.03)
        again = SharedLedger(RedisGovernor(server.url), {"p": provider}, None)
        fourth = await again.reserve("p", 0.3)
        server.kill()
        await again.settle(fourth, 0.04)
        server.start()
        await again.gov.close()  # nothing else ran: close() sends it
        await ledger.gov.close()
        return await SharedLedger(RedisGovernor(server.url), {"p": provider}, None).shared_spend("p")

    with DurableRedis() as server:
        spent, reserved = asyncio.run(go(server))
    assert (round(spent, 6), round(reserved, 6)) == (0.1, 0.0)


def test_a_settle_sent_twice_or_after_its_lease_ended_counts_once():
    """A settle is sent again when its first try failed, which may have reached the server (its
    answer lost): the second must not give the difference back again. A lease that ended first
    was charged in full; its late settle gives the difference back, once."""
    from conductor.execute.shared.governor import RedisGovernor, SharedLedger

    provider = Provider("p", budget_usd=1.0, timeout_s=0.1, max_attempts=1)

    async def go(url: str):
        ledger = SharedLedger(RedisGovernor(url), {"p": provider}, None)
        r = await ledger.reserve("p", 0.3)
        args = [r.remote_id, r.amount, 0.05]
        for _ in range(2):
            await ledger.gov.run("settle", ledger._keys("p"), args)
        live = await ledger.shared_spend("p")
        ledger._lease["p"] = 0.2
        late = await ledger.reserve("p", 0.4)  # its process is slow to settle: the lease ends first
        await asyncio.sleep(0.4)
        await ledger.reserve("p", 0.01)  # a reserve ends the lease: 0.4 charged in full
        charged = await ledger.shared_spend("p")
        for _ in range(2):
            await ledger.gov.run("settle", ledger._keys("p"), [late.remote_id, late.amount, 0.1])
        settled = await ledger.shared_spend("p")
        await ledger.gov.close()
        return live, charged, settled

    with RedisServer() as server:
        live, charged, settled = asyncio.run(go(server.url))
    assert round(live[0], 6) == 0.05
    assert round(charged[0], 6) == 0.45
    assert (round(settled[0], 6), round(settled[1], 6)) == (0.15, 0.01)


def test_a_bad_budget_scope_is_refused_before_any_call_and_a_good_one_has_its_own_total(
        tmp_path, fresh_sim, sample_queries):
    """CONDUCTOR_BUDGET_SCOPE is part of the governor's Redis keys: a ':' let one scope's total land
    in another's ("a:b" + provider "c" = "a" + provider "b:c"), and a typo went unnoticed."""
    import redis

    with RedisServer() as server:
        pool = shared_pool(tmp_path / "pool.yaml", fresh_sim.url, governor=server.url, budget_usd=5.0)
        r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--run-id", "bad",
                    env={"CONDUCTOR_BUDGET_SCOPE": "team:2026-11"})
        assert r.returncode == 2, r.stderr
        assert "CONDUCTOR_BUDGET_SCOPE='team:2026-11'" in r.stderr and "nothing was called" in r.stderr, r.stderr
        assert fresh_sim.log()["total"] == 0
        r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--run-id", "nov",
                    env={"CONDUCTOR_BUDGET_SCOPE": "2026-11"})
        assert r.returncode == 0, r.stderr
        client = redis.Redis.from_url(server.url)
        keys = sorted(k.decode() for k in client.keys("conductor:gov:budget:*") if b":lease" not in k
                      and b":amounts" not in k)
        client.close()
    assert keys == ["conductor:gov:budget:2026-11:sim"]


# The lease expiry of conductor before 39d183b, as it still runs on every reserve of an older
# install sharing the server (keys: totals, leases, amounts).
OLDER_EXPIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, id in ipairs(gone) do
  local amt = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  redis.call('HINCRBYFLOAT', KEYS[1], 'reserved', -amt)
  redis.call('HINCRBYFLOAT', KEYS[1], 'spent', amt)
  redis.call('HDEL', KEYS[3], id)
  redis.call('ZREM', KEYS[2], id)
end
return 1
"""


def test_an_older_version_sharing_the_server_does_not_charge_an_expired_lease_again():
    """The record of an expired lease (kept 7 days for a late settle) lived among the leases, so
    an older conductor on the same server charged it again once its 7 days passed: spent 0.4
    became 0.8 and reserved went negative for good."""
    from conductor.execute.shared.governor import RedisGovernor, SharedLedger

    provider = Provider("p", budget_usd=1.0, timeout_s=0.1, max_attempts=1)

    async def go(url: str):
        ledger = SharedLedger(RedisGovernor(url), {"p": provider}, None)
        ledger._lease["p"] = 0.2
        await ledger.reserve("p", 0.4)  # its process dies: the lease ends
        await asyncio.sleep(0.4)
        ledger._lease["p"] = 3600.0
        await ledger.reserve("p", 0.01)  # ends that lease: 0.4 charged in full
        client = ledger.gov.client
        base = ledger._keys("p")[0]
        week_later = (await client.time())[0] + 8 * 86400
        for key in await client.keys(base + ":*"):  # 8 days pass for everything kept a week
            if await client.type(key) == b"zset":
                for member, score in await client.zrange(key, 0, -1, withscores=True):
                    if score > week_later - 86400:
                        await client.zadd(key, {member: 1.0})
        await client.eval(OLDER_EXPIRE, 3, base, base + ":leases", base + ":amounts")
        totals = await ledger.shared_spend("p")
        await ledger.gov.close()
        return totals

    with RedisServer() as server:
        spent, reserved = asyncio.run(go(server.url))
    assert (round(spent, 6), round(reserved, 6)) == (0.4, 0.01)


def test_a_reserve_when_the_server_is_back_counts_the_settles_kept_through_the_outage():
    """After an outage longer than a lease, the lease was charged in full and its kept settle sent
    in the background: the reserve that found the server back was refused for a budget the settle
    gave back the next moment (BudgetExhausted, exit 3)."""
    from conductor.execute.shared.governor import RedisGovernor, SharedLedger

    provider = Provider("p", budget_usd=1.0, timeout_s=0.1, max_attempts=1)

    async def go(server: DurableRedis):
        ledger = SharedLedger(RedisGovernor(server.url), {"p": provider}, None)
        ledger._lease["p"] = 0.2
        first = await ledger.reserve("p", 0.6)
        server.kill()
        await ledger.settle(first, 0.01)  # answered while the server is down: kept
        server.start()
        await asyncio.sleep(0.4)  # its lease ends before the server hears of the settle
        ledger._lease["p"] = 3600.0
        second = await ledger.reserve("p", 0.5)
        await ledger.settle(second, 0.02)
        await ledger.gov.close()
        return await SharedLedger(RedisGovernor(server.url), {"p": provider}, None).shared_spend("p")

    with DurableRedis() as server:
        spent, reserved = asyncio.run(go(server))
    assert (round(spent, 6), round(reserved, 6)) == (0.03, 0.0)


def test_a_spent_rate_window_pauses_the_provider_for_every_process_until_its_reset():
    """x-ratelimit-remaining-requests 0 on any answer holds new calls to the provider in every
    process sharing the governor until x-ratelimit-reset-requests; requests left, or no header,
    hold nothing."""
    from conductor.execute.openai_http import RateHeaders
    from conductor.execute.shared.governor import RedisGovernor, SharedLimiter

    provider = Provider("p", max_concurrency=4, timeout_s=10)

    async def acquire_after(url: str, rate) -> tuple[int, float]:
        gov = RedisGovernor(url)
        SharedLimiter(gov, provider).observe(rate)
        await gov.close()  # the pause is sent in the background
        other = RedisGovernor(url)  # another process
        ok, wait = await other.run("acquire", SharedLimiter(other, provider)._keys, [0, 0, 0, 0, 0])
        await other.client.delete(other.key("pause", "p"))
        await other.close()
        return int(ok), float(wait)

    with RedisServer() as server:
        spent = asyncio.run(acquire_after(server.url, RateHeaders(remaining=0, reset_s=30.0)))
        left = asyncio.run(acquire_after(server.url, RateHeaders(remaining=3, reset_s=30.0)))
        unsaid = asyncio.run(acquire_after(server.url, RateHeaders(remaining=None, reset_s=30.0)))
        none = asyncio.run(acquire_after(server.url, None))
    assert spent[0] == 0 and 0 < spent[1] <= 30.0
    assert left == unsaid == none == (1, 0.0)


def test_a_budget_scope_without_a_shared_governor_is_said_once_as_a_warning(tmp_path, fresh_sim,
                                                                              tmp_path_factory, sample_queries):
    """The run checks the governor and so does each stage: the line came twice, and without the
    "conductor: warning:" every other warning has."""
    from tests.conftest import first_queries

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    r = run_cli("run", first_queries(tmp_path_factory, sample_queries, 3), "--pool", pool,
                "--data-dir", tmp_path / "data", "--quiet",
                env={"CONDUCTOR_BUDGET_SCOPE": "2026-11", "CONDUCTOR_GOVERNOR": ""})
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "has no effect" in line]
    assert len(said) == 1, r.stderr
    assert said[0].startswith("conductor: warning: CONDUCTOR_BUDGET_SCOPE=2026-11 has no effect"), r.stderr
