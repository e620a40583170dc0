"""Steps whose output must be a record (enrichment jobs with fields).

Every llm step of such a plan asks for JSON under the job's schema: with
`response_format` where the provider takes one (litellm says which; an
OpenAI-compatible endpoint with an api_base is assumed to), else with the schema
block at the end of the prompt. A reply that does not parse or validate gets at
most one repair call (trace path "<step>.repair", with its own cost) showing
the validation error; if that fails too the step, and so the plan, ends with
status `invalid`. Function steps combine records field by field.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from conductor.execute.failure import StepFailed
from conductor.records import RecordChecker, parse_reply, repair_messages, with_schema_block

if TYPE_CHECKING:
    from conductor.execute.engine import Executor, PlanJob
    from conductor.plans import Step
    from conductor.pool import Worker


@dataclass(frozen=True)
class RecordSpec:
    name: str  # the job's name, sent as the schema's name
    schema: dict[str, Any]  # the wire schema (strict shape)
    checker: RecordChecker
    structured: str = "auto"  # auto | response_format | prompt

    def native(self, worker: "Worker") -> bool:
        """Whether to send response_format to this worker."""
        if self.structured != "auto":
            return self.structured == "response_format"
        if worker.api_base:
            return True  # OpenAI-compatible servers (vLLM, the simulated pool) take it
        try:
            import litellm

            return bool(litellm.supports_response_schema(model=worker.model))
        except Exception:  # noqa: BLE001 - unknown to litellm: ask in the prompt
            return False

    def response_format(self) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": self.schema, "strict": True}}


async def structured_call(ex: "Executor", job: "PlanJob", path: str, depth: int, step: "Step",
                          worker: "Worker", messages: list[dict[str, str]]) -> dict[str, Any]:
    """One record step: the call, and at most one repair. Raises StepFailed (status
    `invalid` when the repaired reply is still not a valid record)."""
    spec: RecordSpec = job.record
    native = spec.native(worker)
    params = {"response_format": spec.response_format()} if native else {}
    msgs = messages if native else with_schema_block(messages, spec.schema)
    bad: dict[str, str] = {}

    def accept(prefix: str):
        def check(entry) -> None:
            _, error = spec.checker.check(entry.text)
            if error is not None:
                bad["text"], bad["error"] = entry.text, error
                raise StepFailed("invalid", f"{prefix}: {error}", kind="malformed")
            return None
        return check

    try:
        return await ex.call_worker(job, path, depth, step, worker, msgs, params=params,
                                    accept=accept("reply was not a valid record"))
    except StepFailed as f:
        if f.status != "invalid" or "text" not in bad:
            raise
    fix = repair_messages(msgs, bad["text"], bad["error"], spec.schema)
    started = time.time()
    try:
        return await ex.call_worker(job, f"{path}.repair", depth, step, worker, fix, params=params,
                                    accept=accept("the repaired reply was still not a valid record"))
    except StepFailed as f:  # its own row: under the step's path it would replace the first call's, and its cost
        if f.row is None:
            f.row = ex.log_failure(job, f"{path}.repair", depth, step, f, worker=worker, started=started)
        raise


def combine_records(name: str, outputs: list[str | None]) -> str:
    """A function step over records: `vote` takes each field's most common value among
    the valid records granted (ties go to the earliest step); `extract` returns the one
    granted record. Raises ValueError when there is nothing to combine."""
    records = [r for r in (parse_reply(o)[0] if o else None for o in outputs) if isinstance(r, dict)]
    if not records:
        raise ValueError(f"none of the {len(outputs)} granted output(s) holds a record")
    if name == "extract":
        if len(records) != 1:
            raise ValueError(f"extract needs exactly one granted record (got {len(records)})")
        return orjson.dumps(records[0]).decode()
    if name != "vote":
        raise ValueError(f"unknown function {name!r}")
    keys = list(dict.fromkeys(k for r in records for k in r))
    out = {}
    for k in keys:
        values = [orjson.dumps(r.get(k), option=orjson.OPT_SORT_KEYS) for r in records]
        counts = Counter(values)
        best = max(values, key=lambda v: counts[v])  # max keeps the first of equals
        out[k] = orjson.loads(best)
    return orjson.dumps(out).decode()


def records_agree(a: str | None, b: str | None) -> bool:
    """Two outputs agree when both are records with the same fields and values."""
    ra, rb = parse_reply(a)[0] if a else None, parse_reply(b)[0] if b else None
    if not isinstance(ra, dict) or not isinstance(rb, dict):
        return False
    return orjson.dumps(ra, option=orjson.OPT_SORT_KEYS) == orjson.dumps(rb, option=orjson.OPT_SORT_KEYS)
