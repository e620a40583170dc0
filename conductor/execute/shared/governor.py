"""The shared governor on Redis: per provider, requests and tokens per minute,
calls in flight, Retry-After pauses and USD budgets, held in one server that
every process and machine uses.

Every decision is one Lua script run on the server, so it is atomic across
clients without client-side locks, and every clock reading is the server's
(TIME), so machines' clocks need not agree.

Rates use the generic cell rate algorithm: each request reserves the next slot
of an even schedule (at most a 1% burst), and sleeps until it. Any 61-second
window then holds at most the limit, the same pacing as the in-process limiter.
In-flight slots and budget reservations are leases: a process killed while
holding one frees the slot when the lease ends, and its reservation is then
counted as spent at its worst case, so a budget holds even against crashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from typing import AsyncIterator

from conductor.execute.budget import BudgetExhausted, Ledger, Reservation
from conductor.execute.limits import _JITTER_S
from conductor.pool import Provider
from conductor.execute.shared.url import GovernorUnavailable, redact

log = logging.getLogger("conductor.governor")

PREFIX = "conductor:gov"
# A slot used later than this after its send time is given up for a new one: the
# schedule leaves 1 s between release and arrival (limits._JITTER_S) for everything else.
_LATE_S = 0.25

# KEYS: pause, rpm tat, tpm tat. ARGV: rpm interval, rpm tolerance, tpm interval, tpm tolerance, tokens.
# Returns {ok, seconds}: ok=0 -> paused (Retry-After) for `seconds`, nothing taken;
# ok=1 -> a slot is reserved; send after `seconds`.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local pause = tonumber(redis.call('GET', KEYS[1]) or '0')
if pause > now then return {0, string.format('%.6f', pause - now)} end
local delay = 0
local ri, ti = tonumber(ARGV[1]), tonumber(ARGV[3])
local rtat, ttat = now, now
if ri > 0 then
  rtat = math.max(tonumber(redis.call('GET', KEYS[2]) or '0'), now)
  delay = math.max(delay, rtat - tonumber(ARGV[2]) - now)
end
if ti > 0 then
  ttat = math.max(tonumber(redis.call('GET', KEYS[3]) or '0'), now)
  delay = math.max(delay, ttat - tonumber(ARGV[4]) - now)
end
local send = now + delay
if ri > 0 then
  redis.call('SET', KEYS[2], string.format('%.6f', math.max(rtat, send) + ri), 'EX', 3600)
end
if ti > 0 then
  redis.call('SET', KEYS[3], string.format('%.6f', math.max(ttat, send) + ti * tonumber(ARGV[5])), 'EX', 3600)
end
return {1, string.format('%.6f', delay)}
"""

# KEYS: tpm tat. ARGV: tpm interval, tokens to give back (negative: charge more).
_SETTLE_TOKENS = """
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat == 0 then return 0 end
redis.call('SET', KEYS[1], string.format('%.6f', tat - tonumber(ARGV[1]) * tonumber(ARGV[2])), 'EX', 3600)
return 1
"""

# KEYS: pause. ARGV: seconds. The latest resume time wins.
_PAUSE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local until_ = now + tonumber(ARGV[1])
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if until_ > cur then
  redis.call('SET', KEYS[1], string.format('%.6f', until_), 'EX', math.ceil(tonumber(ARGV[1])) + 60)
end
return 1
"""

# KEYS: in-flight zset (member -> lease end), pause. ARGV: limit, holder id, lease seconds.
# Returns {1, 0} entered; {0, seconds} paused (Retry-After) for that long; {0, -1} full.
_ENTER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local pause = tonumber(redis.call('GET', KEYS[2]) or '0')
if pause > now then return {0, string.format('%.6f', pause - now)} end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3])) + 60)
  return {1, '0'}
end
return {0, '-1'}
"""

# How long an expired lease is remembered, so that a settle arriving after it (one kept while
# the server was unreachable) gives the difference back once, and a settle sent twice (its first
# answer lost) changes nothing the second time.
_EXPIRED_KEEP_S = 7 * 86400

