"""The response cache on the shared server, keyed exactly as the SQLite one
(conductor.execute.cache.cache_key): a job run again on any machine is served
from it. The per-run cache and journal that resume relies on stay in the run folder.

The interface is the SQLite Cache's (get, get_many, put, len, close), synchronous: one
round trip on a local network is well under a millisecond. Being synchronous, every
round trip holds the run's event loop, and with it every call in flight: a hung or slow
server held it for seconds a lookup, calls ran past their timeout_s and were sent, and
paid, again. So the server is checked when opened, every wait on it is short, and once
it fails or is slow it is not waited on again (one warning): the run goes on with its
own cache, and a background PING, once a cool-down has passed, brings it back.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import orjson

from conductor.execute.cache import Cache, Entry, read_entry
from conductor.execute.shared.url import CACHE_ENV as ENV  # noqa: F401 - its name here before url.py had it
from conductor.execute.shared.url import cache_setting, redact, refusal

log = logging.getLogger("conductor.cache")
PREFIX = "conductor:cache:"
TIMEOUT_S = 2.0  # to connect, and for each answer
# Round trips over SLOW_S (hundreds of times the usual) that held the run SLOW_BUDGET_S in all within
# SLOW_WINDOW_S count as a failure: a server that answers, but slowly, held every call in flight too.
SLOW_S, SLOW_BUDGET_S, SLOW_WINDOW_S = 0.25, 1.0, 60.0
COOL_DOWN_S = 30.0  # after a failure, the server is left alone this long, then PINGed in the background
KEYS_PER_MGET = 200  # one round trip stays small, so a large lookup is not taken for a slow server
LOOKUP = "answers are looked up in this run's own cache only"
KEEP = "new answers are kept in this run's own cache only"


class _Health:
    """Whether a cache server may be waited on, shared by every RedisCache of the process on
    its URL: once it failed, none of them waits on it until a background PING finds it back."""

    def __init__(self) -> None:
        self.down = False
        self.retry_at = 0.0  # time.monotonic() after which a background PING may try it again
        self.warned = False
        self.probing = False
        self.slow_since, self.slow_total = 0.0, 0.0  # slow round trips: since when, and how long in all
        self.lock = threading.Lock()


_HEALTH: dict[str, _Health] = {}
_HEALTH_LOCK = threading.Lock()


def _health(url: str) -> _Health:
    with _HEALTH_LOCK:
        return _HEALTH.setdefault(url, _Health())


def client(url: str, timeout_s: float = TIMEOUT_S) -> Any:
    """A synchronous client that waits at most `timeout_s` for anything and never retries by itself
    (redis-py retries a failed connection 10 times by default, seconds held each time)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 0))


