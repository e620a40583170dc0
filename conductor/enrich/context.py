"""Context windows: a prompt longer than a worker's window is refused before any
call, naming the rows (direct mode: before anything; planned mode: after
planning, for the worker each plan gives the row to)."""

from __future__ import annotations

from typing import Any

import pyarrow.parquet as pq

from conductor.enrich.job import Job
from conductor.records import schema_block
from conductor.errors import ConductorError, InputError
from conductor.tokens import estimate_tokens
from conductor.pool import Pool, Worker


def context_window(worker: Worker) -> int | None:
    """The worker's context window in tokens: the pool's context_tokens, else litellm's model info."""
    if worker.context_tokens:
        return worker.context_tokens
    try:
        import litellm

        info = litellm.get_model_info(worker.model)
    except Exception:  # noqa: BLE001 - a model litellm does not know: no limit to check
        return None
    return info.get("max_input_tokens") or info.get("max_tokens")


def _too_long(job: Job, worker: Worker, prompts: list[str]) -> list[int]:
    window = context_window(worker)
    if window is None:
        return []
    extra = estimate_tokens([{"content": schema_block(job.schema)}]) if job.schema else 0
    return [i for i, p in enumerate(prompts) if estimate_tokens([{"role": "user", "content": p}]) + extra > window]


def check_context(job: Job, pool: Pool, ids: list, prompts: list[str]) -> None:
    """Direct mode: refuse, before any call, rows whose prompt exceeds the worker's window.
    `ids`: the id column as the input holds it, so that 7 is not quoted as '7'."""
    if job.mode != "direct":
        return
    worker = pool.worker(job.worker)
    bad = _too_long(job, worker, prompts)
    if bad:
        raise InputError(f"job {job.path}: {len(bad)} row(s) have a prompt longer than worker {worker.id}'s "
                         f"context window ({context_window(worker)} tokens): {job.id_column} "
                         f"{', '.join(repr(ids[i]) for i in bad[:5])}{' and more' if len(bad) > 5 else ''}")


def check_planned_context(job: Job, pool: Pool, prepared, row_ids: dict[str, Any] | None = None) -> None:
    """Planned mode: refuse, before executing, plans that give a row to a worker too small for it.
    `row_ids`: query id to the id as the input holds it."""
    q = prepared.queries
    prompts = q.column("prompt").to_pylist()
    ids = [(row_ids or {}).get(i, i) for i in q.column("query_id").to_pylist()]
    plans = pq.read_table(prepared.dir.table("plans"), columns=["query_index", "workers"]).to_pylist()
    problems = []
    for w in pool.workers:
        if w.kind != "llm":
            continue
        rows = {p["query_index"] for p in plans if w.id in (p["workers"] or ())}
        bad = [i for i in _too_long(job, w, [prompts[i] for i in sorted(rows)])]
        if bad:
            listed = [ids[sorted(rows)[i]] for i in bad]
            problems.append(f"worker {w.id} ({context_window(w)} tokens): {job.id_column} "
                            f"{', '.join(map(repr, listed[:5]))}{' and more' if len(listed) > 5 else ''}")
    if problems:
        raise ConductorError(f"job {job.path}: prompts longer than the context window of the worker their plan "
                             f"gives them to (plans are saved; nothing was sent): " + "; ".join(problems))
