"""Failed plans, made loud: their share against a threshold (a batch job with
nobody watching must not exit 0 when its provider was down), and a summary
grouped by worker and kind of failure, with the URL the worker calls."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from conductor.envsettings import env_number
from conductor.errors import ConductorError
from conductor.execute.journal import RETRY_TRANSIENT, STEPS_FILE, TRANSIENT_KINDS, retries_used_up
from conductor.execute.shared.url import failed_on_governor
from conductor.pool import Pool, shown_url

DEFAULT_MAX_FAILED_SHARE = 0.05
ENV_MAX_FAILED_SHARE = "CONDUCTOR_MAX_FAILED_SHARE"
NOT_FAILED = ("ok", "budget_exhausted")  # a budget stop has its own exit code and message


def max_failed_share(value: float | None = None) -> float:
    """The threshold: `value` (--max-failed-share), else $CONDUCTOR_MAX_FAILED_SHARE, else 5%."""
    if value is None:
        value = env_number(None, ENV_MAX_FAILED_SHARE, DEFAULT_MAX_FAILED_SHARE, "a share between 0 and 1",
                           lambda v: 0.0 <= v <= 1.0)
    if not 0.0 <= value <= 1.0:
        raise ConductorError(f"the largest share of failed plans must be between 0 and 1 (got {value})")
    return value


def failed_plans(statuses: dict[str, int]) -> tuple[int, int]:
    """(failed plans, all plans): failed is every status but ok and budget_exhausted."""
    total = sum(statuses.values())
    return total - sum(statuses.get(s, 0) for s in NOT_FAILED), total


def too_many_failed(statuses: dict[str, int], threshold: float) -> bool:
    failed, total = failed_plans(statuses)
    return total > 0 and failed / total > threshold


def failure_groups(traces: Path, pool: Pool, examples: int = 1) -> list[dict[str, Any]]:
    """Failed steps grouped by worker and kind: plans, whether a rerun retries them, the URL, an example."""
    t = pq.read_table(traces, columns=["plan_id", "worker", "status", "failure", "error"])
    work = Path(traces).parent / "work"
    used_up = retries_used_up(work)
    # A complete run whose work folder was deleted is final as it stands: no rerun executes it again
    gone = not (work / STEPS_FILE).exists()
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in t.to_pylist():
        if r["status"] in ("ok", "skipped"):
            continue
        kind = r["failure"] or ("budget" if r["status"] == "budget_exhausted" else "other")
        governor = _governor_url(r["error"])  # the call was never sent: not the provider's failure
        if governor is not None:
            kind = GOVERNOR
        g = groups.get((r["worker"], kind))
        if g is None:
            w = pool.worker(r["worker"]) if pool.has(r["worker"]) else None
            local = w is not None and w.kind == "function"
            g = groups[(r["worker"], kind)] = {
                "worker": r["worker"], "failure": kind,
                "url": governor if governor is not None else None if local else shown_url(w),
                "function": local,
                "model": w.model if w else None,
                "retried_on_rerun": (kind in TRANSIENT_KINDS or kind == GOVERNOR) and not gone,
                "journal_deleted": gone,
                "plans": set(), "example": " ".join((r["error"] or "").split())[:300]}
        g["plans"].add(r["plan_id"])
    out = [{**g, "plans": len(g["plans"]), "retries_used_up": len(g["plans"] & used_up) if g["retried_on_rerun"] else 0}
           for g in groups.values()]
    return sorted(out, key=lambda g: -g["plans"])


GOVERNOR = "governor"  # a failure group of steps the shared governor kept from being sent
_GOVERNOR_URL = re.compile(r"shared governor (\S+)")


def _governor_url(error: str | None) -> str | None:
    """The (password-masked) URL of the shared governor a step failed on before it was sent, else None."""
    if not failed_on_governor(error):
        return None
    m = _GOVERNOR_URL.search(error)
    return m.group(1) if m else "(the shared governor)"


def invalid_plan_groups(plans: Path, examples: int = 3) -> list[dict[str, Any]]:
    """The most common reasons plans were invalid (no step ran, so no trace says why), with counts;
    a sweep's unused slots are not failures."""
    from collections import Counter

    from conductor.planners.base import UNUSED_SLOT

    t = pq.read_table(plans, columns=["valid", "error"])
    why = Counter(" ".join((e or "no reason recorded").split())[:300] for v, e in
                  zip(t.column("valid").to_pylist(), t.column("error").to_pylist())
                  if not v and not (e or "").startswith(UNUSED_SLOT))
    return [{"error": e, "plans": n} for e, n in why.most_common(examples)]


def retried_by_rerun(g: dict[str, Any]) -> bool:
    """Whether a plain rerun sends some of the group's plans again (a budget stop needs a larger
    budget, a final failure --retry-failed, a deleted journal a new run, and a plan retried on
    RETRY_TRANSIENT reruns already --retry-failed too)."""
    return g["retried_on_rerun"] and g["failure"] != "budget" and g.get("retries_used_up", 0) < g["plans"]


def rerun_advice(g: dict[str, Any], rerun: str = "rerun", redo: str = "rerun with --retry-failed",
                 flag: str = "--retry-failed") -> str:
    """What the next rerun does with a failure group, in the front end's words (the CLI's by
    default; Dagster says rematerialization and its run config setting)."""
    used_up = g.get("retries_used_up", 0)
    if g.get("journal_deleted"):
        return (f"final: the run's work folder (its journal) was deleted, so no {rerun} executes them again; "
                f"start a new run (another run id) to retry them")
    if g.get("failure") == "budget":  # the same budget stops them again
        return f"a {rerun} with a larger budget finishes these"
    if g.get("function") and not g["retried_on_rerun"]:  # same inputs, same code: the same failure
        return (f"final: a function step fails the same way on every {rerun}, on the same inputs (its plan gave it "
                f"steps it cannot use: see the error; a new run's plans, or another planner, may not)")
    if not g["retried_on_rerun"]:
        return f"final ({redo})"
    if not used_up:
        return f"a {rerun} retries these"
    if used_up == g["plans"]:
        return f"final: retried on {RETRY_TRANSIENT} {rerun}s already ({redo})"
    return (f"a {rerun} retries {g['plans'] - used_up}; {used_up} were retried on {RETRY_TRANSIENT} {rerun}s "
            f"already ({flag} retries them)")


def where_it_ran(g: dict[str, Any]) -> str:
    """A failure group's worker's URL as the failure list shows it; a function step calls none,
    and a step the shared governor held back was never sent to its worker's URL."""
    if g["failure"] == GOVERNOR:
        return f"on the shared governor {g['url']} (no request sent to the provider)"
    return f"at {g['url']}" if g["url"] else "(a function, run locally)"


def format_failures(groups: list[dict[str, Any]], retried: bool = False) -> str:
    """One line per group; `retried`: this command had --retry-failed, so the final ones failed
    again under it, and advising it once more would read as if it had not been tried."""
    redo = "they failed again under --retry-failed: fix the cause first" if retried else "rerun with --retry-failed"
    lines = []
    for g in groups:
        lines.append(f"  worker {g['worker']} {where_it_ran(g)}: {g['failure']}, {g['plans']} plan(s); "
                     f"{rerun_advice(g, redo=redo)}\n    e.g. {g['example']}")
    return "\n".join(lines)
