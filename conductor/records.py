"""Replies to records: parse the JSON (a ```json fence or text around the object is
tolerated), validate it against the job's JSON Schema with `jsonschema`, and type
the fields into Arrow columns (number float64, integer int64, boolean, enum and
string utf8, date date32, list list<utf8>, object struct)."""

from __future__ import annotations

import json
import re
from datetime import date
from typing import Any

import jsonschema
import orjson
import pyarrow as pa

from conductor.fields import Field

_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.S)
SCHEMA_LINE = "Reply with only a JSON object that matches this JSON Schema:"
REPAIR_LINE = "Your reply was not a valid record:"


class RecordChecker:
    """Parses and validates replies against one job's schema."""

    def __init__(self, check_schema: dict[str, Any]):
        check_schema = _int64(check_schema)
        cls = jsonschema.validators.validator_for(check_schema)
        cls.check_schema(check_schema)
        self.validator = cls(check_schema, format_checker=jsonschema.FormatChecker())

    def check(self, text: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """(record, None) for a valid reply, else (None, why)."""
        obj, error = parse_reply(text)
        if error is not None:
            return None, error
        errors = sorted(self.validator.iter_errors(obj), key=lambda e: (list(e.absolute_path), e.message))
        if errors:
            first = errors[0]
            where = "/".join(map(str, first.absolute_path)) or "(record)"
            more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
            return None, f"{where}: {first.message}{more}"
        return obj, None


def _int64(schema: Any) -> Any:
    """The schema with every integer bounded to int64, the records' column type: 1e30 is an
    integer to JSON Schema, and an invalid reply (repaired once) rather than a crash here."""
    if isinstance(schema, list):
        return [_int64(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _int64(v) for k, v in schema.items()}
    types = schema.get("type")
    if types == "integer" or (isinstance(types, list) and "integer" in types):
        out.setdefault("minimum", -(2 ** 63))
        out.setdefault("maximum", 2 ** 63 - 1)
    return out


def parse_reply(text: str | None) -> tuple[Any, str | None]:
    if text is None or not text.strip():
        return None, "empty reply"
    candidates = [text.strip()]
    m = _FENCE.search(text)
    if m:
        candidates.insert(0, m.group(1).strip())
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start:end + 1])
    error = None
    for c in candidates:
        try:
            obj = orjson.loads(c)
        except orjson.JSONDecodeError as e:
            error = error or f"not valid JSON: {e}"
            continue
        if not isinstance(obj, dict):
            return None, f"expected a JSON object, got {type(obj).__name__}"
        if (key := _repeated_key(c)) is not None:
            return None, f"key {key!r} is given twice in one object (which value is meant is unclear)"
        return obj, None
    return None, error


def _repeated_key(text: str) -> str | None:
    """The first key an object of `text` repeats: orjson keeps the last value silently, so
    `{"revenue": 1, "revenue": 2}` would be a valid record holding a guess."""
    repeated: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for k, _ in items:
            if k in seen and not repeated:
                repeated.append(k)
            seen.add(k)
        return dict(items)

    try:
        json.loads(text, object_pairs_hook=pairs)
    except ValueError:  # orjson read it; the standard library differs on a few inputs (huge numbers)
        return None
    return repeated[0] if repeated else None


def schema_block(schema: dict[str, Any]) -> str:
    """What asks for JSON in the prompt when the provider takes no response_format."""
    return f"{SCHEMA_LINE}\n```json\n{orjson.dumps(schema).decode()}\n```"


def with_schema_block(messages: list[dict[str, str]], schema: dict[str, Any]) -> list[dict[str, str]]:
    """The messages with the schema block appended to the last user message."""
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m["role"] == "user":
            m["content"] = f"{m['content']}\n\n{schema_block(schema)}"
            break
    return out


def repair_messages(messages: list[dict[str, str]], bad_reply: str, error: str,
                    schema: dict[str, Any]) -> list[dict[str, str]]:
    """The original conversation, the bad reply, and a request to fix it."""
    return [*messages, {"role": "assistant", "content": bad_reply or ""},
            {"role": "user", "content": f"{REPAIR_LINE} {error}\n\n{schema_block(schema)}"}]


# ---- typing -----------------------------------------------------------------

def typed_columns(fields: tuple[Field, ...], records: list[dict[str, Any] | None]) -> dict[str, pa.Array]:
    """One Arrow array per field; a missing record (failed row) gives nulls."""
    out = {}
    for f in fields:
        values = [None if r is None else _value(f, r.get(f.name)) for r in records]
        out[f.name] = pa.array(values, type=f.arrow_type())
    return out


def _value(f: Field, v: Any) -> Any:
    if v is None:
        return None
    if f.type == "number":
        return float(v)
    if f.type == "integer":
        return int(v)
    if f.type == "date":
        return v if isinstance(v, date) else date.fromisoformat(v)
    if f.type == "list":
        conv = {"number": float, "integer": int}.get(f.items)
        return [None if x is None else conv(x) if conv else x for x in v]
    if f.type == "object":
        return {s.name: _value(s, v.get(s.name)) for s in f.fields}
    return v
