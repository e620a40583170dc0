"""Structured (JSON record) requests: how the sim sees them and what it answers.

A request is structured when it carries `response_format` json_schema, or when a
user message ends with the block that asks for JSON in the prompt (see
`PROMPT_MARKER`). The sim then answers one JSON object generated from the schema:
where the known query's `reference` is a JSON object, each field takes its
reference value with the worker's skill and a plausible wrong value otherwise;
fields without a reference get plausible values, strings and numbers taken from
the document where it has some. An injected `malformed_json` rate breaks a
reply, either so it does not parse or so it parses but breaks the schema.

Everything is a pure function of the request's random draw, so a repeated
request gets the same record.
"""

from __future__ import annotations

import datetime as dt
import math
import random
import re
from dataclasses import dataclass
from typing import Any, Callable

import orjson

from conductor.sim.answers import perturb_number
from conductor.sim.index import Known

PROMPT_MARKER = "Reply with only a JSON object that matches this JSON Schema:"
REPAIR_MARKER = "Your reply was not a valid record:"
_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)\n\s*```", re.S)
_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?![\w])")
_YEAR = re.compile(r"\b(19[5-9]\d|20[0-4]\d)\b")
# Words of prose and table cells ("12.5", "2019-12-31", "company's"), not punctuation or Markdown rules.
_WORD = re.compile(r"[\w$%&]+(?:[.,:'/-][\w$%&]+)*")
_MISSING = object()
MAX_DEPTH = 8


class StructuredRequestError(ValueError):
    """A structured request whose schema cannot be read; (param, message) in args."""


@dataclass(frozen=True)
class StructuredRequest:
    schema: dict[str, Any]
    repair: bool          # the last user message asks to fix an invalid reply
    texts: list[str]      # the messages' texts with the schema blocks cut off, for finding the query


def parse_request(body: dict[str, Any], texts: list[str]) -> StructuredRequest | None:
    """The schema a request asks for, or None for a plain-text request."""
    roles = [m.get("role") for m in body["messages"]]
    user = [i for i, r in enumerate(roles) if r == "user"]
    stripped, block = list(texts), None
    for i in user:
        head, found = split_block(texts[i])
        if found is not None:
            stripped[i], block = head, found   # the last one wins
    repair = bool(user) and texts[user[-1]].lstrip().startswith(REPAIR_MARKER)
    schema = _response_format_schema(body.get("response_format"))
    if schema is None and block is not None:
        schema = _block_schema(block)
    if schema is None:
        return None
    return StructuredRequest(schema=schema, repair=repair, texts=stripped)


def split_block(text: str) -> tuple[str, str | None]:
    """(text before the schema block, the block) or (text, None)."""
    at = text.rfind(PROMPT_MARKER)
    if at < 0:
        return text, None
    return text[:at].rstrip(), text[at + len(PROMPT_MARKER):]


def _response_format_schema(rf: Any) -> dict[str, Any] | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise StructuredRequestError("response_format", "'response_format' must be an object.")
    kind = rf.get("type")
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise StructuredRequestError("response_format.json_schema.schema",
                                         "response_format of type json_schema needs json_schema.schema, an object.")
        return schema
    if kind == "json_object":
        return {"type": "object"}
    return None


def _block_schema(block: str) -> dict[str, Any]:
    m = _FENCE.search(block)
    raw = m.group(1) if m else block.strip()
    try:
        schema = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise StructuredRequestError("messages", f"The JSON Schema after '{PROMPT_MARKER}' does not parse ({e}).")
    if not isinstance(schema, dict):
        raise StructuredRequestError("messages", f"The JSON Schema after '{PROMPT_MARKER}' must be an object.")
    return schema


# -- the record ---------------------------------------------------------------

def reference_record(known: Known | None) -> dict[str, Any] | None:
    """The known query's reference as a field -> value mapping, when it is a JSON object."""
    if known is None or not known.reference:
        return None
    ref = known.reference.strip()
    if not ref.startswith("{"):
        return None
    try:
        value = orjson.loads(ref)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def record_reply(req: StructuredRequest, known: Known | None, skill: float, rng: random.Random,
                 malformed_rate: float, fault_rng: Callable[[], random.Random]) -> tuple[str, str, int, int]:
    """(content, kind, fields right, fields with a reference); kind is "record",
    "unparseable" or "invalid". `fault_rng` makes the fault's own draw (only
    called when the rate is above 0), so the rate does not change the record."""
    doc = Document(known.prompt if known is not None else _last_user_text(req.texts))
    gen = _Generator(req.schema, doc, rng)
    counts = [0, 0]
    record = gen.value(req.schema, reference_record(known), skill, counts, 0, top=True)
    kind = "record"
    if malformed_rate > 0 and (fault := fault_rng()).random() < malformed_rate:
        if fault.random() < 0.5:
            text = orjson.dumps(record).decode()
            cut = max(1, int(len(text) * fault.uniform(0.3, 0.8)))
            return text[:cut], "unparseable", counts[0], counts[1]
        gen.rng = fault
        record = _invalidate(record, gen)
        kind = "invalid"
    return orjson.dumps(record).decode(), kind, counts[0], counts[1]


def _last_user_text(texts: list[str]) -> str:
    return texts[-1] if texts else ""


class Document:
    """The text a record is drawn from: its numbers, years and word spans, read once."""

    def __init__(self, text: str):
        self.text = text
        self._words: list[str] | None = None
        self._numbers: list[str] | None = None
        self._years: list[str] | None = None

    @property
    def words(self) -> list[str]:
        if self._words is None:
            self._words = _WORD.findall(self.text[:20000])
        return self._words

    @property
    def numbers(self) -> list[str]:
        if self._numbers is None:
            self._numbers = _NUMBER.findall(self.text[:20000])
        return self._numbers

    def span(self, rng: random.Random, n_words: int) -> str | None:
        words = self.words
        if len(words) < n_words or not words:
            return None
        i = rng.randrange(len(words) - n_words + 1)
        return " ".join(words[i:i + n_words])

    def year(self, rng: random.Random) -> int | None:
        if self._years is None:
            self._years = _YEAR.findall(self.text[:20000])
        return int(rng.choice(self._years)) if self._years else None


class _Generator:
    def __init__(self, root: dict[str, Any], doc: Document, rng: random.Random):
        self.root = root
        self.doc = doc
        self.rng = rng

    def resolve(self, schema: Any) -> dict[str, Any]:
        """Follow local $refs and take the first non-null branch of anyOf/oneOf, merging allOf."""
        for _ in range(MAX_DEPTH):
            if not isinstance(schema, dict):
                return {}
            if "$ref" in schema:
                schema = self._ref(schema["$ref"])
                continue
            if "allOf" in schema and isinstance(schema["allOf"], list):
                merged = {k: v for k, v in schema.items() if k != "allOf"}
                for part in schema["allOf"]:
                    merged.update(self.resolve(part))
                schema = merged
                continue
            return schema
        return {}

    def _ref(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return {}
        node: Any = self.root
        for part in ref.lstrip("#").strip("/").split("/"):
            if not part:
                continue
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        return node if isinstance(node, dict) else {}

    def value(self, schema: Any, ref: Any, skill: float, counts: list[int], depth: int, top: bool = False) -> Any:
        """A value for `schema`: the reference with probability `skill` (drawn once
        per top-level field), a plausible wrong one otherwise, or, with no
        reference, a plausible value."""
        schema = self.resolve(schema)
        branches = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(branches, list) and branches:
            options = [self.resolve(b) for b in branches]
            real = [o for o in options if _types(o) != ["null"]]
            nullable = len(real) < len(options)
            if ref is None and nullable and self.rng.random() < 0.1:
                return None
            schema = _pick_branch(real or options, ref)
            schema = self.resolve(schema)
        if "const" in schema:
            return schema["const"]
        if top:
            return self.record(schema, ref if isinstance(ref, dict) else None, skill, counts, depth)
        return self.plain(schema, depth)

    def record(self, schema: dict[str, Any], ref: dict[str, Any] | None, skill: float, counts: list[int],
               depth: int) -> dict[str, Any]:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        out: dict[str, Any] = {}
        for name, sub in props.items():
            field_ref = ref.get(name, _MISSING) if ref is not None else _MISSING
            if field_ref is not _MISSING and field_ref is not None:
                counts[1] += 1
                if self.rng.random() < skill:
                    counts[0] += 1
                    out[name] = self.right(sub, field_ref, depth + 1)
                else:
                    out[name] = self.wrong(sub, field_ref, depth + 1)
            else:
                v = self.field(sub, required=name in required, depth=depth + 1)
                if v is not _MISSING:
                    out[name] = v
        return out

    def field(self, schema: Any, *, required: bool, depth: int) -> Any:
        s = self.resolve(schema)
        if not required and self.rng.random() < 0.1:
            return _MISSING
        if _nullable(s, self) and self.rng.random() < 0.1:
            return None
        return self.plain(schema, depth)

    # -- values with no reference --------------------------------------------

    def plain(self, schema: Any, depth: int) -> Any:
        s = self.resolve(schema)
        branches = s.get("anyOf") or s.get("oneOf")
        if isinstance(branches, list) and branches:
            options = [self.resolve(b) for b in branches]
            s = _pick_branch([o for o in options if _types(o) != ["null"]] or options, None)
        if "const" in s:
            return s["const"]
        if isinstance(s.get("enum"), list) and s["enum"]:
            values = [v for v in s["enum"] if v is not None] or s["enum"]
            return self.rng.choice(values)
        t = _main_type(s)
        rng, doc = self.rng, self.doc
        if t == "object":
            if depth >= MAX_DEPTH:
                return {}
            props = s.get("properties") or {}
            required = set(s.get("required") or ())
            out = {}
            for name, sub in props.items():
                v = self.field(sub, required=name in required, depth=depth + 1)
                if v is not _MISSING:
                    out[name] = v
            return out
        if t == "array":
            lo, hi = _int(s.get("minItems"), 0), _int(s.get("maxItems"), 3)
            n = rng.randint(min(max(lo, 1), hi), max(min(hi, 3), lo)) if hi > 0 else 0
            if depth >= MAX_DEPTH:
                n = lo
            items = s.get("items", {"type": "string"})
            return [self.plain(items, depth + 1) for _ in range(n)]
        if t == "integer":
            pool = [int(float(x.replace(",", ""))) for x in doc.numbers[:50] if "." not in x]
            v = rng.choice(pool) if pool else rng.randint(0, 100)
            return _clamp(v, s, integer=True)
        if t == "number":
            pool = [float(x.replace(",", "")) for x in doc.numbers[:50]]
            v = rng.choice(pool) if pool else round(rng.uniform(0, 1000), 2)
            return _clamp(v, s)
        if t == "boolean":
            return rng.random() < 0.5
        if t == "null":
            return None
        return self.string(s)

    def string(self, s: dict[str, Any]) -> str:
        rng = self.rng
        fmt = s.get("format")
        if fmt in ("date", "date-time"):
            year = self.doc.year(rng) or rng.randint(2015, 2024)
            day = dt.date(year, 1, 1) + dt.timedelta(days=rng.choice((89, 180, 272, 364)))
            return day.isoformat() if fmt == "date" else f"{day.isoformat()}T00:00:00Z"
        text = self.doc.span(rng, rng.randint(1, 6)) or "simulated text"
        lo, hi = _int(s.get("minLength"), 0), _int(s.get("maxLength"), 0)
        if hi and len(text) > hi:
            text = text[:hi]
        if len(text) < lo:
            text = text + "x" * (lo - len(text))
        return text

    # -- values with a reference ---------------------------------------------

    def right(self, schema: Any, ref: Any, depth: int) -> Any:
        """The reference, shaped to the field's type (a gold answer stored as a
        list or number still fills a string field)."""
        s = self._concrete(schema, ref)
        t = _main_type(s)
        if t == "object":
            if not isinstance(ref, dict):
                return self.plain(s, depth)
            out = {}
            required = set(s.get("required") or ())
            for name, sub in (s.get("properties") or {}).items():
                if name in ref and ref[name] is not None:
                    out[name] = self.right(sub, ref[name], depth + 1)
                else:
                    v = self.field(sub, required=name in required, depth=depth + 1)
                    if v is not _MISSING:
                        out[name] = v
            return out
        value = _coerce(ref, s)
        if not _matches(value, s):  # a reference that cannot fill this field
            return self.plain(s, depth)
        if t == "integer" and isinstance(value, float):
            value = int(value)
        return value

    def wrong(self, schema: Any, ref: Any, depth: int) -> Any:
        """A plausible value of the field's type that is not the reference."""
        s = self._concrete(schema, ref)
        right = self.right(s, ref, depth)
        rng = self.rng
        if isinstance(s.get("enum"), list):
            others = [v for v in s["enum"] if v != right and v is not None]
            return rng.choice(others) if others else right
        t = _main_type(s)
        if t == "object" and isinstance(right, dict):
            keys = [k for k in right if isinstance(ref, dict) and ref.get(k) is not None]
            if keys:
                k = rng.choice(keys)
                right[k] = self.wrong((s.get("properties") or {}).get(k, {}), ref[k], depth + 1)
            return right
        if t == "array" and isinstance(right, list):
            items = s.get("items", {"type": "string"})
            out = list(right)
            if out and (len(out) > 1 and rng.random() < 0.3):
                out.pop(rng.randrange(len(out)))
            elif out:
                i = rng.randrange(len(out))
                out[i] = self.wrong(items, out[i], depth + 1)
            else:
                out.append(self.plain(items, depth + 1))
            return out
        if t == "boolean":
            return not bool(right)
        if t == "integer" and isinstance(right, int):
            step = rng.choice((1, 2, 3, 5, 10, 100)) * rng.choice((-1, 1))
            return right + step
        if t == "number" and isinstance(right, (int, float)):
            return _wrong_number(right, rng)
        if t == "string" and isinstance(right, str):
            return self._wrong_string(s, right)
        return self.plain(s, depth)

    def _wrong_string(self, s: dict[str, Any], right: str) -> str:
        rng = self.rng
        if s.get("format") in ("date", "date-time"):
            try:
                day = dt.date.fromisoformat(right[:10])
                shifted = day + dt.timedelta(days=rng.choice((-366, -365, -92, -31, -1, 1, 31, 92, 365)))
                return shifted.isoformat() + right[10:]
            except ValueError:
                pass
        if _NUMBER.search(right):
            return perturb_number(right, rng)
        n = max(1, min(6, len(right.split())))
        for _ in range(8):
            span = self.doc.span(rng, n)
            if span is None:
                break
            if span.strip().lower() != right.strip().lower():
                return span
        return f"not {right}"

    def _concrete(self, schema: Any, ref: Any) -> dict[str, Any]:
        s = self.resolve(schema)
        branches = s.get("anyOf") or s.get("oneOf")
        if isinstance(branches, list) and branches:
            options = [self.resolve(b) for b in branches]
            s = self.resolve(_pick_branch([o for o in options if _types(o) != ["null"]] or options, ref))
        return s


# -- schema helpers -------------------------------------------------------------

_JSON_TYPE = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}


def _types(s: dict[str, Any]) -> list[str]:
    t = s.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    if "properties" in s:
        return ["object"]
    if "items" in s:
        return ["array"]
    if isinstance(s.get("enum"), list) and s["enum"]:
        return sorted({_JSON_TYPE.get(type(v), "null") for v in s["enum"]})
    return []


def _main_type(s: dict[str, Any]) -> str:
    types = [t for t in _types(s) if t != "null"]
    return types[0] if types else ("null" if _types(s) == ["null"] else "string")


def _nullable(s: dict[str, Any], gen: _Generator) -> bool:
    if "null" in _types(s):
        return True
    branches = s.get("anyOf") or s.get("oneOf")
    return isinstance(branches, list) and any(_types(gen.resolve(b)) == ["null"] for b in branches)


def _pick_branch(options: list[dict[str, Any]], ref: Any) -> dict[str, Any]:
    if ref is not None:
        want = _JSON_TYPE.get(type(ref))
        for o in options:
            ts = _types(o)
            if want in ts or (want == "integer" and "number" in ts):
                return o
    return options[0]


def _int(v: Any, default: int) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _clamp(v: float, s: dict[str, Any], integer: bool = False) -> Any:
    lo, hi = s.get("minimum"), s.get("maximum")
    if isinstance(lo, (int, float)) and v < lo:
        v = lo
    if isinstance(hi, (int, float)) and v > hi:
        v = hi
    return int(v) if integer else float(v)


def _coerce(ref: Any, s: dict[str, Any]) -> Any:
    """The reference in the field's JSON type, as a model that read it right would write it."""
    t = _main_type(s)
    if t == "string":
        if isinstance(ref, str) and ref[:1] == "[":
            try:
                ref = orjson.loads(ref)
            except orjson.JSONDecodeError:
                pass
        if isinstance(ref, list):
            return ", ".join(_scalar_text(x) for x in ref)
        return _scalar_text(ref)
    if t in ("number", "integer"):
        if isinstance(ref, list) and len(ref) == 1:
            ref = ref[0]
        if isinstance(ref, str):
            try:
                ref = float(ref.replace(",", "").strip())
            except ValueError:
                return ref
        if isinstance(ref, bool) or not isinstance(ref, (int, float)):
            return ref
        if t == "integer":
            return int(ref) if float(ref).is_integer() else ref
        return ref
    if t == "boolean" and isinstance(ref, str):
        return ref.strip().lower() in ("true", "yes", "1")
    if t == "array":
        if isinstance(ref, str):
            try:
                parsed = orjson.loads(ref)
                ref = parsed if isinstance(parsed, list) else [ref]
            except orjson.JSONDecodeError:
                ref = [ref]
        if isinstance(ref, list):
            items = s.get("items", {})
            return [_coerce(x, items) if isinstance(items, dict) else x for x in ref]
        return [ref]
    return ref


def _scalar_text(x: Any) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return x if isinstance(x, str) else ("" if x is None else str(x))


def _wrong_number(x: float, rng: random.Random) -> float | int:
    if x == 0:
        return rng.choice((1, -1, 0.5, 10))
    if rng.random() < 0.5:
        text = repr(float(x)) if not isinstance(x, int) else str(x)
        try:
            new = float(perturb_number(text, rng))
        except ValueError:
            new = x * 1.1
    else:
        new = x * rng.choice((0.5, 0.9, 1.1, 1.5, 2, 10, 0.1))
    if not math.isfinite(new) or new == x:
        new = x + 1
    return int(new) if isinstance(x, int) and float(new).is_integer() else round(new, 6)


def _invalidate(record: Any, gen: _Generator) -> Any:
    """The record broken against its schema: a field given a value of a type (or
    an enum value) the schema does not allow, else a required field removed."""
    schema = gen.resolve(gen.root)
    if not isinstance(record, dict) or _main_type(schema) != "object":
        return ["not", "an", "object"]
    props = {k: gen.resolve(v) for k, v in (schema.get("properties") or {}).items()}
    required = [k for k in (schema.get("required") or ()) if k in record]
    typed = [k for k, v in props.items() if _allowed_types(v, gen)]
    out = dict(record)
    # A wrong type breaks the record under any looser schema the client may check
    # against too (one that does not require every field); a dropped field may not.
    if typed:
        name = gen.rng.choice(typed)
        allowed = _allowed_types(props[name], gen)
        for candidate, kinds in (("n/a", {"string"}), (12345, {"integer", "number"}), (True, {"boolean"}),
                                 ([1, 2], {"array"}), ({"x": 1}, {"object"})):
            if not kinds & allowed:
                out[name] = candidate
                return out
        if isinstance(props[name].get("enum"), list) and "__not_allowed__" not in props[name]["enum"]:
            out[name] = "__not_allowed__"
            return out
    if required:
        out.pop(gen.rng.choice(required))
        return out
    return ["not", "an", "object"]


def _allowed_types(s: dict[str, Any], gen: _Generator) -> set[str]:
    """The JSON types a value may have under `s`; empty when anything goes."""
    branches = s.get("anyOf") or s.get("oneOf")
    if isinstance(branches, list) and branches:
        out: set[str] = set()
        for b in branches:
            ts = _allowed_types(gen.resolve(b), gen)
            if not ts:
                return set()
            out |= ts
        return out
    ts = set(_types(s))
    if "number" in ts:
        ts.add("integer")
    return ts


def _matches(value: Any, s: dict[str, Any]) -> bool:
    """Whether a coerced reference has a type the field allows (enum values included)."""
    ts = set(_types(s))
    if isinstance(s.get("enum"), list) and value not in s["enum"]:
        return False
    if not ts:
        return True
    kind = "null" if value is None else _JSON_TYPE.get(type(value), "")
    return kind in ts or (kind == "integer" and "number" in ts) or (
        kind == "number" and "integer" in ts and float(value).is_integer())
