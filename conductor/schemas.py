"""The output tables' schemas, in one place: the writers use them, the README
documents them, and the tests check files against them."""

import pyarrow as pa

TS = pa.timestamp("us", tz="UTC")

PLANS = pa.schema([
    ("run_id", pa.string()), ("plan_id", pa.string()), ("query_id", pa.string()),
    ("query_index", pa.int64()), ("sample", pa.int32()), ("task", pa.string()),
    ("planner", pa.string()), ("template_version", pa.string()),
    ("planner_prompt", pa.string()), ("raw_text", pa.string()),
    ("valid", pa.bool_()), ("error", pa.string()),
    ("steps_json", pa.string()), ("n_steps", pa.int32()), ("workers", pa.list_(pa.string())),
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
    ("logprob", pa.float64()), ("propensity", pa.float64()), ("info_json", pa.string()),
])

TRACES = pa.schema([
    ("run_id", pa.string()), ("plan_id", pa.string()), ("query_id", pa.string()),
    ("query_index", pa.int64()), ("sample", pa.int32()),
    ("step", pa.int32()), ("step_path", pa.string()), ("depth", pa.int32()),
    ("worker", pa.string()), ("model", pa.string()), ("provider", pa.string()),
    ("status", pa.string()), ("error", pa.string()), ("attempts", pa.int32()), ("cache_hit", pa.bool_()),
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("usage_estimated", pa.bool_()),
    ("cost_usd", pa.float64()), ("original_cost_usd", pa.float64()), ("latency_s", pa.float64()),
    ("started_at", TS), ("ended_at", TS),
    ("instruction", pa.string()), ("when", pa.string()), ("response_text", pa.string()),
    ("simulated", pa.bool_()),
    ("request_key", pa.string()), ("sub_plan", pa.string()), ("failure", pa.string()),
])

RESULTS = pa.schema([
    ("run_id", pa.string()), ("plan_id", pa.string()), ("query_id", pa.string()),
    ("query_index", pa.int64()), ("sample", pa.int32()),
    ("status", pa.string()), ("final_answer", pa.string()), ("error", pa.string()),
    ("cost_usd", pa.float64()), ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
    ("calls", pa.int32()), ("cache_hits", pa.int32()), ("wall_time_s", pa.float64()),
    ("started_at", TS), ("ended_at", TS),
])

REWARDS = pa.schema([
    ("run_id", pa.string()), ("plan_id", pa.string()), ("query_id", pa.string()),
    ("query_index", pa.int64()), ("sample", pa.int32()), ("task", pa.string()),
    ("status", pa.string()), ("reference", pa.string()), ("answer", pa.string()),
    ("parsed", pa.bool_()), ("correct", pa.bool_()), ("reward", pa.float64()),
    ("advantage", pa.float64()), ("cost_usd", pa.float64()),
])

TABLES = {"plans": PLANS, "traces": TRACES, "results": RESULTS, "rewards": REWARDS}


def duckdb_columns(schema: pa.Schema) -> dict[str, str]:
    """The same schema as DuckDB type names, for reading the JSON journal."""
    names = {pa.string(): "VARCHAR", pa.int64(): "BIGINT", pa.int32(): "INTEGER", pa.bool_(): "BOOLEAN",
             pa.float64(): "DOUBLE", TS: "TIMESTAMPTZ", pa.list_(pa.string()): "VARCHAR[]"}
    return {f.name: names[f.type] for f in schema}


