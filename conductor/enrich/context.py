"""Context windows: a prompt longer than a worker's window is refused before any
call, naming the rows (direct mode: before anything; planned mode: after
planning, for the worker each plan gives the row to)."""

from __future__ import annotations

from typing import Any

import pyarrow.parquet as pq

from conductor.enrich.job import Job
from conductor.records import schema_block
from conductor.errors import ConductorError, InputError
from conductor.tokens import CHARS_PER_TOKEN, estimate_tokens
from conductor.pool import Pool, Worker

_SHOW = 5  # ids named in a refusal; the rest are counted


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


def _schema_tokens(job: Job) -> int:
    return estimate_tokens([{"content": schema_block(job.schema)}]) if job.schema else 0


def _too_long(job: Job, worker: Worker, prompts: list[str]) -> list[tuple[int, int]]:
    """(index, tokens counted) of the prompts that do not fit: the prompt's estimate plus the schema
    block's, which the prompt carries when the schema cannot go by response_format."""
    window = context_window(worker)
    if window is None:
        return []
    extra = _schema_tokens(job)
    sized = ((i, estimate_tokens([{"role": "user", "content": p}]) + extra) for i, p in enumerate(prompts))
    return [(i, n) for i, n in sized if n > window]


def _counted(job: Job, bad: list[tuple[int, int]]) -> str:
    """What the refusal counted, so that a prompt well under the window is not a riddle."""
    what = (f"each rendered prompt plus the fields' JSON Schema block (about {_schema_tokens(job)} tokens, sent "
            f"in the prompt when the provider takes no response_format)" if job.schema else "each rendered prompt")
    return (f"counting {what}, at {CHARS_PER_TOKEN} characters a token; the longest is about "
            f"{max(n for _, n in bad)} tokens")


def _shown(values: list) -> str:
    """The first five, and how many more."""
    return ", ".join(map(repr, values[:_SHOW])) + (f" and {len(values) - _SHOW} more" if len(values) > _SHOW else "")


def check_context(job: Job, pool: Pool, ids: list, prompts: list[str]) -> None:
    """Direct mode: refuse, before any call, rows whose prompt exceeds the worker's window.
    `ids`: the id column as the input holds it, so that 7 is not quoted as '7'."""
    if job.mode != "direct":
        return
    worker = pool.worker(job.worker)
    bad = _too_long(job, worker, prompts)
    if bad:
        raise InputError(f"job {job.path}: {len(bad)} row(s) have a prompt longer than worker {worker.id}'s "
                         f"context window ({context_window(worker)} tokens), {_counted(job, bad)}: "
                         f"{job.id_column} {_shown([ids[i] for i, _ in bad])}; shorten their text or filter them "
                         f"out, or give the job a worker with a larger window")


def check_budget(job: Job, pool: Pool, ids: list, prompts: list[str]) -> None:
    """Direct mode: refuse rows whose one call costs more at its worst case than a budget it
    runs under (the job's budget_usd, its provider's): the executor refuses such a call every
    time, so the run would stop them as budget_exhausted and say "rerun to finish", which no
    rerun does. The figure is a floor of what the executor reserves (the prompt's bytes at the
    input price, max_tokens at the output price, or the worker's max_call_usd). `job check` passes
    every row (a fresh data folder sends them all); `job run` the rows it is about to send."""
    from conductor.execute.prices import resolve_price
    from conductor.pool import DEFAULT_MAX_TOKENS
    from conductor.tokens import max_prompt_tokens

    if job.mode != "direct":
        return
    worker = pool.worker(job.worker)
    provider = pool.providers.get(worker.provider)
    caps = []
    if job.budget_usd is not None:
        caps.append((f"the job's budget_usd (${job.budget_usd:g})", job.budget_usd))
    if provider is not None and provider.budget_usd is not None:
        caps.append((f"provider {worker.provider}'s budget_usd (${provider.budget_usd:g}) in pool {pool.path}",
                     provider.budget_usd))
    price = resolve_price(worker)
    if not caps or price is None:  # an unpriced worker under a budget is load_job's refusal
        return
    max_tokens = worker.params.get("max_tokens", DEFAULT_MAX_TOKENS)
    name, limit = min(caps, key=lambda c: c[1])
    # The fields' schema (sent as response_format, or in the prompt) is the same for every row: a floor
    # of what each call sends beside its prompt, counted once
    beside = max_prompt_tokens([], {**worker.params, "response_format": job.schema})
    worst = [max((max_prompt_tokens([{"role": "user", "content": p}]) + beside) * price.input
                 + max_tokens * price.output, worker.max_call_usd or 0.0) for p in prompts]
    bad = [i for i, w in enumerate(worst) if w > limit + 1e-12]
    if bad:
        raise InputError(f"job {job.path}: {name} is below the worst case of one call for {len(bad)} row(s) "
                         f"(from ${min(worst[i] for i in bad):.6g}: the prompt's bytes at worker {worker.id}'s "
                         f"input price and max_tokens {max_tokens} at its output price"
                         f"{f', at least its max_call_usd ${worker.max_call_usd:g}' if worker.max_call_usd else ''}"
                         f"), so no run could send them: {job.id_column} {_shown([ids[i] for i in bad])}; raise "
                         f"the budget, or lower max_tokens in the worker's params")


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
        order = sorted(rows)
        bad = _too_long(job, w, [prompts[i] for i in order])
        if bad:
            longest = max(n for _, n in bad)
            problems.append(f"worker {w.id} ({context_window(w)} tokens; the longest about {longest}): "
                            f"{job.id_column} {_shown([ids[order[i]] for i, _ in bad])}")
    if problems:
        what = ("each prompt plus the fields' JSON Schema block (about "
                f"{_schema_tokens(job)} tokens)" if job.schema else "each prompt")
        raise ConductorError(f"job {job.path}: prompts longer than the context window of the worker their plan "
                             f"gives them to, counting {what} at {CHARS_PER_TOKEN} characters a token (plans are "
                             f"saved; nothing was sent): " + "; ".join(problems))
