"""The output tables, each declared once: per column its name, type and meaning.

A `Table` generates everything else from that declaration: the Arrow schema the
writers use, the DuckDB types the journal is read back with, a typed record
(`Table.record`, a frozen dataclass whose fields are the columns, all optional)
and the README's schema tables (`python -m conductor.schemas`). The tests check
the README, the written files and the catalog's views against these."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Iterable, Optional

import pyarrow as pa


@dataclass(frozen=True)
class ColumnType:
    arrow: pa.DataType
    duckdb: str
    python: Any


TS_TYPE = pa.timestamp("us", tz="UTC")
STR = ColumnType(pa.string(), "VARCHAR", str)
I64 = ColumnType(pa.int64(), "BIGINT", int)
I32 = ColumnType(pa.int32(), "INTEGER", int)
BOOL = ColumnType(pa.bool_(), "BOOLEAN", bool)
F64 = ColumnType(pa.float64(), "DOUBLE", float)
TS = ColumnType(TS_TYPE, "TIMESTAMPTZ", datetime.datetime)
STRS = ColumnType(pa.list_(pa.string()), "VARCHAR[]", list)
_BY_ARROW = {t.arrow: t for t in (STR, I64, I32, BOOL, F64, TS, STRS)}


@dataclass(frozen=True)
class Column:
    name: str
    type: ColumnType
    doc: str


class Table:
    """One output table's columns, and what is generated from them."""

    def __init__(self, name: str, columns: Iterable[Column]):
        self.name = name
        self.columns = tuple(columns)
        self.names = tuple(c.name for c in self.columns)
        self.schema = pa.schema([(c.name, c.type.arrow) for c in self.columns])
        self.record = make_dataclass(
            "".join(p.title() for p in name.split()) + "Row",
            [(c.name, Optional[c.type.python], field(default=None)) for c in self.columns], frozen=True)

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)

    def duckdb_types(self) -> dict[str, str]:
        return {c.name: c.type.duckdb for c in self.columns}

    def docs(self) -> dict[str, str]:
        return {c.name: c.doc for c in self.columns}

    def markdown(self) -> str:
        # as the files read back: Parquet names a list's items `element`, where Arrow says `item`
        rows = [f"| `{c.name}` | `{str(c.type.arrow).replace('list<item: ', 'list<element: ')}` | {c.doc} |"
                for c in self.columns]
        return f"#### `{self.name}`\n\n| column | type | meaning |\n|---|---|---|\n" + "\n".join(rows) + "\n"


PLANS_TABLE = Table("plans", [
    Column('run_id', STR, 'the run'),
    Column('plan_id', STR, '`<query_id>#<sample>`'),
    Column('query_id', STR, 'the query'),
    Column('query_index', I64, 'row of the query in its set'),
    Column('sample', I32, '0..K-1'),
    Column('task', STR, 'grader of the query'),
    Column('planner', STR, 'embedded, vllm or llm'),
    Column('template_version', STR, "version of the planner's prompt or templates"),
    Column('planner_prompt', STR, 'what an LLM planner was asked (null for the embedded planner)'),
    Column('raw_text', STR, "the planner's output, verbatim"),
    Column('valid', BOOL, 'the plan parsed and validated'),
    Column('error', STR, 'why it did not'),
    Column('steps_json', STR, 'the validated plan, normalized JSON'),
    Column('n_steps', I32, 'number of steps'),
    Column('workers', STRS, 'worker of each step'),
    Column('prompt_tokens', I64, 'planner prompt tokens (LLM planners)'),
    Column('completion_tokens', I64, 'planner completion tokens'),
    Column('logprob', F64, 'cumulative log-probability of the completion (LLM planners)'),
    Column('propensity', F64, 'probability of this plan under the policy (embedded planner)'),
    Column('info_json', STR, 'planner-specific details (template, expected accuracy and cost, finish reason)'),
])

