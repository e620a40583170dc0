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
import pyarrow.parquet as pq

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
Served = tuple[Row, list[float] | None, str | None]  # a cache-served call: its row, recorded price and mode


def served_prices(run_id: str, prices: Prices, pool: Pool, traces: Path) -> Prices:
    """`prices` (the run's pool file's), with a worker's price replaced by the one its
    cache-served calls were first paid at when that differs and covers most of its paid calls.

    A cache hit logs the answer's first-paid cost (traces.original_cost_usd), which training
    fits; after a price change those costs are at the old price. Its trace row says the price
    and mode (online or batch) the answer was paid at (input_price, output_price, paid_mode),
    kept with the cached answer: that price is taken, so calls paid at several prices are told
    apart and said. Answers cached before prices were kept have none: for those the price is
    read back from their costs (`_read_back`)."""
    served, fresh = _paid_calls(traces)
    out = dict(prices)
    said: list[str] = []
    for w, p in prices.items():
        calls = served.get(w)
        if p is None or not calls or not pool.has(w) or _recorded_costs(pool, w):
            continue
        provider = pool.providers.get(pool.worker(w).provider)
        factor = provider.batch_price_factor if provider else Provider.batch_price_factor
        groups = _by_price([c for c in calls if c[1] is not None and not artifacts.same_price(c[1], p)])
        unread = [c[0] for c in calls if c[1] is None]  # cached before prices were kept
        other = [r for r in unread if not (_fits(p, r) or _fits(_times(p, factor), r))]
        n_other = sum(len(g) for _, g in groups) + len(other)
        if not n_other:
            continue
        at_pool = fresh.get(w, 0) + len(calls) - n_other
        what = (f"{w}: {n_other} of its {n_other + at_pool} paid calls were" if at_pool else
                f"{w}: its {n_other} paid calls were all") + " served from the response cache at the cost first paid"
        pool_price = f"the run's pool price {artifacts.usd_pair(p)}"
        found = [(price, len(g), sum(c[0][2] for c in g), _recorded_how(g, price)) for price, g in groups]
        why = None
        if other:
            paid, why = _read_back(other, p, factor, provider)
            if paid is not None:
                read = (paid, len(other), sum(r[2] for r in other), _how(other, paid, factor, provider,
                                                                         _one_mix(other)))
                same = [i for i, f in enumerate(found) if artifacts.same_price(f[0], paid)]
                if same:  # the price newer answers recorded: one group, counted together (review43b 4)
                    i = same[0]
                    found[i] = (found[i][0], found[i][1] + read[1], found[i][2] + read[2], found[i][3])
                else:
                    found.append(read)
        if not found:
            said.append(f"{what}, not at {pool_price}; {why}, and the artifact keeps {artifacts.usd_pair(p)}")
            continue
        # the price most paid calls were paid at (the pool's on a tie, then the one of more cost)
        best = max([(p, at_pool, 0.0, "")] + found, key=lambda f: (f[1], f[0] is p, f[2]))
        tied = sum(1 for f in found if f[1] == best[1]) > 1 and best[0] is not p and best[1] > at_pool
        out[w] = best[0]
        if len(found) == 1 and why is None:
            paid, _, _, how = found[0]
            where = f"at {artifacts.usd_pair(paid)}{how}"
        else:
            where = "at several prices: " + ", ".join(
                f"{artifacts.usd_pair(price)} ({_n(n)}{'; ' + how[2:-1] if how else ''})" for price, n, _, how in found)
            if why is not None:
                where += f", and {_n(len(other))} at a price that cannot be told ({why})"
        most = "the price most of them were paid at" + (" (of those tied, the one of most cost)" if tied else "")
        said.append(f"{what}, {where}, not {pool_price}"
                    + (f" (the other {at_pool} were paid at it); the artifact takes {artifacts.usd_pair(out[w])}, "
                       f"{most}" if at_pool else
                       f"; the artifact takes {artifacts.usd_pair(out[w])}"
                       + (f", {most}" if len(found) > 1 else "")))
    if said:
        print(f"conductor: warning: run {run_id}: {'; '.join(said)} (USD per million input/output tokens). Training "
              f"fits the logged costs; to log costs at the pool's prices, run the rollouts with a --data-dir whose "
              f"response cache does not hold these answers", file=sys.stderr, flush=True)
    return out