# Budget: KEYS: totals hash (spent, reserved), lease zset (id -> end), amounts hash (id -> usd),
# expired zset (id -> forget time), expired amounts hash (id -> usd charged).
# Expired leases (their process died) are charged in full: the call may have been paid.
# Expired ones are kept in keys of their own: versions before 39d183b read the lease zset and
# amounts hash only, and charged a record kept there again as a lease once its time came (spent
# doubled, reserved negative for good). A lease such a version expires is charged in full with
# no record, so this version's late settle of it changes nothing (the safe side); its own late
# settle of a lease this version expired gives the difference back every time it is sent (its
# behaviour before), so once is not guaranteed for it. "x:" members are records 39d183b kept in
# the lease zset: dropped uncharged when due.
_EXPIRE_LEASES = """
local function expire(now)
  local old = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
  for _, id in ipairs(old) do
    redis.call('HDEL', KEYS[5], id)
    redis.call('ZREM', KEYS[4], id)
  end
  local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
  for _, id in ipairs(gone) do
    local amt = redis.call('HGET', KEYS[3], id) or '0'
    redis.call('HDEL', KEYS[3], id)
    redis.call('ZREM', KEYS[2], id)
    if string.sub(id, 1, 2) ~= 'x:' then
      redis.call('HINCRBYFLOAT', KEYS[1], 'reserved', -tonumber(amt))
      redis.call('HINCRBYFLOAT', KEYS[1], 'spent', tonumber(amt))
      redis.call('HSET', KEYS[5], id, amt)
      redis.call('ZADD', KEYS[4], now + %d, id)
      redis.call('EXPIRE', KEYS[4], %d)
      redis.call('EXPIRE', KEYS[5], %d)
    end
  end
end
""" % (_EXPIRED_KEEP_S, _EXPIRED_KEEP_S + 60, _EXPIRED_KEEP_S + 60)

# ARGV: limit, amount, id, lease seconds. Returns {status, spent, reserved}:
# 1 reserved; 0 does not fit while others are pending (wait); -1 can never fit.
_RESERVE = _EXPIRE_LEASES + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
expire(now)
local spent = tonumber(redis.call('HGET', KEYS[1], 'spent') or '0')
local reserved = tonumber(redis.call('HGET', KEYS[1], 'reserved') or '0')
local limit, amount = tonumber(ARGV[1]), tonumber(ARGV[2])
local status = 0
if spent + reserved + amount <= limit + 1e-12 then
  redis.call('HINCRBYFLOAT', KEYS[1], 'reserved', amount)
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[3])
  redis.call('HSET', KEYS[3], ARGV[3], ARGV[2])
  status = 1
elseif spent + amount > limit + 1e-12 or reserved <= 1e-12 then
  status = -1
end
return {status, string.format('%.9f', spent), string.format('%.9f', reserved)}
"""

# ARGV: id, amount reserved, actual cost. Returns 1 settled; 0 its lease had expired and was
# charged in full: the difference is given back; 2 nothing to do (settled already, or expired
# longer ago than _EXPIRED_KEEP_S: it stays charged in full), so sending it again is safe.
_SETTLE = """
local amt = redis.call('HGET', KEYS[3], ARGV[1])
if amt then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HINCRBYFLOAT', KEYS[1], 'reserved', -tonumber(amt))
  redis.call('HINCRBYFLOAT', KEYS[1], 'spent', tonumber(ARGV[3]))
  return 1