TRACES_TABLE = Table("traces", [
    Column('run_id', STR, 'the run'),
    Column('plan_id', STR, 'the plan'),
    Column('query_id', STR, 'the query'),
    Column('query_index', I64, 'row of the query'),
    Column('sample', I32, "the plan's sample"),
    Column('step', I32, 'top-level step index'),
    Column('step_path', STR, '`2`; `2.plan` for the call that re-planned step 2 (a planner worker\'s, billed '
                             'here) and `2.0`, `2.1`, ... for the steps of the workflow it made; step 2\'s own row '
                             '(its `sub_plan`) costs 0'),
    Column('depth', I32, 're-planning depth (0 at top level)'),
    Column('worker', STR, 'worker id'),
    Column('model', STR, 'litellm model string'),
    Column('provider', STR, 'provider id'),
    Column('status', STR, 'ok, error, budget_exhausted or skipped (its condition was false, or an earlier step '
                          'failed); in an enrichment job, invalid: an answer with no valid record, even after its '
                          'repair'),
    Column('error', STR, 'what went wrong; for a skipped step, why (`condition disagree(0, 1) is false: steps 0, 1 '
                         'agree`); on an `ok` step with `usage_estimated`, how its usage was counted, and on an `ok` '
                         'step its batch did not answer, `answered online at the online price: ...` (also in '
                         'front of the error of such an answer an enrichment job then refused; notes, not '
                         'failures: filter failures on `status`)'),
    Column('attempts', I32, 'requests sent for this step (0: cache hit, restored, or not sent)'),
    Column('cache_hit', BOOL, 'answered from the cache, or (also with `--no-cache`) by the same request sent '
                              'earlier in this run'),
    Column('prompt_tokens', I64, 'as reported by the provider; with usage_estimated, estimated or the bound '
                                 'charged (see usage_estimated)'),
    Column('completion_tokens', I64, 'as reported by the provider; with usage_estimated, estimated or the bound '
                                     'charged (see usage_estimated)'),
    Column('usage_estimated', BOOL, 'the token counts are not what the provider reported: no usage, or usage '
                                    'no request could have (0 tokens for text, more than the prompt bytes or '
                                    'max_tokens), counted at the request\'s bounds or clamped to them; or a '
                                    'server that says it estimated (characters / 4, at least 1 for any text, '
                                    'the replay server)'),
    Column('cost_usd', F64, 'paid for this step (0 for a cache hit or a step skipped by its condition; null when '
                            'the price is unknown or nothing was billed: an error with no answer, '
                            '`budget_exhausted`, or skipped after a failed step). A failed step whose 200 answer '
                            "could not be kept (a refusal or content filter's `content: null`, an answer past the "
                            'size limits) was billed: it is charged its reported usage, clamped to what the request '
                            "could use, else (none, or none to believe) the request's bounds, with `usage_estimated`, "
                            '`prompt_tokens` and `completion_tokens`. A step tried again by a rerun '
                            '(`--retry-failed`) keeps its latest row, charged what every try of it was billed'),
    Column('original_cost_usd', F64, 'what the answer cost when it was first paid for'),
    Column('latency_s', F64, 'duration of the successful request (for a cache hit, that of the request that first '
                            'produced the answer)'),
    Column('started_at', TS, 'step start (UTC)'),
    Column('ended_at', TS, 'step end (UTC)'),
    Column('instruction', STR, "the step's instruction"),
    Column('when', STR, "the step's condition, e.g. `disagree(0, 1)` (null: the step always runs); a reserved "
                        'word in SQL: write `"when"`'),
    Column('response_text', STR, "the worker's output"),
    Column('simulated', BOOL, 'answered by the simulated pool (`conductor sim`); false for replayed answers, which '
                              'are real recorded outputs'),
    Column('request_key', STR, 'cache key: hash of model, api_base, messages and sampling parameters; null where '
                               'no call was answered: a function step, a skipped step, a re-planning step (a '
                               "model planner's call has its own `.plan` row), or a failed step whose call got no "
                               'answer (an HTTP error, a timeout, a budget stop; a refused 200 was billed and has '
                               'its key)'),
    Column('sub_plan', STR, 'the workflow a re-planning step ran, as JSON'),
    Column('failure', STR, "a failed step's kind of failure: connection, timeout, server, rate_limit, batch_refused"
                           ' (a rerun retries these), budget, auth, not_found, client, malformed, config, other'),
    Column('input_price', F64, 'USD per input token the answer was paid at (for a cache hit: when first paid for), '
                               'the online (list) price also for a call bought through batch (see `paid_mode`); '
                               'null where none was kept: a step with no answer, a function or re-planning step, an '
                               'unknown price, a cost the server stated (a replay of recorded costs), or an answer '
                               'cached before conductor kept prices (`policy train` then reads the price back from '
                               'the cost)'),
    Column('output_price', F64, 'USD per output token the answer was paid at, as `input_price`'),
    Column('paid_mode', STR, '`online` or `batch`: how the answer was bought (for a cache hit: when first paid for); '
                             "a batch call cost `input_price` and `output_price` x its provider's "
                             '`batch_price_factor`. Null for a step with no answer, a function or re-planning step, '
                             'or an answer cached before conductor kept prices'),
])

