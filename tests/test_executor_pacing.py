"""Pacing at a provider's limit and retries through faults (issue 14).

The pacer is checked on a simulated clock (which windows hold how many releases);
the executor's handling of 429s with and without rate-limit headers against the
real simulated server over HTTP."""

from __future__ import annotations

import asyncio
import bisect

import pyarrow.parquet as pq
import pytest

from conductor.execute.limits import Pacer
from conductor.execute.openai_http import parse_duration, rate_headers
from conductor.runner import RunConfig, run_all
from tests.conftest import write_pool
from tests.test_executor import FixedPlanner, solve


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        self.t += s


def _most_in_window(times: list[float], window: float) -> int:
    return max(bisect.bisect_right(times, t + window - 1e-9) - i for i, t in enumerate(times))


def _bucket_refuses(times: list[float], rpm: float) -> int:
    """Requests a server refilling a one-second bucket (R / 60 a second, full at start) refuses."""
    size = max(1.0, rpm / 60)
    level, last, refused = size, times[0], 0
    for t in times:
        level = min(size, level + (t - last) * rpm / 60)
        last = t
        if level >= 1 - 1e-9:
            level -= 1
        else:
            refused += 1
    return refused


def _releases(rpm: float, n: int, stall_after: int | None = None, stall_s: float = 0.0) -> list[float]:
    clock = FakeClock()
    pacer = Pacer(rpm, clock=clock, sleep=clock.sleep)
    out = []

    async def go():
        for i in range(n):
            if i == stall_after:
                clock.t += stall_s  # the event loop was busy elsewhere
            await pacer.acquire()
            out.append(clock.t)

    asyncio.run(go())
    return out


@pytest.mark.parametrize("rpm", [3000, 600, 90, 30])
def test_no_burst_above_the_rate_in_any_one_second_or_one_minute_window(rpm):
    times = _releases(rpm, int(rpm * 2.5), stall_after=int(rpm / 2), stall_s=7.0)
    assert _bucket_refuses(times, rpm) == 0  # a server refilling a one-second bucket
    assert _most_in_window(times, 1.0) <= max(1, rpm / 60) + 1
    assert _most_in_window(times, 60.0) <= rpm  # a server counting a rolling minute
    # and it keeps the pace: within 2% of the rate over the run, stall aside
    span = times[-1] - times[0] - 7.0
    assert (len(times) - 1) / span * 60 >= 0.95 * rpm


def test_releases_are_spread_over_the_second_not_sent_in_a_burst_at_its_start():
    """A burst of R / 60 at the start of each second arrives stretched by the server's own
    handling and overlaps the next burst in its one-second window: releases are spread."""
    times = _releases(3000, 300)
    assert _most_in_window(times, 0.2) <= 3000 / 60 * 0.2 + 1
    assert min(b - a for a, b in zip(times, times[1:])) >= 60 / 3000 - 1e-9


def test_a_request_that_left_late_counts_from_when_it_left():
    """The first request of a run opens a connection and reaches the server late: the
    requests a one-second window later keep their distance from when it left."""
    clock = FakeClock()
    pacer = Pacer(3000, clock=clock, sleep=clock.sleep)

    async def go():
        sent = await pacer.acquire()
        clock.t += 0.05  # 50 ms to open the connection (more than the pacing margin)
        left = clock.t
        sent()
        later = []
        for _ in range(60):
            await pacer.acquire()
            later.append(clock.t)
        return left, later

    left, later = asyncio.run(go())
    assert _most_in_window([left, *later], 1.0) <= 50
    assert later[49] >= left + 1.0  # the 51st request, counting the late one


def test_rate_limit_headers_slow_or_hold_the_pace():
    clock = FakeClock()
    pacer = Pacer(3000, clock=clock, sleep=clock.sleep)

    async def go(n):
        out = []
        for _ in range(n):
            await pacer.acquire()
            out.append(clock.t)
        return out

    asyncio.run(go(5))
    pacer.slow(0.5, clock.t + 10)  # "2 requests left for the next second": one per 0.5 s
    slowed = asyncio.run(go(5))
    assert min(b - a for a, b in zip(slowed, slowed[1:])) >= 0.5 - 1e-9
    pacer.hold(clock.t + 30)
    assert asyncio.run(go(1))[0] >= clock.t - 1e-9 and clock.t >= 1000 + 30


def test_rate_limit_headers_are_read_in_openai_s_forms():
    assert parse_duration("1s") == 1.0 and parse_duration("6m0s") == 360.0
    assert parse_duration("20ms") == pytest.approx(0.02) and parse_duration("1h2m3.5s") == 3723.5
    assert parse_duration("2.5") == 2.5 and parse_duration("soon") is None
    r = rate_headers({"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1.250s"})
    assert r.remaining == 0 and r.reset_s == 1.25
    assert rate_headers({}) is None


@pytest.mark.slow  # waits on the clock
def test_a_rate_limited_server_is_paced_and_every_call_answered_once(tmp_path, fresh_sim, sample_queries):
    """The server allows 20 requests per 2 s and the pool is set to 600 rpm: every call
    is answered exactly once (a 429 drawn on a loaded machine is retried after the wait
    the server asked, through the limiter)."""
    fresh_sim.set_faults("fast", rpm=20, rpm_window_s=2)
    try:
        pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",),
                          providers={"sim": {"max_concurrency": 16, "rpm": 600, "max_attempts": 10}})
        cfg = RunConfig(queries=sample_queries, pool=pool, data_dir=tmp_path / "data", progress=False, cache=False)
        summary = run_all(cfg, planner=FixedPlanner(solve("fast")))
    finally:
        fresh_sim.set_faults("fast", rpm=None, rpm_window_s=None)
    traces = pq.read_table(tmp_path / "data" / "runs" / summary["run_id"] / "traces.parquet").to_pylist()
    assert {t["status"] for t in traces} == {"ok"} and len(traces) == 60
    log = fresh_sim.log()
    assert set(log["by_request_key"].values()) == {1} and len(log["by_request_key"]) == 60