def _n(calls: int) -> str:
    return "1 call" if calls == 1 else f"{calls} calls"


def _by_price(calls: list[Served]) -> list[tuple[list[float], list[Served]]]:
    """The calls grouped by their recorded price, in order of first appearance."""
    groups: list[tuple[list[float], list[Served]]] = []
    for c in calls:
        for price, g in groups:
            if artifacts.same_price(price, c[1]):
                g.append(c)
                break
        else:
            groups.append((list(c[1]), [c]))  # type: ignore[arg-type]
    return groups


def _recorded_how(calls: list[Served], price: list[float]) -> str:
    """How calls recorded at `price` were paid, when not plainly online: the batch price the first
    batch call paid (from its cost: the provider's batch_price_factor may have changed since)."""
    batch = [c[0] for c in calls if c[2] == "batch"]
    if not batch:
        return ""
    pt, ct, usd = _reference(batch)
    listed = pt * price[0] + ct * price[1]
    share = f" {artifacts.usd_pair(_times(price, usd / listed))}" if listed > 0 else ""
    return f" (bought through batch: {'all' if len(batch) == len(calls) else len(batch)} at its batch price{share})"


def _read_back(rows: list[Row], p: list[float], factor: float,
               provider: Provider | None) -> tuple[list[float] | None, str | None]:
    """For cache-served calls with no recorded price (cached before prices were kept), not at the
    pool price `p`: the price read back from their costs (cost = prompt x input + completion x
    output, solved over the calls), else None and why it cannot be told. A cost at the pool price,
    online or at the provider's batch price, is taken as paid at it, so a run without a price
    change records its pool's prices unchanged. As the pool's, the price read back is the online
    (list) one, so a batch call's cost counts at list x batch_price_factor. Calls all of one token
    mix give one equation for two prices: the pool price scaled to their cost is taken (exact when
    both prices moved by one factor), and said. Two calls of different mixes always solve to some
    price, even when paid at two: the recorded price has no such limit."""
    # Which reading comes first when every call fits both (all at one price): batch calls
    # when the provider sends through batch, else online calls.
    scales = [factor, 1.0] if provider is not None and provider.mode == "batch" else [1.0, factor]
    scales = [k for k in scales if k > 0]
    one_mix = _one_mix(rows)
    paid = _scaled(rows, p, factor, scales) if one_mix else _solve(rows, factor, scales)
    if paid is not None:
        return paid, None
    return None, (f"the price they were paid at cannot be told from {_calls(rows)} (one equation for an input and "
                  f"an output price" + (", and their costs are not one multiple of the pool price)"
                                        if len(rows) > 1 else ")")
                  if one_mix else "nor at any one price (answers first paid at several prices), so the price they "
                                  "were paid at cannot be told")


def _how(rows: list[Row], paid: list[float], factor: float, provider: Provider | None, one_mix: bool) -> str:
    """How `paid` was read from `rows`, when not plainly: batch calls, or scaled from the pool price."""
    notes = []
    if one_mix:
        notes.append(f"{_calls(rows)} cannot tell an input from an output price, so this is the run's pool price "
                     f"scaled to their cost, exact if both prices moved by one factor")
    batch = sum(1 for r in rows if not _fits(paid, r))
    if batch:
        notes.append(f"{'all' if batch == len(rows) else batch} at its batch price "
                     f"{artifacts.usd_pair(_times(paid, factor))}"
                     + (f", taken as batch calls: provider {provider.id} has mode: batch"
                        if batch == len(rows) and provider is not None else ""))
    return f" ({'; '.join(notes)})" if notes else ""


