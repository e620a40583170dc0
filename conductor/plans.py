"""Workflows (plans): parsing from JSON or the three-list text format, and validation.

A plan is an ordered list of steps. Step i names a worker, gives it an
instruction, and grants it `access` to earlier steps: their instructions and
outputs become prior conversation turns. Steps run as soon as every step they
can see (and every step their condition names) has finished.

A step may carry a condition, `when`: it runs only if the condition holds on
earlier steps' final answers (as the grader of the query's task extracts and
compares them), else it is `skipped`, costs nothing and makes no call:
- `{"disagree": [0, 1]}`: the listed steps' final answers are not all the same;
- `{"no_majority": [0, 1, 2]}`: no answer is given by more than half of the
  listed steps that ran.
Two cheap workers and `{"worker": "big", ..., "when": {"disagree": [0, 1]}}` is a
cascade: the expensive model is asked only when the cheap ones disagree. The
answer is the output of the last step that ran.

Both formats are accepted from any planner:

JSON:        {"steps": [{"worker": "a", "instruction": "...", "access": []}, ...,
                        {"worker": "c", "instruction": "...", "access": [], "when": {"disagree": [0, 1]}}]}
three-list:  model_id = ["a", 1]  subtasks = ["...", "..."]  access_list = [[], ["all"]]
             conditions = [None, "disagree(0, 1)"]   (optional fourth list)

Worker references may be ids or 0-based positions in the pool's worker list.
"""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from dataclasses import dataclass
from typing import Any

import orjson

from conductor.errors import PlanError
from conductor.pool import Pool
from conductor.yamlkeys import shown_value

DEFAULT_MAX_STEPS = 5
MAX_STEPS = 1000  # the most --max-steps takes: a plan is a short workflow
# Far above any instruction that restates a question, far below one that costs dollars to send:
# a planner's runaway text is refused before a worker is paid to read it.
MAX_INSTRUCTION_CHARS = 100_000
CONDITIONS = ("disagree", "no_majority")


@dataclass(frozen=True)
class Query:
    """One row of a query set: what a planner plans for and a plan answers."""

    query_id: str
    prompt: str
    task: str | None = None
    reference: str | None = None
    metadata: str | None = None
    index: int = 0  # row position in the query set, for stable output order


@dataclass(frozen=True)
class Condition:
    kind: str  # disagree | no_majority
    steps: tuple[int, ...]

    def to_dict(self) -> dict[str, list[int]]:
        return {self.kind: list(self.steps)}

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(map(str, self.steps))})"


