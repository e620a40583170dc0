"""Per-provider limits shared by every plan of a run: calls in flight, requests
per minute (aiolimiter) and tokens per minute (a bucket that settles up with
the usage the provider reports).

Providers count requests over a rolling minute, so a limiter that allows a
full minute's burst and then the full rate would send up to twice the limit in
one minute. The RPM limiter therefore allows a small burst and paces the rest
so that no 61-second window can hold more than the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

from aiolimiter import AsyncLimiter

from conductor.pool import Provider

# Requests may reach the server up to this much later than we release them
# (event-loop and network jitter); pacing leaves room for it.
_JITTER_S = 1.0


def rpm_limiter(rpm: float) -> AsyncLimiter:
    burst = max(1.0, rpm / 100.0)
    rate_per_s = (rpm - burst) / (60.0 + _JITTER_S)
    if rate_per_s <= 0:  # tiny limits: one request per period, never two in a minute too many
        return AsyncLimiter(1, 60.0 / rpm + _JITTER_S)
    return AsyncLimiter(burst, burst / rate_per_s)


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
        self._rpm = rpm_limiter(provider.rpm) if provider.rpm else None
        self._tpm = TokenBucket(provider.tpm) if provider.tpm else None
        self._resume_at = 0.0

    def pause(self, seconds: float) -> None:
        """The provider said to wait (Retry-After): hold every new call, not just the one that was told."""
        self._resume_at = max(self._resume_at, time.monotonic() + seconds)

    @contextlib.asynccontextmanager
    async def slot(self, tokens: float) -> AsyncIterator[None]:
        async with self._inflight:
            while (wait := self._resume_at - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            if self._tpm:
                await self._tpm.acquire(tokens)
            if self._rpm:
                await self._rpm.acquire()
            yield

    def settle_tokens(self, estimated: float, actual: float) -> None:
        if self._tpm:
            self._tpm.settle(estimated, actual)