RESULTS_TABLE = Table("results", [
    Column('run_id', STR, 'the run'),
    Column('plan_id', STR, 'the plan'),
    Column('query_id', STR, 'the query'),
    Column('query_index', I64, 'row of the query'),
    Column('sample', I32, "the plan's sample"),
    Column('status', STR, 'ok, error, budget_exhausted or invalid_plan; in an enrichment job, invalid (no valid '
                          'record)'),
    Column('final_answer', STR, 'output of the last step that ran (steps skipped by their condition do not count)'),
    Column('error', STR, 'first error of the plan'),
    Column('cost_usd', F64, "sum over the plan's steps (null if any price is unknown)"),
    Column('prompt_tokens', I64, 'sum over steps'),
    Column('completion_tokens', I64, 'sum over steps'),
    Column('calls', I32, 'steps that sent a request'),
    Column('cache_hits', I32, 'steps answered from the cache'),
    Column('wall_time_s', F64, 'plan start to end'),
    Column('started_at', TS, 'UTC'),
    Column('ended_at', TS, 'UTC'),
])

REWARDS_TABLE = Table("rewards", [
    Column('run_id', STR, 'the run'),
    Column('plan_id', STR, 'the plan'),
    Column('query_id', STR, 'the query'),
    Column('query_index', I64, 'row of the query'),
    Column('sample', I32, "the plan's sample"),
    Column('task', STR, 'grader used'),
    Column('status', STR, "the plan's status, as in results"),
    Column('reference', STR, 'gold answer from the query set'),
    Column('answer', STR, 'the extracted final answer'),
    Column('parsed', BOOL, 'an answer could be extracted'),
    Column('correct', BOOL, 'the answer matches the reference'),
    Column('reward', F64, "1 correct, 0.5 parsed but wrong, 0 otherwise, minus the cost penalty x what the plan's "
                          "answers cost when first paid for (a cache hit is priced, not free); null if not graded"),
    Column('advantage', F64, "(reward - group mean) / (group sample std + 1e-4) over the query's graded plans "
                             "(0 when fewer than 2 are graded)"),
    Column('cost_usd', F64, "what this run paid for the plan: results' `cost_usd`, the sum over its steps, where a "
                            "step answered from the response cache counts 0 (a plan served wholly from the cache: "
                            "0); null if any price is unknown. The reward's cost penalty (`--cost-penalty`) charges "
                            "instead what the plan's answers cost when first paid for (traces' "
                            "`original_cost_usd`), as export's `cost_usd` does"),
])


# A plan's line in the run's journal (work/plans.jsonl), which results.parquet is built from.
PLAN_LINE = Table("journal plan line", [
    *(RESULTS_TABLE.column(n) for n in ("run_id", "plan_id", "query_id", "query_index", "sample", "status",
                                        "final_answer", "error", "calls", "cache_hits", "started_at", "ended_at",
                                        "wall_time_s")),
    Column("failure", STR, "the plan's kind of failure; a rerun retries the transient ones"),
])

RECORDS = {t.name: t for t in (PLANS_TABLE, TRACES_TABLE, RESULTS_TABLE, REWARDS_TABLE)}
TABLES = {name: t.schema for name, t in RECORDS.items()}
PLANS, TRACES, RESULTS, REWARDS = (t.schema for t in RECORDS.values())
DOCS = {name: t.docs() for name, t in RECORDS.items()}


def duckdb_columns(schema: pa.Schema) -> dict[str, str]:
    """A schema's columns as DuckDB type names, for reading the JSON journal."""
    return {f.name: _BY_ARROW[f.type].duckdb for f in schema}


def markdown() -> str:
    """The README's schema section, generated from the tables above."""
    return "\n".join(t.markdown() for t in RECORDS.values())


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(prog="python -m conductor.schemas",
                            description="Print the README's schema section (every output table's columns, as "
                                        "Markdown), generated from the declarations in conductor/schemas.py; "
                                        "paste it between the README's schemas markers.").parse_args()
    print(markdown(), end="")