class RedisCache:
    def __init__(self, url: str, timeout_s: float = TIMEOUT_S):
        self.url = url
        self.shown = redact(url)
        self._r = client(url, timeout_s)
        self._health = _health(url)
        if not self._health.down:  # checked now, while no call is in flight for it to hold up
            self._call(self._r.ping, None, LOOKUP, slow=False)

    def _call(self, op: Callable[[], Any], default: Any, what: str, slow: bool = True) -> Any:
        """op() on the server; `default` at once, without waiting on it, while it is down.
        `slow`: whether a slow answer counts towards marking it down (not the first connection's)."""
        from redis.exceptions import RedisError

        if self._health.down:
            self._probe_later()
            return default
        t = time.monotonic()
        try:
            result = op()
        except (RedisError, OSError) as e:
            _mark_down(self.url, str(e) or type(e).__name__, refusal(e, self.url), what)
            return default
        took = time.monotonic() - t
        if slow and took > SLOW_S and self._too_slow(took):
            _mark_down(self.url, f"slow round trips held the run {self._health.slow_total:.1f} s", None, what)
        return result

    def _too_slow(self, took: float) -> bool:
        health = self._health
        with health.lock:
            now = time.monotonic()
            if now - health.slow_since > SLOW_WINDOW_S:
                health.slow_since, health.slow_total = now, 0.0
            health.slow_total += took
            return health.slow_total > SLOW_BUDGET_S

    def _probe_later(self) -> None:
        """Once the cool-down has passed, PING the server from another thread: the run never waits."""
        health = self._health
        with health.lock:
            if health.probing or time.monotonic() < health.retry_at:
                return
            health.probing = True
        threading.Thread(target=self._probe, name="conductor-cache-ping", daemon=True).start()

    def _probe(self) -> None:
        health = self._health
        back = False
        try:
            t = time.monotonic()
            self._r.ping()
            back = time.monotonic() - t <= SLOW_S
        except Exception:  # noqa: BLE001 - any failure: still down
            pass
        with health.lock:
            health.probing = False
            if back:
                health.down, health.slow_total = False, 0.0
            else:
                health.retry_at = time.monotonic() + COOL_DOWN_S
        if back:
            log.info("shared cache %s answers again: used from now on", self.shown)

    def get(self, key: str) -> Entry | None:
        raw = self._call(lambda: self._r.get(PREFIX + key), None, LOOKUP)
        return None if raw is None else read_entry(raw)

    def get_many(self, keys: list[str]) -> dict[str, Entry]:
        """The entries of those keys that are cached, a few hundred keys a round trip (MGET)."""
        found: dict[str, Entry] = {}
        for i in range(0, len(keys), KEYS_PER_MGET):
            part = keys[i:i + KEYS_PER_MGET]
            raws = self._call(lambda: self._r.mget([PREFIX + k for k in part]), None, LOOKUP)
            if raws is None:
                break
            for k, raw in zip(part, raws):
                entry = read_entry(raw) if raw is not None else None
                if entry is not None:
                    found[k] = entry
        return found

    def put(self, key: str, model: str, entry: Entry) -> None:
        """The answer is in the run's own cache and journal whatever happens here."""
        self._call(lambda: self._r.set(PREFIX + key, orjson.dumps(entry.__dict__)), None, KEEP)

    def flush(self) -> None:
        """Nothing to do: each put is already on the server (the SQLite cache batches)."""

    def __len__(self) -> int:
        return self._call(lambda: sum(1 for _ in self._r.scan_iter(PREFIX + "*", count=1000)), 0, LOOKUP)

    def close(self) -> None:
        self._r.close()


def cache_location(default_path: str | Path, pool=None) -> str | Path:
    """Where the shared response cache is: CONDUCTOR_CACHE (a redis:// URL or a file path); else,
    with a shared governor, the governor's server; else the SQLite file at `default_path`."""
    from conductor.execute.shared.url import governor_url

    url = cache_setting()
    if not url:
        gov = governor_url(getattr(pool, "governor", None)) if pool is not None else "memory://"
        url = gov if gov.startswith(("redis://", "rediss://")) else None
    return url or Path(default_path)


def open_cache(default_path: str | Path, pool=None) -> Cache | RedisCache:
    where = cache_location(default_path, pool)
    if isinstance(where, str) and where.startswith(("redis://", "rediss://")):
        return RedisCache(where)
    return Cache(where)


def check_file_cache(default_path: str | Path, pool=None) -> None:
    """A SQLite cache file that is there but not a cache is named before the run folder is
    written: found by execution, it left a run behind, planned and never executed."""
    where = cache_location(default_path, pool)
    if not (isinstance(where, str) and "://" in where) and Path(where).exists():
        Cache(where).close()


def _mark_down(url: str, why: str, refused: str | None, what: str) -> None:
    """Stop waiting on the server at `url` for a cool-down; warn the first time only."""
    health = _health(url)
    with health.lock:
        health.down, health.retry_at = True, time.monotonic() + COOL_DOWN_S
        if health.warned:  # once: a run of a million rows would print it a million times
            return
        health.warned = True
    state = f"refused {refused} in its URL" if refused else "unreachable or too slow"
    log.warning("shared cache %s %s (%s): %s; it is not waited on again in this run unless it answers "
                "a PING in the background", redact(url), state, why, what)


def probe(url: str, timeout_s: float = TIMEOUT_S) -> str | None:
    """Check the cache server before a run: what it refused in the URL (the password, the database
    number), for the caller to stop on; None otherwise. Unreachable, it is marked down with one
    warning, and the run goes on with its own cache (as with a cache that fails mid-run)."""
    from redis.exceptions import RedisError

    r = client(url, timeout_s)
    try:
        r.ping()
    except (RedisError, OSError) as e:
        refused = refusal(e, url)
        if refused is None:
            _mark_down(url, str(e) or type(e).__name__, None, LOOKUP)
        return refused
    finally:
        r.close()
    return None