DOCS = {
    "plans": {
        "run_id": "the run", "plan_id": "`<query_id>#<sample>`", "query_id": "the query",
        "query_index": "row of the query in its set", "sample": "0..K-1", "task": "grader of the query",
        "planner": "embedded, vllm or llm", "template_version": "version of the planner's prompt or templates",
        "planner_prompt": "what an LLM planner was asked (null for the embedded planner)",
        "raw_text": "the planner's output, verbatim", "valid": "the plan parsed and validated",
        "error": "why it did not", "steps_json": "the validated plan, normalized JSON",
        "n_steps": "number of steps", "workers": "worker of each step",
        "prompt_tokens": "planner prompt tokens (LLM planners)", "completion_tokens": "planner completion tokens",
        "logprob": "cumulative log-probability of the completion (LLM planners)",
        "propensity": "probability of this plan under the policy (embedded planner)",
        "info_json": "planner-specific details (template, expected accuracy and cost, finish reason)",
    },
    "traces": {
        "run_id": "the run", "plan_id": "the plan", "query_id": "the query", "query_index": "row of the query",
        "sample": "the plan's sample", "step": "top-level step index",
        "step_path": "`2`, or `2.0` for step 0 of the workflow that step 2 re-planned",
        "depth": "re-planning depth (0 at top level)", "worker": "worker id", "model": "litellm model string",
        "provider": "provider id",
        "status": "ok, error, budget_exhausted or skipped (its condition was false, or an earlier step failed)",
        "error": "what went wrong; for a skipped step, why (`condition disagree(0, 1) is false: steps 0, 1 agree`)",
        "attempts": "requests sent for this step (0: cache hit, restored, or not sent)",
        "cache_hit": "answered from the cache", "prompt_tokens": "as reported by the provider",
        "completion_tokens": "as reported by the provider", "usage_estimated": "tokens estimated (chars/4)",
        "cost_usd": ("paid for this step (0 for a cache hit or a step skipped by its condition, "
                     "null when the price is unknown)"),
        "original_cost_usd": "what the answer cost when it was first paid for",
        "latency_s": "duration of the successful request", "started_at": "step start (UTC)",
        "ended_at": "step end (UTC)", "instruction": "the step's instruction",
        "when": "the step's condition, e.g. `disagree(0, 1)` (null: the step always runs)",
        "response_text": "the worker's output", "simulated": "answered by the simulated pool (`conductor sim`); false for replayed answers, which are real recorded outputs",
        "request_key": "cache key: hash of model, api_base, messages and sampling parameters",
        "sub_plan": "the workflow a re-planning step ran, as JSON",
        "failure": "a failed step's kind of failure: connection, timeout, server, rate_limit (a rerun retries "
                   "these), budget, auth, not_found, client, malformed, config, other",
    },
    "results": {
        "run_id": "the run", "plan_id": "the plan", "query_id": "the query", "query_index": "row of the query",
        "sample": "the plan's sample", "status": "ok, error, budget_exhausted or invalid_plan",
        "final_answer": "output of the last step that ran (steps skipped by their condition do not count)",
        "error": "first error of the plan",
        "cost_usd": "sum over the plan's steps (null if any price is unknown)",
        "prompt_tokens": "sum over steps", "completion_tokens": "sum over steps",
        "calls": "steps that sent a request", "cache_hits": "steps answered from the cache",
        "wall_time_s": "plan start to end", "started_at": "UTC", "ended_at": "UTC",
    },
    "rewards": {
        "run_id": "the run", "plan_id": "the plan", "query_id": "the query", "query_index": "row of the query",
        "sample": "the plan's sample", "task": "grader used", "status": "the plan's status",
        "reference": "gold answer from the query set", "answer": "the extracted final answer",
        "parsed": "an answer could be extracted", "correct": "the answer matches the reference",
        "reward": "1 correct, 0.5 parsed but wrong, 0 otherwise, minus the cost penalty; null if not graded",
        "advantage": "(reward - group mean) / (group std + 1e-4) over the query's K plans",
        "cost_usd": "the plan's cost",
    },
}


def markdown() -> str:
    """The README's schema section, generated from the schemas above."""
    out = []
    for name, schema in TABLES.items():
        out.append(f"#### `{name}`\n\n| column | type | meaning |\n|---|---|---|")
        out += [f"| `{f.name}` | `{f.type}` | {DOCS[name][f.name]} |" for f in schema]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