def _calls(rows: list[Row]) -> str:
    return "1 call" if len(rows) == 1 else f"{len(rows)} calls all of one token mix"


def _paid_calls(traces: Path) -> tuple[dict[str, list[Served]], dict[str, int]]:
    """Per worker: its cache-served calls with a first-paid cost, and how many other calls it paid.
    A run's traces from before prices were kept lack their columns: none is recorded there."""
    kept = {"input_price", "output_price", "paid_mode"} <= set(pq.read_schema(traces).names)
    con = duckdb.connect(":memory:")
    try:
        rows = con.execute(f"""
            SELECT worker, coalesce(cache_hit, false), prompt_tokens, completion_tokens, original_cost_usd,
                   {"input_price, output_price, paid_mode" if kept else "NULL, NULL, NULL"}
            FROM read_parquet(?)
            WHERE coalesce(original_cost_usd, cost_usd) IS NOT NULL AND status <> 'skipped'""",
                           [str(traces)]).fetchall()
    finally:
        con.close()
    served: dict[str, list[Served]] = {}
    fresh: dict[str, int] = {}
    for w, hit, pt, ct, usd, pin, pout, mode in rows:
        if hit and usd is not None and pt is not None and ct is not None:
            price = [float(pin), float(pout)] if pin is not None and pout is not None else None
            served.setdefault(w, []).append(((int(pt), int(ct), float(usd)), price, mode))
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


def _times(price: list[float], k: float) -> list[float]:
    return [price[0] * k, price[1] * k]


def _stated(x: float) -> float:
    """Rounded to 10 significant digits per million tokens, as a pool file states a price."""
    return float(f"{max(x, 0.0) * 1e6:.10g}") / 1e6


def _each_fits(price: list[float], rows: list[Row], factor: float) -> bool:
    """Every row paid at `price`, online or at its batch price."""
    batch = _times(price, factor)
    return all(_fits(price, r) or _fits(batch, r) for r in rows)


def _one_mix(rows: list[Row]) -> bool:
    """Every row's prompt:completion tokens alike (or a single row): one equation for two prices."""
    pt0, ct0, _ = _reference(rows)
    return all(pt * ct0 == ct * pt0 for pt, ct, _ in rows)


def _reference(rows: list[Row]) -> Row:
    """A row with tokens (one without tells nothing of the price)."""
    return next((r for r in rows if r[0] or r[1]), rows[0])


def _solve(rows: list[Row], factor: float, scales: list[float]) -> list[float] | None:
    """The one [input, output] USD per token (list price) every row's cost is paid at, online or
    at its batch price, or None: the rows disagree. Solved from the first row and the one of the
    most different token mix, each read as paid at list x scale, then checked on every row."""
    pt0, ct0, c0 = _reference(rows)
    pt1, ct1, c1 = max(rows, key=lambda r: abs(pt0 * r[1] - r[0] * ct0) / (math.hypot(r[0], r[1]) or 1))
    det = pt0 * ct1 - pt1 * ct0
    for k0 in scales:
        for k1 in scales:
            u0, u1 = c0 / k0, c1 / k1
            price = [_stated((u0 * ct1 - u1 * ct0) / det), _stated((pt0 * u1 - pt1 * u0) / det)]
            if _each_fits(price, rows, factor):
                return price
    return None


def _scaled(rows: list[Row], pool_price: list[float], factor: float, scales: list[float]) -> list[float] | None:
    """For rows all of one token mix: the pool price times the one multiple every row's cost is
    of it (online or at its batch price), or None: they are at several, or the pool price is 0."""
    pt, ct, usd = _reference(rows)
    at_pool = pt * pool_price[0] + ct * pool_price[1]
    if at_pool <= 0:
        return None
    for k in scales:
        price = [_stated(x) for x in _times(pool_price, usd / at_pool / k)]
        if _each_fits(price, rows, factor):
            return price
    return None


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