end
local late = redis.call('HGET', KEYS[5], ARGV[1])
if late then
  redis.call('HDEL', KEYS[5], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('HINCRBYFLOAT', KEYS[1], 'spent', tonumber(ARGV[3]) - tonumber(late))
  return 0
end
return 2
"""


class RedisGovernor:
    """One client and the scripts, shared by a run's limiters and ledger."""

    def __init__(self, url: str, budget_scope: str = "default"):
        import redis.asyncio as aioredis

        self.url = url
        self.shown = redact(url)
        self.budget_scope = budget_scope
        # A bounded pool that waits for a free connection: every plan in flight may be
        # polling for budget or a slot at once, and a server caps its clients.
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=32, timeout=30,
                                                        socket_connect_timeout=5, socket_timeout=10,
                                                        health_check_interval=30)
        self.client = aioredis.Redis(connection_pool=pool)
        self.id = uuid.uuid4().hex[:12]
        self._scripts = {name: self.client.register_script(src) for name, src in (
            ("acquire", _ACQUIRE), ("settle_tokens", _SETTLE_TOKENS), ("pause", _PAUSE), ("enter", _ENTER),
            ("reserve", _RESERVE), ("settle", _SETTLE))}
        self._background: set[asyncio.Task] = set()
        # An outage is said once when it begins and once when the server answers again: each
        # call attempt and each settlement that failed on it printed a line (450 for 55 plans).
        self.down_since: float | None = None  # time.monotonic() of the first failure of this outage
        # Settles that could not reach the server: (keys, args), sent again when it answers and at
        # close(). Dropped, each answered call stayed charged at its worst case for good.
        self.unsettled: list[tuple[list[str], list]] = []
        self._resettling: asyncio.Task | None = None

    async def run(self, name: str, keys: list[str], args: list) -> list | int:
        """A script on the server; any failure to reach it is GovernorUnavailable (naming the URL)."""
        from redis.exceptions import RedisError

        try:
            result = await self._scripts[name](keys=keys, args=args)
        except (RedisError, OSError, asyncio.TimeoutError) as e:
            failure = GovernorUnavailable(self.url, e)
            self._went_down(failure, e)
            raise failure from None
        if self.down_since is not None:
            self._came_back()
        return result

    def _went_down(self, failure: GovernorUnavailable, error: BaseException) -> None:
        if self.down_since is not None:
            return
        self.down_since = time.monotonic()
        why = str(error) or type(error).__name__
        if failure.refused:
            log.warning("shared governor %s refuses %s in its URL (%s): no call is sent while it does; "
                        "fix the URL and rerun the same command (the steps it fails are counted at the end)",
                        self.shown, failure.refused, why)
        else:
            log.warning("shared governor %s unreachable (%s): no call is sent while it is; the calls that "
                        "fail for it are counted at the end: rerun the same command once the server is back",
                        self.shown, why)

    def _came_back(self) -> None:
        down, self.down_since = self.down_since, None
        if down is not None:
            log.warning("shared governor %s answers again after %.0f s: calls are sent again",
                        self.shown, time.monotonic() - down)
        if self.unsettled:
            self._resettle_task()

    def _resettle_task(self) -> asyncio.Task:
        """The one task sending the kept settles (started if none runs), so that every budget
        decision can wait for the same give-backs."""
        if self._resettling is None or self._resettling.done():
            self._resettling = asyncio.get_running_loop().create_task(self.resettle())
            self._background.add(self._resettling)
            self._resettling.add_done_callback(self._background.discard)
        return self._resettling

    def resettling(self) -> bool:
        """Settles kept through an outage wait to be sent, or are being sent."""
        return bool(self.unsettled) or (self._resettling is not None and not self._resettling.done())

    async def settle_kept(self) -> None:
        """Before a budget decision, the settles kept through an outage are sent (nothing to do
        when none are): without it a reserve racing their background task could be refused for
        a budget their give-backs would have made room in (exit 3)."""
        if self.resettling():
            await asyncio.shield(self._resettle_task())

    async def resettle(self) -> None:
        """Send the settles kept during an outage; those the server cannot take now are kept
        for the next time it answers (the settle script is safe to run twice)."""
        todo, self.unsettled = self.unsettled, []
        for i, (keys, args) in enumerate(todo):
            try:
                await self.run("settle", keys, args)
            except GovernorUnavailable:
                self.unsettled.extend(todo[i:])
                return

    def later(self, name: str, keys: list[str], args: list) -> None:
        """Fire and forget (from sync code: a pause, a token refund); a failure is never raised,
        and said only as the outage it is part of (run())."""
        async def go() -> None:
            with contextlib.suppress(GovernorUnavailable):
                await self.run(name, keys, args)

        task = asyncio.get_running_loop().create_task(go())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.unsettled:
            await self.resettle()
        n, usd = len(self.unsettled), sum(float(args[1]) for _, args in self.unsettled)
        if n:
            log.warning("shared governor %s: %s of $%.6f in all could not be settled while it was unreachable: "
                        "charged in full when their leases end", self.shown,
                        "1 reservation" if n == 1 else f"{n:,} reservations", usd)
            self.unsettled = []
        with contextlib.suppress(Exception):
            await self.client.aclose()

    def key(self, *parts: str) -> str:
        return ":".join((PREFIX, *parts))