@dataclass(frozen=True)
class Step:
    worker: str
    instruction: str
    access: tuple[int, ...]  # resolved: "all" becomes every earlier index
    when: Condition | None = None

    @property
    def waits_for(self) -> tuple[int, ...]:
        """The steps that must finish first: those it sees and those its condition reads."""
        return tuple(sorted(set(self.access) | set(self.when.steps if self.when else ())))

    def to_dict(self) -> dict[str, Any]:
        d = {"worker": self.worker, "instruction": self.instruction, "access": list(self.access)}
        if self.when is not None:
            d["when"] = self.when.to_dict()
        return d


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]

    def to_json(self) -> str:
        return orjson.dumps({"steps": [s.to_dict() for s in self.steps]}).decode()

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Load a plan this package serialized itself (already validated)."""
        data = orjson.loads(text)
        steps = []
        for s in data["steps"]:
            cond = None
            if s.get("when"):
                kind, listed = next(iter(s["when"].items()))
                cond = Condition(kind, tuple(listed))
            steps.append(Step(s["worker"], s["instruction"], tuple(s["access"]), cond))
        return cls(tuple(steps))

    @property
    def workers(self) -> list[str]:
        return [s.worker for s in self.steps]


def parse_plan(text: str, pool: Pool, max_steps: int = DEFAULT_MAX_STEPS) -> Plan:
    """Parse either format and validate against the pool; raises PlanError."""
    if not isinstance(text, str) or not text.strip():
        raise PlanError("empty planner output")
    try:
        raw, after_json = _last_plan(text)
        if raw is None:
            raise PlanError("no plan found: expected JSON with 'steps' or the lists model_id, subtasks, access_list")
        try:
            return validate_plan(raw, pool, max_steps)
        except PlanError as e:
            raise (PlanError(f"{AFTER_JSON}: {e}") if after_json else e) from None
    except PlanError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
        # A planner's reply is untrusted text: whatever in it trips the reader is that plan's
        # error, never a crash of the batch (and of every rerun, which replays the same reply).
        raise PlanError(f"the plan could not be read ({type(e).__name__}: {str(e)[:200]})") from None


def validate_plan(raw: Any, pool: Pool, max_steps: int = DEFAULT_MAX_STEPS) -> Plan:
    if isinstance(raw, dict):
        raw = raw.get("steps")
    if not isinstance(raw, list):
        raise PlanError("'steps' must be a list")
    if not raw:
        raise PlanError("plan has no steps")
    if len(raw) > max_steps:
        raise PlanError(f"plan has {len(raw)} steps; at most {max_steps} are allowed")
    ids = pool.ids
    steps = []
    for i, s in enumerate(raw):
        if not isinstance(s, dict):
            raise PlanError(f"step {i}: must be an object with worker, instruction, access")
        worker = _resolve_worker(s.get("worker"), ids, i)
        instruction = s.get("instruction")
        if not isinstance(instruction, str) or not instruction.strip():
            raise PlanError(f"step {i}: instruction must be a non-empty string")
        if len(instruction) > MAX_INSTRUCTION_CHARS:
            raise PlanError(f"step {i}: instruction is {len(instruction):,} characters long; "
                            f"at most {MAX_INSTRUCTION_CHARS:,} are allowed")
        if bad := _SURROGATE.search(instruction):
            # JSON allows "\ud800" escapes, but a lone surrogate is no text: it cannot be stored or sent.
            raise PlanError(f"step {i}: instruction holds a lone surrogate \\u{ord(bad.group()):04x}, "
                            f"which is not valid Unicode")
        access = _resolve_access(s.get("access", []), i)
        if not access and (function := pool.worker(worker).function) is not None:
            # A vote or extract reads nothing but the steps it may see: with none it can never run.
            raise PlanError(f"step {i}: {worker} ({function}) combines earlier steps' answers, "
                            f"so its access must list at least one earlier step")
        steps.append(Step(worker, instruction.strip(), access, _condition_of(s, i)))
    return Plan(tuple(steps))


_SURROGATE = re.compile(r"[\ud800-\udfff]")
_STEP_NUMBER = re.compile(r"[0-9]+")  # ASCII: str.isdigit() also takes '²', which int() refuses
# Far more digits than any step or worker number has; Python's int() refuses thousands of them
# with advice (sys.set_int_max_str_digits) that means nothing to the user.
_MAX_DIGITS = 18


def _number(text: str) -> int | None:
    """A step or worker number written as text ('1'), or None."""
    text = text.strip()
    return int(text) if len(text) <= _MAX_DIGITS and _STEP_NUMBER.fullmatch(text) else None


def _json_int(text: str) -> int | str:
    """A JSON integer; one too long to be any number of a plan stays text, so the step's own check names it."""
    return int(text) if len(text) <= _MAX_DIGITS else text


_PLAIN = json.JSONDecoder(strict=False)  # strict=False: model output often holds raw control characters
_LONG_INTS = json.JSONDecoder(strict=False, parse_int=_json_int)


def _decoded(text: str, start: int = 0) -> tuple[Any, int]:
    """json's raw_decode; a number past Python's int digit limit is read again as text (_json_int),
    only then: a Python call per integer made a reply of many numbers a hundred times slower."""
    try:
        return _PLAIN.raw_decode(text, start)
    except ValueError as e:
        if "digit" not in str(e):
            raise
        return _LONG_INTS.raw_decode(text, start)


def _condition_of(step: dict, i: int) -> Condition | None:
    """The step's condition under any of its keys; a null (or "none", "") under one does not hide
    another. They are compared as read, so one condition written twice in two spellings is one."""
    given = {k: c for k in ("when", "if", "condition")
             if step.get(k) is not None and (c := _resolve_condition(step[k], i)) is not None}
    if len(set(given.values())) > 1:
        raise PlanError(f"step {i}: gives {' and '.join(given)} with different conditions; give one")
    return next(iter(given.values()), None)


