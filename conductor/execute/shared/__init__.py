"""State that several processes or machines share: the governor (rate limits,
calls in flight, budgets) and the response cache, on a Redis server.

The in-process governor (conductor.execute.limits / budget) stays the default;
a `governor:` URL in the pool file or CONDUCTOR_GOVERNOR chooses this one.
"""

import re

from conductor.execute.shared.url import (GovernorDown, GovernorUnavailable, SharedURLError, governor_url,
                                          redact)

__all__ = ["GovernorDown", "GovernorUnavailable", "SharedURLError", "budget_scope", "check_shared_urls",
           "governor_url", "redact"]

CHECK_TIMEOUT_S = 3.0  # for each server, before the run: a hung one is told from a slow one's PING
SCOPE_ENV = "CONDUCTOR_BUDGET_SCOPE"
_SCOPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_warned_scopes: set[str] = set()  # CONDUCTOR_BUDGET_SCOPE values said to have no effect, once per process


def budget_scope() -> str:
    """CONDUCTOR_BUDGET_SCOPE, or "default": with a shared governor, the runs with the same scope
    share one total per provider's budget_usd (e.g. 2026-11 for a monthly budget). It is part of
    Redis keys, so a ':' or space in it could land in another scope's key: refused."""
    import os

    value = os.environ.get(SCOPE_ENV, "")
    if value == "":
        return "default"
    if not _SCOPE.fullmatch(value):
        shown = value if len(value) <= 80 else value[:80] + "..."
        raise SharedURLError(f"environment variable {SCOPE_ENV}={shown!r}: a budget scope is 1 to 64 letters, "
                             f"digits, '.', '_' or '-', starting with a letter or digit (e.g. 2026-11 for a "
                             f"monthly budget); fix it or unset it and rerun; nothing was called")
    return value


def build_governor(pool, run_budget_usd, spent):
    """(limiters per provider, ledger, closer) for a pool: in-process by default, or on
    the server the governor URL names. `closer` is None or an async close()."""
    from conductor.execute.budget import Ledger
    from conductor.execute.limits import ProviderLimiter

    url = governor_url(getattr(pool, "governor", None))
    if url.startswith("memory://"):
        return ({pid: ProviderLimiter(p) for pid, p in pool.providers.items()},
                Ledger({pid: p.budget_usd for pid, p in pool.providers.items()}, run_budget_usd, spent), None)
    from conductor.execute.shared.governor import RedisGovernor, SharedLedger, SharedLimiter

    gov = RedisGovernor(url, budget_scope())
    return ({pid: SharedLimiter(gov, p) for pid, p in pool.providers.items()},
            SharedLedger(gov, pool.providers, run_budget_usd, spent), gov.close)


def check_shared_urls(pool, cache: bool = True, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Before any call: the governor's URL and, when `cache` (no --no-cache), CONDUCTOR_CACHE,
    read and their servers reached. Without it a wrong password failed every plan as
    "unreachable", retried on each rerun, and a malformed URL was a traceback.

    Raises SharedURLError for a URL that cannot be used as written or whose server refuses its
    password or database number (naming where the URL comes from, the URL masked), GovernorDown
    for a governor that cannot be reached. An unreachable cache only warns, once: the run goes on."""
    from conductor.execute.shared.cache import probe
    from conductor.execute.shared.url import CACHE_ENV, REDIS_SCHEMES, cache_setting, governor_source

    url = governor_url(getattr(pool, "governor", None))
    shared = url.partition("://")[0] in REDIS_SCHEMES
    scope = budget_scope()
    if shared:
        _check_governor(url, governor_source(), timeout_s)
    elif scope != "default" and scope not in _warned_scopes:
        import sys

        _warned_scopes.add(scope)  # checked by the run and again by each stage: said once
        print(f"conductor: warning: {SCOPE_ENV}={scope} has no effect without a shared governor "
              f"(CONDUCTOR_GOVERNOR or governor: in the pool file): each run's provider budgets are its own",
              file=sys.stderr, flush=True)
    if not cache:
        return
    cache_url = cache_setting() or (url if shared else None)
    if cache_url is None or cache_url == url or cache_url.partition("://")[0] not in REDIS_SCHEMES:
        return  # a SQLite file (checked by cache_setting), or the governor's server, just reached
    refused = probe(cache_url, timeout_s)
    if refused:
        raise SharedURLError(f"environment variable {CACHE_ENV}: the Redis server at {redact(cache_url)} "
                             f"refused {refused} in the URL; fix it and rerun; nothing was called")


def _check_governor(url: str, where: str, timeout_s: float) -> None:
    """The governor's server answers a script (its every decision is one), with this password and database."""
    from redis.exceptions import RedisError

    from conductor.execute.shared.cache import client
    from conductor.execute.shared.url import refusal

    r = client(url, timeout_s)
    try:
        r.eval("return 1", 0)
    except (RedisError, OSError) as e:
        why = str(e) or type(e).__name__
        refused = refusal(e, url)
        if refused:
            raise SharedURLError(f"{where}: the shared governor at {redact(url)} refused {refused} in the URL "
                                 f"({why}); fix it and rerun; nothing was called") from None
        tls = " (a rediss:// URL for a server without TLS waits like this)" if url.startswith("rediss:") else ""
        raise GovernorDown(f"shared governor {redact(url)} ({where}) is unreachable ({why}){tls}: the run cannot "
                           f"go on without it, as it holds the rate limits and budgets; nothing was called. "
                           f"Start it, or fix the URL, and rerun the same command") from None
    finally:
        r.close()