def _schedule(per_minute: float) -> tuple[float, float]:
    """(seconds per unit, burst tolerance in seconds): at most a 1% burst, then a rate that
    keeps any (60 s + jitter) window at or under the limit, as limits.rpm_limiter does."""
    burst = max(1.0, per_minute / 100.0)
    rate = max(per_minute - burst, per_minute / 2) / (60.0 + _JITTER_S)
    interval = 1.0 / rate
    return interval, (burst - 1.0) * interval


class SharedLimiter:
    """ProviderLimiter's interface (slot, pause, settle_tokens) over the shared governor."""

    def __init__(self, gov: RedisGovernor, provider: Provider):
        self.gov = gov
        self.provider = provider
        pid = provider.id
        self._keys = [gov.key("pause", pid), gov.key("rpm", pid), gov.key("tpm", pid)]
        self._inflight_key = gov.key("inflight", pid)
        self._local = asyncio.Semaphore(provider.max_concurrency)  # no more waiters than slots per process
        self._rpm = _schedule(provider.rpm) if provider.rpm else (0.0, 0.0)
        self._tpm = _schedule(provider.tpm) if provider.tpm else (0.0, 0.0)
        # A place in flight is held for the call: a process that dies frees it after this.
        self._lease = provider.timeout_s + 60.0
        self._n = 0

    def pause(self, seconds: float) -> None:
        """A provider's Retry-After holds every process's new calls to it."""
        self.gov.later("pause", [self._keys[0]], [max(0.0, seconds)])

    def observe(self, rate) -> None:
        """x-ratelimit headers (openai_http.RateHeaders, or None): none left in the provider's
        window holds every process's new calls to it until the reset, as ProviderLimiter.observe
        does for one process. Without it each 429 waited alone and all came back at once (twice
        the 429s of unshared limiters, and plans failed). Few left does not slow the shared pace."""
        if rate is not None and rate.reset_s is not None and rate.remaining is not None and rate.remaining < 1:
            self.pause(rate.reset_s)

    @contextlib.asynccontextmanager
    async def slot(self, tokens: float) -> AsyncIterator[None]:
        """The rate slot first (one script: its send time on the shared schedule), then, at that
        time, a place among the calls in flight, unless a Retry-After pause has begun since.
        Taking the slot first keeps waiters off the in-flight set, so it is seldom polled."""
        async with self._local:
            self._n += 1
            holder = f"{self.gov.id}:{self._n}"
            while True:
                ok, wait = await self.gov.run("acquire", self._keys, [
                    self._rpm[0], self._rpm[1], self._tpm[0], self._tpm[1], max(0.0, tokens)])
                due = time.monotonic() + float(wait)
                await asyncio.sleep(float(wait))
                if time.monotonic() - due > _LATE_S:
                    continue  # a stalled process would send late, in a bunch with later slots: take a new one
                if int(ok) and await self._enter(holder):
                    break
            try:
                yield
            finally:
                with contextlib.suppress(Exception):
                    await self.gov.client.zrem(self._inflight_key, holder)

    async def _enter(self, holder: str) -> bool:
        """A place among the provider's calls in flight across every process (polled while
        full: a place frees within one call's latency). False: a Retry-After pause began
        while this call waited for its send time; it waits it out and takes a new slot,
        so the calls held up do not all go at once when it ends."""
        pause = 0.005
        while True:
            ok, wait = await self.gov.run("enter", [self._inflight_key, self._keys[0]],
                                          [self.provider.max_concurrency, holder, self._lease])
            if int(ok):
                return True
            if float(wait) >= 0:
                await asyncio.sleep(float(wait))
                return False
            await asyncio.sleep(pause * (0.5 + random.random()))
            pause = min(0.1, pause * 1.5)

    def settle_tokens(self, estimated: float, actual: float) -> None:
        if self._tpm[0] and estimated != actual:
            self.gov.later("settle_tokens", [self._keys[2]], [self._tpm[0], estimated - actual])


class SharedReservation(Reservation):
    def __init__(self, local: Reservation, provider: str, remote_id: str | None):
        super().__init__(local.caps, local.amount)
        self.provider = provider
        self.remote_id = remote_id


