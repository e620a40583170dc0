"""State that several processes or machines share: the governor (rate limits,
calls in flight, budgets) and the response cache, on a Redis server.

The in-process governor (conductor.execute.limits / budget) stays the default;
a `governor:` URL in the pool file or CONDUCTOR_GOVERNOR chooses this one.
"""

from conductor.shared.url import GovernorUnavailable, governor_url, redact

__all__ = ["GovernorUnavailable", "governor_url", "redact"]


def build_governor(pool, run_budget_usd, spent):
    """(limiters per provider, ledger, closer) for a pool: in-process by default, or on
    the server the governor URL names. `closer` is None or an async close()."""
    import os

    from conductor.execute.budget import Ledger
    from conductor.execute.limits import ProviderLimiter

    url = governor_url(getattr(pool, "governor", None))
    if url.startswith("memory://"):
        return ({pid: ProviderLimiter(p) for pid, p in pool.providers.items()},
                Ledger({pid: p.budget_usd for pid, p in pool.providers.items()}, run_budget_usd, spent), None)
    from conductor.shared.governor import RedisGovernor, SharedLedger, SharedLimiter

    gov = RedisGovernor(url, os.environ.get("CONDUCTOR_BUDGET_SCOPE") or "default")
    return ({pid: SharedLimiter(gov, p) for pid, p in pool.providers.items()},
            SharedLedger(gov, pool.providers, run_budget_usd, spent), gov.close)