_CALL = re.compile(r"^\s*([a-z_ ]+?)\s*\(\s*(.*?)\s*\)\s*$", re.I)


def _resolve_condition(raw: Any, i: int) -> Condition | None:
    """`when` in any of its spellings: {"disagree": [0, 1]}, {"kind": "disagree", "steps": [0, 1]},
    "disagree(0, 1)", or null / "" / "none" for no condition."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null", "always")):
        return None
    if i == 0:
        raise PlanError("step 0: the first step cannot have a condition (a condition reads earlier steps)")
    if isinstance(raw, str):
        m = _CALL.match(raw)
        if not m:
            raise PlanError(f"step {i}: condition {shown_value(raw)} is not of the form disagree(0, 1) "
                            f"or no_majority(0, 1, 2)")
        kind, args = m.group(1), m.group(2)
        steps = [_number(a) for a in args.split(",") if a.strip()]
        if None in steps:
            raise PlanError(f"step {i}: condition {shown_value(raw)}: the steps must be step numbers")
    elif isinstance(raw, dict) and "kind" in raw:
        kind, steps = raw.get("kind"), raw.get("steps")
    elif isinstance(raw, dict) and len(raw) == 1:
        kind, steps = next(iter(raw.items()))
    else:
        raise PlanError(f"step {i}: condition must be like {{\"disagree\": [0, 1]}} (got {shown_value(raw)})")
    kind = str(kind).strip().lower().replace(" ", "_").replace("-", "_")
    if kind not in CONDITIONS:
        raise PlanError(f"step {i}: unknown condition {shown_value(kind)} (known: {', '.join(CONDITIONS)})")
    if not isinstance(steps, (list, tuple)) or len(steps) < 2:
        raise PlanError(f"step {i}: condition {kind} needs a list of at least two earlier steps "
                        f"(got {shown_value(steps)})")
    out = []
    for a in steps:
        if isinstance(a, str) and _number(a) is not None:
            a = _number(a)
        if isinstance(a, bool) or not isinstance(a, int) or a < 0:
            raise PlanError(f"step {i}: condition {kind}: {shown_value(a)} is not a step number")
        if a >= i:
            raise PlanError(f"step {i}: condition {kind} reads step {shown_value(a)}, which is not earlier "
                            f"(steps may only read steps 0..{i - 1})")
        out.append(a)
    if len(set(out)) < 2:
        raise PlanError(f"step {i}: condition {kind} needs at least two different steps (got {out})")
    return Condition(kind, tuple(sorted(set(out))))


def _resolve_worker(ref: Any, ids: list[str], i: int) -> str:
    if isinstance(ref, bool):
        raise PlanError(f"step {i}: worker must be an id or a number, not {shown_value(ref)}")
    if isinstance(ref, int):
        if 0 <= ref < len(ids):
            return ids[ref]
        raise PlanError(f"step {i}: worker number {shown_value(ref)} is out of range "
                        f"(the pool has workers 0..{len(ids) - 1})")
    if isinstance(ref, str):
        ref = ref.strip()
        if ref in ids:
            return ref
        if (n := _number(ref)) is not None and n < len(ids):
            return ids[n]
        raise PlanError(f"step {i}: worker {shown_value(ref)} is not in the pool (known: {', '.join(ids)})")
    if ref is None:
        raise PlanError(f"step {i}: worker is missing")
    raise PlanError(f"step {i}: worker must be an id or a whole number, not {shown_value(ref)}")


def _resolve_access(acc: Any, i: int) -> tuple[int, ...]:
    if acc is None or acc == "none" or acc == []:
        return ()
    if acc == "all":
        return tuple(range(i))
    if isinstance(acc, int) and not isinstance(acc, bool):
        acc = [acc]
    if not isinstance(acc, (list, tuple)):
        raise PlanError(f"step {i}: access must be a list of earlier step numbers, \"all\", or empty "
                        f"(got {shown_value(acc)})")
    if "all" in acc:
        return tuple(range(i))
    out = set()
    for a in acc:
        if isinstance(a, str) and _number(a) is not None:
            a = _number(a)
        if isinstance(a, bool) or not isinstance(a, int):
            raise PlanError(f"step {i}: access entry {shown_value(a)} is not a step number")
        if a < 0:
            raise PlanError(f"step {i}: access entry {shown_value(a)} is negative")
        if a >= i:
            seen = "the first step can see no other step" if i == 0 else f"step {i} may only see steps 0..{i - 1}"
            raise PlanError(f"step {i}: access entry {shown_value(a)} refers to a step that is not earlier ({seen})")
        out.add(a)
    return tuple(sorted(out))


# What a reply's error begins with when its last plan, three lists, came after a JSON plan: the
# user reading the reply sees a JSON plan and learns why that one did not run.
AFTER_JSON = "the three-list plan after the JSON plan (the reply's last plan, the one read)"


def _last_plan(text: str) -> tuple[Any, bool]:
    """The reply's last plan, whatever its format, and whether it is three lists after a JSON plan.
    A model may draft in one format and answer in the other: its answer is the last plan, so three
    lists (model_id, subtasks and access_list) after a JSON plan are the plan, and if they are broken
    the reply is, as a final JSON plan that is broken is (the draft before it is not run in its
    place: a trace would show a plan the model did not give as its answer). Lists that are not all
    three (prose, a partial recap), or lists inside the JSON plan, leave it the plan."""
    found = _parse_json(text)
    if found is None:
        return _parse_three_lists(text), False
    data, (_, end) = found
    if "[" not in text[end:]:  # the common reply: nothing after its JSON plan could be a list
        return data, False
    starts = _list_starts(text)
    if all(k in starts for k in _REQUIRED_LISTS) and min(starts.values()) >= end:
        try:
            return _parse_three_lists(text), True
        except PlanError as e:
            raise PlanError(f"{AFTER_JSON}: {e}") from None
    return data, False


def _parse_json(text: str) -> tuple[Any, tuple[int, int]] | None:
    """Find a JSON plan in text: the whole text, or else the last plan in it, fenced or not (a model
    may write a draft, then the plan). Candidates: each fenced block, the text from its first { to
    its last }, and each object that starts with "steps"; one inside another is part of that one.
    Returns the plan and where it is in the text."""
    if (data := _json_plan(text.strip())) is not None:
        return data, (0, len(text))
    found = {}  # (start, end) -> plan
    for m in _FENCED.finditer(text):
        if (data := _json_plan(m.group(1))) is not None:
            found[m.span(1)] = data
    start, end = text.find("{"), text.rfind("}") + 1
    if start >= 0 and (data := _json_plan(text[start:end])) is not None:
        found[(start, end)] = data
    for m in list(_STEPS_OBJECT.finditer(text))[::-1][:_MAX_OBJECTS]:
        try:
            data, stop = _decoded(text, m.start())
        except (ValueError, RecursionError):
            continue
        if _is_plan(data):
            found[(m.start(), stop)] = data
    last, reach = None, -1
    for (start, end), data in sorted(found.items(), key=lambda f: (f[0][0], -f[0][1])):
        if end > reach:  # not inside a candidate that starts before it
            last, reach = (data, (start, end)), end
    return last


def _json_plan(text: str) -> Any:
    """text as a JSON plan (an object with "steps", or a list of steps), else None."""
    text = text.lstrip()
    try:
        data, end = _decoded(text)
        if text[end:].strip():
            return None  # more than one JSON value: not this candidate
    except (ValueError, RecursionError):
        return None
    if _is_plan(data) or (isinstance(data, list) and data
                          and all(isinstance(s, dict) and "worker" in s for s in data)):
        return data
    return None


_FENCED = re.compile(r"```(?:json)?\s*(.*?)```", re.S)
_STEPS_OBJECT = re.compile(r'\{\s*"steps"\s*:')
_MAX_OBJECTS = 20  # each try may read to the text's end: bounded, for a reply full of them


def _is_plan(data: Any) -> bool:
    # {"kind": "disagree", "steps": [0, 1]} in a fourth list also has "steps": not a plan.
    return isinstance(data, dict) and "steps" in data and not _is_condition(data)


def _is_condition(data: dict) -> bool:
    steps = data.get("steps")
    return "kind" in data and isinstance(steps, list) and all(isinstance(a, (int, str)) for a in steps)


_LIST_NAMES = {"model_id": ("model_id", "model_ids", "models"),
               "subtasks": ("subtasks", "subtask", "instructions"),
               "access_list": ("access_list", "access", "access_lists"),
               "conditions": ("conditions", "condition_list")}
_REQUIRED_LISTS = ("model_id", "subtasks", "access_list")
# The JSON format's key, and its singular: a model that names the fourth list so meant conditions
# (ignored, its escalation ran on every query). Read only outside the other lists (an instruction's code).
_CONDITION_ALIASES = ("when", "condition")


def _assignments(text: str, name: str) -> list[re.Match]:
    return list(re.finditer(rf"(?<![A-Za-z_]){re.escape(name)}\s*[=:]\s*\[", text))


def _list_starts(text: str) -> dict[str, int]:
    """Where each list of a three-list plan is assigned last (the assignment that is read), by name found."""
    starts = {}
    for key, names in _LIST_NAMES.items():
        for name in names:
            if matches := _assignments(text, name):
                starts[key] = matches[-1].start()
                break
    return starts


def _parse_three_lists(text: str) -> list[dict] | None:
    found, spans = {}, []
    for key, names in _LIST_NAMES.items():
        value = None
        for name in names:
            if (got := _last_assignment(text, name)) is not None:
                value, span = got
                spans.append(span)
                break
        found[key] = value
    conditions = found.pop("conditions")
    if all(v is None for v in found.values()):
        return None
    missing = [k for k, v in found.items() if v is None]
    if missing:
        raise PlanError(f"three-list plan is missing {', '.join(missing)}")
    models, subtasks, access = found["model_id"], found["subtasks"], found["access_list"]
    for name, v in (("model_id", models), ("subtasks", subtasks), ("access_list", access)):
        if not isinstance(v, list):
            raise PlanError(f"{name} must be a list")
    if not (len(models) == len(subtasks) == len(access)):
        raise PlanError(f"list lengths differ: model_id has {len(models)}, subtasks {len(subtasks)}, access_list {len(access)}")
    if conditions is None:
        conditions = _aliased_conditions(text, spans, len(models))
    if conditions is None:
        conditions = [None] * len(models)
    if not isinstance(conditions, list):
        raise PlanError("conditions must be a list")
    if len(conditions) != len(models):
        raise PlanError(f"list lengths differ: model_id has {len(models)}, conditions {len(conditions)}")
    return [{"worker": m, "instruction": s, "access": a, "when": c}
            for m, s, a, c in zip(models, subtasks, access, conditions)]


def _aliased_conditions(text: str, spans: list[tuple[int, int]], steps: int) -> list | None:
    """A list named as the JSON key (`when = [...]`) outside the plan's other lists, read as its
    conditions when it is one: a list of one entry per step. Anything else of that name (code, prose)
    is not part of the plan."""
    for name in _CONDITION_ALIASES:
        try:
            got = _last_assignment(text, name, outside=spans)
        except PlanError:
            continue
        if got is not None and isinstance(got[0], list) and len(got[0]) == steps:
            return got[0]
    return None


def _last_assignment(text: str, name: str,
                     outside: list[tuple[int, int]] = ()) -> tuple[Any, tuple[int, int]] | None:
    """The value of the last `name = [...]` not inside one of the spans `outside`, and its span."""
    for m in reversed(_assignments(text, name)):
        if any(a <= m.start() < b for a, b in outside):
            continue
        literal = _balanced(text, m.end() - 1)
        if literal is None:
            raise PlanError(f"{name}: the list is not closed")
        return _literal(literal, name), (m.start(), m.end() - 1 + len(literal))
    return None


def _balanced(text: str, start: int) -> str | None:
    """The list that opens at text[start], to its closing bracket, or None when it is not closed.
    Brackets inside quotes do not count; a quote not closed runs to the end of the text."""
    depth = 0
    for m in _BRACKET_OR_STRING.finditer(text, start):
        ch = m.group()
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth == 0:
                return text[start: m.end()]
        elif len(ch) == 1:  # a quote that no later quote closes
            return None
    return None


# A bracket, a quoted string (a backslash escapes the next character), or a lone quote.
_BRACKET_OR_STRING = re.compile(r"""[\[\]]|"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|["']""", re.S)


