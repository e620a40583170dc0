"""The response cache on the shared server, keyed exactly as the SQLite one
(conductor.execute.cache.cache_key): a job run again on any machine is served
from it. The per-run cache and journal that resume relies on stay in the run folder.

The interface is the SQLite Cache's (get, get_many, put, len, close), synchronous: one
round trip on a local network is well under a millisecond.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import orjson

from conductor.execute.cache import Cache, Entry, read_entry
from conductor.execute.shared.url import redact

log = logging.getLogger("conductor.cache")
ENV = "CONDUCTOR_CACHE"
PREFIX = "conductor:cache:"


class RedisCache:
    def __init__(self, url: str):
        import redis

        self.url = url
        self.shown = redact(url)
        self._r = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)
        self._warned = False

    def _unreachable(self, what: str, e: Exception) -> None:
        if not self._warned:  # once: a run of a million rows would print it a million times
            log.warning("shared cache %s unreachable (%s): %s", self.shown, e, what)
            self._warned = True

    def get(self, key: str) -> Entry | None:
        from redis.exceptions import RedisError

        try:
            raw = self._r.get(PREFIX + key)
        except RedisError as e:
            self._unreachable("answers are looked up in this run's own cache only", e)
            return None
        return None if raw is None else read_entry(raw)

    def get_many(self, keys: list[str]) -> dict[str, Entry]:
        """The entries of those keys that are cached, in one round trip (MGET)."""
        from redis.exceptions import RedisError

        if not keys:
            return {}
        try:
            raws = self._r.mget([PREFIX + k for k in keys])
        except RedisError as e:
            self._unreachable("answers are looked up in this run's own cache only", e)
            return {}
        found = {k: read_entry(raw) for k, raw in zip(keys, raws) if raw is not None}
        return {k: e for k, e in found.items() if e is not None}

    def put(self, key: str, model: str, entry: Entry) -> None:
        from redis.exceptions import RedisError

        try:
            self._r.set(PREFIX + key, orjson.dumps(entry.__dict__))
        except RedisError as e:  # the answer is still in the run's own cache and journal
            self._unreachable("new answers are kept in this run's own cache only", e)

    def flush(self) -> None:
        """Nothing to do: each put is already on the server (the SQLite cache batches)."""

    def __len__(self) -> int:
        return sum(1 for _ in self._r.scan_iter(PREFIX + "*", count=1000))

    def close(self) -> None:
        self._r.close()


def open_cache(default_path: str | Path, pool=None) -> Cache | RedisCache:
    """The shared response cache: CONDUCTOR_CACHE (a redis:// URL or a file path); else, with a
    shared governor, the governor's server; else the SQLite file at `default_path`."""
    from conductor.execute.shared.url import governor_url

    url = os.environ.get(ENV)
    if not url:
        gov = governor_url(getattr(pool, "governor", None)) if pool is not None else "memory://"
        url = gov if gov.startswith(("redis://", "rediss://")) else None
    if url and url.startswith(("redis://", "rediss://")):
        return RedisCache(url)
    return Cache(url or default_path)
