"""What `policy train` checks about its inputs before and after reading the runs.

Before: the policy root (`--out`), so a file or an unwritable folder is said before minutes
of fitting, not after. After reading the runs: the prices their costs were paid at, which
the artifact must record (a later price warning compares against them, not `--pool`'s).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from conductor.errors import ConductorError
from conductor.policy import artifact as artifacts
from conductor.pool import Pool

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


def run_prices(run_id: str, manifest: dict[str, Any], theirs: Pool | None) -> Prices | None:
    """The prices run `run_id` was planned and paid at: its pool file's, when that file is the
    one the run recorded (the manifest's pool_planning hash still matches); else None (unknown)."""
    if theirs is None:
        return None
    recorded = (manifest.get("inputs") or {}).get("pool_planning")
    if recorded is not None and theirs.planning_hash() != recorded:
        print(f"conductor: warning: run {run_id}: its pool file {theirs.path} changed since the run (its "
              f"descriptions, skills or prices differ from what the run recorded), so the prices its costs were "
              f"paid at are unknown; the artifact records --pool's for it", file=sys.stderr, flush=True)
        return None
    return artifacts.prices(theirs)


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
              f"--pool's prices, run rollouts under them and train on those runs", file=sys.stderr, flush=True)
    return out