def _literal(src: str, name: str) -> Any:
    try:
        return json.loads(src, strict=False, parse_int=_json_int)
    except (ValueError, RecursionError):
        pass
    # Model text may hold raw newlines inside quotes; Python literals reject those, so the text is
    # tried again with them escaped (only when it has any). A conditions list may mix JSON's null
    # with Python's None (`[None, null, "disagree(0, 1)"]`): it is read with JSON's names written
    # as Python's, in one linear pass, at any length; a list that reads as written reads the same so.
    conditions = name in (*_LIST_NAMES["conditions"], *_CONDITION_ALIASES)
    tries = [src]
    if "\n" in src or "\r" in src:
        tries.append(src.replace("\n", "\\n").replace("\r", ""))
    for text in tries:
        try:
            return _python_literal(_python_names(text) if conditions and _has_json_names(text) else text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    raise PlanError(f"{name}: not a valid list literal")


_JSON_NAMES = {"null": "None", "true": "True", "false": "False"}
# What in Python text can hold or hide a name: a string (triple-quoted first; a one-line string ends
# at its line, as Python's does), a comment, or the name itself. A quote that opens no whole string
# matches `open`, where the rewrite stops: Python cannot read that text either. Each alternative
# starts with its own character and each string scan runs once, so the pass is linear.
_NAME_SCAN = re.compile(r"""
    "{3}(?:[^"\\]|\\.|"(?!""))*"{3} | '{3}(?:[^'\\]|\\.|'(?!''))*'{3}
  | "(?:[^"\\\r\n]|\\.)*" | '(?:[^'\\\r\n]|\\.)*'
  | (?P<open>"{3}|'{3}|["'])
  | \#[^\r\n]*
  | (?<!\w)(?P<name>null|true|false)(?!\w)
""", re.S | re.X)


def _has_json_names(src: str) -> bool:
    return any(w in src for w in _JSON_NAMES)


def _python_names(src: str) -> str:
    """src with JSON's null, true and false outside strings and comments written as Python's None,
    True, False; src itself when a string in it is not closed."""
    pieces, at = [], 0
    for m in _NAME_SCAN.finditer(src):
        if m.group("open"):
            return src
        if name := m.group("name"):
            pieces += [src[at:m.start()], _JSON_NAMES[name]]
            at = m.end()
    return "".join(pieces) + src[at:]


def _python_literal(src: str) -> Any:
    """ast.literal_eval; an integer past Python's digit limit is read again as text, as _json_int
    does for JSON, so that the step's own check names it (and not Python's advice)."""
    try:
        return ast.literal_eval(src)
    except (ValueError, SyntaxError) as e:
        if "integer string conversion" not in str(e):
            raise
    return ast.literal_eval(_long_ints_as_text(src))


_DECIMAL = re.compile(r"[0-9](?:_?[0-9])*")
_OPENS = ("[", "(", ",", "{", ":")  # what a sign follows when it is a number's own


def _long_ints_as_text(src: str) -> str:
    """src with each integer of more than _MAX_DIGITS digits (and a sign before it) quoted as text."""
    starts = [0]  # offset of each line's start, as tokenize numbers lines from 1
    for line in io.StringIO(src).readlines():
        starts.append(starts[-1] + len(line))
    spans, before = [], [None, None]  # the two tokens before this one
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
                continue
            if tok.type == tokenize.NUMBER and len(tok.string) > _MAX_DIGITS and _DECIMAL.fullmatch(tok.string):
                first, sign = tok, ""
                sign_at, after = before[1], before[0]
                if sign_at and sign_at.string in ("-", "+") and after and after.string in _OPENS:
                    first, sign = sign_at, sign_at.string  # a sign of its own, not a subtraction
                start = starts[first.start[0] - 1] + first.start[1]
                spans.append((start, starts[tok.end[0] - 1] + tok.end[1], sign + tok.string))
            before = [before[1], tok]
    except (tokenize.TokenError, SyntaxError):
        return src
    for start, end, text in reversed(spans):
        src = src[:start] + repr(text) + src[end:]
    return src
