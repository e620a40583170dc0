"""Per-provider limits shared by every plan of a run: calls in flight, requests
per minute (aiolimiter) and tokens per minute (a bucket that settles up with
the usage the provider reports).

Providers count requests over a rolling minute or refill a bucket every second,
so a limiter that allows a burst (a minute's worth, or aiolimiter's first
capacity) draws 429s at the start. The RPM limiter therefore has no burst: it
gives each request its own time slot, one every (60 s + jitter) / R, so any
61-second window holds at most R requests, and any one-second window at most
R / 60, spread evenly over it (see Pacer). `x-ratelimit-*` headers,
when a provider sends them, slow the pace further until their window resets.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from typing import AsyncIterator, Callable

from aiolimiter import AsyncLimiter

from conductor.pool import Provider

# Requests may reach the server up to this much later than we release them
# (event-loop and network jitter); pacing leaves room for it.
_JITTER_S = 1.0
# Pacer: slots a late release may catch up (at most that many requests back to back),
# and the pause after which the next request starts a new schedule instead.
_CATCH_UP_SLOTS = 2
_IDLE_S = 1.0


def rpm_limiter(rpm: float) -> AsyncLimiter:
    """aiolimiter's pacing for R requests per minute (a small burst): kept for callers
    outside the executor; the executor paces with `Pacer`."""
    burst = max(1.0, rpm / 100.0)
    rate_per_s = (rpm - burst) / (60.0 + _JITTER_S)
    if rate_per_s <= 0:  # tiny limits: one request per period, never two in a minute too many
        return AsyncLimiter(1, 60.0 / rpm + _JITTER_S)
    return AsyncLimiter(burst, burst / rate_per_s)


class Pacer:
    """Requests per minute with no burst above the rate: one release per slot, the slots
    (60 s + jitter) / R apart, so a server sees them spread evenly rather than R / 60 at
    the start of each second (such a burst arrives stretched by the server's own handling,
    and the next burst, handled faster, then overlaps it in the server's one-second window).
    Releases late by up to two slots (timer lag, a busy event loop) keep the slots where
    they were, so the next two may follow at once and the pace does not drift: on a loaded
    machine, moving the slots on after every late release cost 1.5% of the rate. Later
    than that, the slots move on by the excess. Bounds on top: the last
    (60 s + jitter) hold fewer than R releases and the last L x (61 / R) s fewer than
    L = R / 60, so after a stall of the event loop the pace never catches up beyond what a
    server counting either way allows."""

    def __init__(self, rpm: float, clock=time.monotonic, sleep=asyncio.sleep):
        self.rpm = rpm
        self._sleep = sleep
        self._interval = (60.0 + _JITTER_S) / rpm
        self._next = -math.inf  # the next slot
        self._short_n = max(1, int(rpm // 60))
        self._short_w = self._short_n * self._interval
        self._long_n = max(1, int(rpm))
        self._long_w = 60.0 + _JITTER_S / 2
        # each release as a one-item list: its time, moved on to when the request left (`sent`)
        self._short: deque[list[float]] = deque(maxlen=self._short_n)
        self._long: deque[list[float]] = deque(maxlen=self._long_n)
        self._clock = clock
        self._lock = asyncio.Lock()
        self._hold_until = 0.0
        self._slow_interval = 0.0  # from x-ratelimit headers, until _slow_until
        self._slow_until = 0.0

    def _earliest(self) -> float:
        t = max(self._hold_until, self._next)
        if len(self._short) == self._short_n:
            t = max(t, self._short[0][0] + self._short_w)
        if len(self._long) == self._long_n:
            t = max(t, self._long[0][0] + self._long_w)
        if self._short and self._short[-1][0] < self._slow_until:
            t = max(t, self._short[-1][0] + self._slow_interval)
        return t

    async def acquire(self) -> Callable[[], None]:
        """Wait for the next slot. Returns `sent`, to call when the request has left: a
        request held up after its release (a new connection to open, a busy event loop)
        then counts from when it left, so the ones after it keep their distance from it
        as the server sees it (the first request of a run, opening the first connection,
        reached the server 16-20 ms late, the whole margin of a one-second window)."""
        async with self._lock:
            while (wait := self._earliest() - self._clock()) > 0:
                await self._sleep(wait)
            now = self._clock()
            if now - self._next > _IDLE_S:  # the first request, or the first after a pause: no catching up
                self._next = now
            self._next = max(self._next, now - _CATCH_UP_SLOTS * self._interval) + self._interval
            release = [now]
            self._short.append(release)
            self._long.append(release)

        def sent() -> None:
            release[0] = max(release[0], self._clock())

        return sent

    def hold(self, until: float) -> None:
        """No release before `until` (monotonic time)."""
        self._hold_until = max(self._hold_until, until)

    def slow(self, interval: float, until: float) -> None:
        """At most one request per `interval` seconds until `until`."""
        if interval > 60.0 / self.rpm:
            self._slow_interval, self._slow_until = interval, until


class TokenBucket:
    """Tokens per minute. `acquire` takes an estimate up front; `settle` charges
    or refunds the difference once the real usage is known. The level may go
    negative after an underestimate, which delays later calls: the debt is paid."""

    def __init__(self, per_minute: float, clock=time.monotonic):
        # Paced like the RPM limiter: a small burst, then a rate that keeps any
        # 61-second window under the limit.
        self.capacity = max(1.0, per_minute / 100.0)
        self.rate = max(per_minute - self.capacity, per_minute / 2) / (60.0 + _JITTER_S)
        self.level = self.capacity
        self._clock = clock
        self._t = clock()
        self._lock = asyncio.Lock()
        self._refund = asyncio.Event()  # wakes a waiting caller when a call gives tokens back

    def _refill(self) -> None:
        now = self._clock()
        self.level = min(self.capacity, self.level + (now - self._t) * self.rate)
        self._t = now

    async def acquire(self, n: float) -> None:
        need = min(n, self.capacity)  # a call bigger than a minute's budget waits for a full bucket
        async with self._lock:
            while True:
                self._refill()
                if self.level >= need:
                    self.level -= n
                    return
                self._refund.clear()
                try:
                    await asyncio.wait_for(self._refund.wait(), (need - self.level) / self.rate)
                except asyncio.TimeoutError:
                    pass

    def settle(self, estimated: float, actual: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + estimated - actual)
        if estimated > actual:
            self._refund.set()


class ProviderLimiter:
    def __init__(self, provider: Provider):
        self.provider = provider
        self._inflight = asyncio.Semaphore(provider.max_concurrency)
        self._rpm = Pacer(provider.rpm) if provider.rpm else None
        self._tpm = TokenBucket(provider.tpm) if provider.tpm else None
        self._resume_at = 0.0

    def pause(self, seconds: float) -> None:
        """The provider's whole limit is spent for `seconds`: hold every new call to it
        (no longer than that), not just the one that was told. Other providers go on."""
        self._resume_at = max(self._resume_at, time.monotonic() + seconds)

    def observe(self, rate) -> None:
        """What a response's `x-ratelimit-*-requests` headers said (call's RateHeaders, or
        None): no request left in the window holds the provider until it resets; few
        left spreads them over the time to the reset when that is slower than our pace."""
        if rate is None or rate.reset_s is None:
            return
        now = time.monotonic()
        if rate.remaining < 1:
            self.pause(rate.reset_s)
        elif self._rpm is not None:
            self._rpm.slow(rate.reset_s / rate.remaining, now + rate.reset_s)

    @contextlib.asynccontextmanager
    async def slot(self, tokens: float) -> AsyncIterator[Callable[[], None] | None]:
        """A place to send one request; yields the pacer's `sent` (None without an rpm limit)."""
        async with self._inflight:
            while (wait := self._resume_at - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            if self._tpm:
                await self._tpm.acquire(tokens)
            yield await self._rpm.acquire() if self._rpm else None

    def settle_tokens(self, estimated: float, actual: float) -> None:
        if self._tpm:
            self._tpm.settle(estimated, actual)