class SharedLedger(Ledger):
    """Provider budgets on the server (one total across every process using the same
    budget scope); the run's own cap stays in this process, as it belongs to one run."""

    def __init__(self, gov: RedisGovernor, providers: dict[str, Provider], run_limit: float | None,
                 spent: dict[str, float] | None = None):
        # Locally: the run cap, and spend per provider for the summary (no provider caps:
        # earlier attempts' spend is already in the server's totals).
        super().__init__({p: None for p in providers}, run_limit, spent)
        self.gov = gov
        self.limits = {p: prov.budget_usd for p, prov in providers.items()}
        self._lease = {p: prov.timeout_s * prov.max_attempts + 600.0 for p, prov in providers.items()}
        self.notice_s = 30.0  # a reservation waiting this long says why, once per provider
        self._noticed: set[str] = set()

    def _keys(self, provider: str) -> list[str]:
        """Totals, leases, their amounts, and the expired leases' records (_EXPIRE_LEASES): the
        first three are the keys older versions read too."""
        base = self.gov.key("budget", self.gov.budget_scope, provider)
        return [base, base + ":leases", base + ":amounts", base + ":expired:leases", base + ":expired:amounts"]

    async def reserve(self, provider: str, amount: float) -> Reservation:
        local = await super().reserve(provider, amount)
        limit = self.limits.get(provider)
        if limit is None:
            return SharedReservation(local, provider, None)
        rid = f"{self.gov.id}:{uuid.uuid4().hex[:12]}"
        pause = 0.02
        since, waited = time.monotonic(), False
        try:
            if self.gov.down_since is None:  # while it is down, the reserve below says so
                await self.gov.settle_kept()
            while True:
                status, spent, reserved = await self.gov.run(
                    "reserve", self._keys(provider), [limit, amount, rid, self._lease[provider]])
                if int(status) == 1:
                    return SharedReservation(local, provider, rid)
                if int(status) == -1:
                    if not waited and self.gov.resettling():  # the server just came back: its give-backs first
                        waited = True
                        await self.gov.settle_kept()
                        continue
                    raise BudgetExhausted(f"provider {provider} (shared)", limit, float(spent), amount)
                if time.monotonic() - since > self.notice_s and provider not in self._noticed:
                    # Silent, a wait on a killed process's reservation looked like a hang.
                    self._noticed.add(provider)
                    log.warning("provider %s: waiting for room in its shared budget ($%.6f spent and $%.6f "
                                "reserved of $%.6f, by every process using it); a killed process's "
                                "reservations are held until their lease ends, at most %.0f s, then charged "
                                "in full", provider, float(spent), float(reserved), limit, self._lease[provider])
                await asyncio.sleep(pause * (0.5 + random.random()))
                pause = min(0.5, pause * 1.5)
        except BaseException:
            await super().settle(local, 0.0)
            raise

    async def settle(self, r: Reservation, actual: float) -> None:
        """Never raises for the server: an answer in hand is kept. A settle that cannot reach
        the server is sent again when it answers, or at close(); until then its lease holds the
        worst case, and if it ends first the call is charged in full (the safe side) and the
        difference given back by the late settle."""
        if r.settled:
            return
        if isinstance(r, SharedReservation) and r.remote_id is not None:
            keys, args = self._keys(r.provider), [r.remote_id, r.amount, actual]
            try:
                await self.gov.run("settle", keys, args)
            except GovernorUnavailable:  # the outage is said once (run()); sent again when it answers
                self.gov.unsettled.append((keys, args))
        await super().settle(r, actual)

    def summary(self) -> list[dict]:
        """As Ledger's, with each shared provider cap's limit beside this run's part of its
        spend, so the run summary still shows the budget a run drew on."""
        rows = super().summary()
        for row in rows:
            provider = row["cap"].removeprefix("provider ")
            if row["cap"].startswith("provider ") and self.limits.get(provider) is not None:
                row["cap"] = f"provider {provider} (shared; this run's part)"
                row["limit_usd"] = self.limits[provider]
        return rows

    async def shared_spend(self, provider: str) -> tuple[float, float]:
        """(spent, reserved) on the server for a provider, in this budget scope."""
        vals = await self.gov.client.hmget(self._keys(provider)[0], ["spent", "reserved"])
        return tuple(float(v or 0) for v in vals)  # type: ignore[return-value]
