"""What `policy train` checks about its inputs before and after reading the runs.

Before: the policy root (`--out`), so a file or an unwritable folder is said before minutes
of fitting, not after. After reading the runs: the prices their costs were paid at, which
the artifact must record (a later price warning compares against them, not `--pool`'s).
A call served from the response cache carries the cost first paid for its answer, so a run
made after a price change can hold costs paid at the old price: its traces say which.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import duckdb

from conductor.errors import ConductorError
from conductor.policy import artifact as artifacts
from conductor.pool import Pool, Provider

Prices = dict[str, list[float] | None]


def check_out(root: Path, flag: str = "--out") -> None:
    """The policy root can hold a new version folder: not a file, nor under one, and writable."""
    path = Path(root)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        what = "is a file" if probe == path else f"is under {probe}, a file"
        raise ConductorError(f"{flag} {root}: {what}; give a folder (the policy root, where <pool key>/vNNNN/ "
                             f"is written). Nothing was trained")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise ConductorError(f"{flag} {root}: cannot write in {probe} (permission denied); give a folder you can "
                             f"write. Nothing was trained")


def run_prices(run_id: str, manifest: dict[str, Any], theirs: Pool | None,
               traces: Path | None = None) -> Prices | None:
    """The prices run `run_id` was planned and paid at: its pool file's, when that file is the
    one the run recorded (the manifest's pool_planning hash still matches), except where its
    cache-served calls were paid at another (`served_prices`, from `traces`); else None (unknown)."""
    if theirs is None:
        return None
    recorded = (manifest.get("inputs") or {}).get("pool_planning")
    if recorded is not None and theirs.planning_hash() != recorded:
        print(f"conductor: warning: run {run_id}: its pool file {theirs.path} changed since the run (its "
              f"descriptions, skills or prices differ from what the run recorded), so the prices its costs were "
              f"paid at are unknown; the artifact records --pool's for it", file=sys.stderr, flush=True)
        return None
    out = artifacts.prices(theirs)
    return served_prices(run_id, out, theirs, traces) if traces is not None and traces.exists() else out


Row = tuple[int, int, float]  # prompt tokens, completion tokens, USD


def served_prices(run_id: str, prices: Prices, pool: Pool, traces: Path) -> Prices:
    """`prices` (the run's pool file's), with a worker's price replaced by the one its
    cache-served calls were first paid at when that differs and covers most of its paid calls.

    A cache hit logs the answer's first-paid cost (traces.original_cost_usd), which training
    fits; after a price change those costs are at the old price. The price is read back from
    them (cost = prompt x input + completion x output, solved over the calls). A cost at the
    pool price, online or at the provider's batch price, is taken as paid at it, so a run
    without a price change records its pool's prices unchanged. Replay workers charged the
    table's recorded costs are left at the pool price: their cost never followed it."""
    served, fresh = _paid_calls(traces)
    out = dict(prices)
    said: list[str] = []
    for w, p in prices.items():
        rows = served.get(w)
        if p is None or not rows or not pool.has(w) or _recorded_costs(pool, w):
            continue
        provider = pool.providers.get(pool.worker(w).provider)
        factor = provider.batch_price_factor if provider else Provider.batch_price_factor
        other = [r for r in rows if not (_fits(p, r) or _fits([p[0] * factor, p[1] * factor], r))]
        if not other:
            continue
        at_pool = fresh.get(w, 0) + len(rows) - len(other)
        paid = _solve(other)
        what = (f"{w}: {len(other)} of its {len(other) + at_pool} paid calls were" if at_pool else
                f"{w}: its {len(other)} paid calls were all") + " served from the response cache at the cost first paid"
        pool_price = f"the run's pool price {artifacts.usd_pair(p)}"
        if paid is None:
            said.append(f"{what}, not at {pool_price} nor at any one price (answers first paid at several prices), "
                        f"so the price they were paid at cannot be told and the artifact keeps {artifacts.usd_pair(p)}")
            continue
        if len(other) > at_pool:
            out[w] = paid
        said.append(f"{what}, at {artifacts.usd_pair(paid)}, not {pool_price}"
                    + (f" (the other {at_pool} were paid at it); the artifact takes {artifacts.usd_pair(out[w])}, "
                       f"the price most of them were paid at" if at_pool else
                       f"; the artifact takes {artifacts.usd_pair(paid)}"))
    if said:
        print(f"conductor: warning: run {run_id}: {'; '.join(said)} (USD per million input/output tokens). Training "
              f"fits the logged costs; to log costs at the pool's prices, run the rollouts with a --data-dir whose "
              f"response cache does not hold these answers", file=sys.stderr, flush=True)
    return out


def _paid_calls(traces: Path) -> tuple[dict[str, list[Row]], dict[str, int]]:
    """Per worker: its cache-served calls with a first-paid cost, and how many other calls it paid."""
    con = duckdb.connect(":memory:")
    try:
        rows = con.execute("""
            SELECT worker, coalesce(cache_hit, false), prompt_tokens, completion_tokens, original_cost_usd
            FROM read_parquet(?)
            WHERE coalesce(original_cost_usd, cost_usd) IS NOT NULL AND status <> 'skipped'""",
                           [str(traces)]).fetchall()
    finally:
        con.close()
    served: dict[str, list[Row]] = {}
    fresh: dict[str, int] = {}
    for w, hit, pt, ct, usd in rows:
        if hit and usd is not None and pt is not None and ct is not None:
            served.setdefault(w, []).append((int(pt), int(ct), float(usd)))
        elif not hit:
            fresh[w] = fresh.get(w, 0) + 1
    return served, fresh


def _recorded_costs(pool: Pool, w: str) -> bool:
    """A replay worker charged its table's recorded cost_usd (`conductor replay pool` gives it max_call_usd)."""
    replay = pool.replay or {}
    return str(replay.get("costs", "")).startswith("recorded") and pool.worker(w).max_call_usd is not None


def _fits(price: list[float], row: Row) -> bool:
    pt, ct, usd = row
    return math.isclose(pt * price[0] + ct * price[1], usd, rel_tol=1e-9, abs_tol=1e-15)


def _solve(rows: list[Row]) -> list[float] | None:
    """The one [input, output] USD per token every row's cost is paid at, or None: the rows
    disagree, or their token mixes are all alike (one equation for two prices)."""
    a = sum(pt * pt for pt, _, _ in rows)
    b = sum(pt * ct for pt, ct, _ in rows)
    d = sum(ct * ct for _, ct, _ in rows)
    e = sum(pt * usd for pt, _, usd in rows)
    f = sum(ct * usd for _, ct, usd in rows)
    det = a * d - b * b
    if det <= 1e-9 * a * d:
        return None
    # Rounded to 10 significant digits per million tokens, as a pool file states a price.
    price = [float(f"{max(x, 0.0) * 1e6:.10g}") / 1e6 for x in ((e * d - b * f) / det, (a * f - b * e) / det)]
    return price if all(_fits(price, r) for r in rows) else None


def fitted_prices(by_run: dict[str, Prices | None], pool: Pool, pool_path: Path) -> Prices:
    """Per worker of `pool`, the price the runs' costs were paid at (`pool`'s where no run says).
    Training fits on the logged costs (traces.original_cost_usd), so these are the prices its
    lambda trade-offs hold for. A difference from --pool is said, naming workers and prices."""
    ours = artifacts.prices(pool)
    out: Prices = dict(ours)
    differ: list[str] = []
    for w in ours:
        seen = {run: p[w] for run, p in by_run.items() if p is not None and w in p}
        if not seen:
            continue
        first = next(iter(seen.values()))
        out[w] = first
        if any(not artifacts.same_price(p, first) for p in seen.values()):
            differ.append(f"{w}: " + ", ".join(f"run {r} {artifacts.usd_pair(p)}" for r, p in seen.items()))
        elif not artifacts.same_price(first, ours[w]):
            differ.append(f"{w}: {artifacts.usd_pair(first)} in run(s) {', '.join(seen)}, "
                          f"{artifacts.usd_pair(ours[w])} in --pool")
    if differ:
        print(f"conductor: warning: the runs' costs were paid at other prices than --pool {pool_path} has (USD per "
              f"million input/output tokens): {'; '.join(differ)}. Training fits the logged costs, so the "
              f"artifact records the runs' prices, and planning with --pool's prices will say they changed; to fit "
              f"--pool's prices, run rollouts under them (a call served from the response cache keeps the cost first "
              f"paid) and train on those runs", file=sys.stderr, flush=True)
    return out
