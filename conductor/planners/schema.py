"""The JSON schema that grammar-constrained decoding holds a planner to.

Every document the schema admits is a plan `conductor.plans.validate_plan`
accepts:

- workers: an enum of the pool's ids; a function worker (vote, extract) only
  from step 1 on and with at least one access entry, as a second branch
  (`anyOf`) of the step's schema, since it combines earlier answers;
- 1..max_steps steps, one schema per position (`prefixItems`, no further
  items), so step i's access entries are an enum of 0..i-1 and "all": JSON
  schema cannot say "lower than my own index", a per-position enum can;
- conditions: from step 2 on, an optional `when` naming one condition kind
  and a set of 2..MAX_CONDITION_STEPS earlier steps, listed as an enum of the
  sorted sets (a plain array could repeat a step);
- instructions: printable ASCII without `"` or `\\`, starting with a
  non-space, at most `instruction_chars` long (a bounded regex, in blocks of
  at most 100 repeats: xgrammar refuses bounds above 128, and does not
  combine `pattern` with `maxLength`). No escapes means no control
  characters, and one character is at least one token, so
  `max_plan_chars` bounds the tokens a compact plan can take: give the engine
  that many and every plan closes.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any, Sequence

from conductor.plans import CONDITIONS
from conductor.pool import WORKER_KINDS, Pool

MAX_CONDITION_STEPS = 3  # a condition reads at most this many steps: keeps the grammar small
# One schema per step position, each listing its condition sets: 20 steps make 0.3 MB, 100 made 220 MB.
MAX_SCHEMA_STEPS = 20
# Completion tokens a free-text plan may take (structured plans are bounded by max_plan_chars): room for
# max_steps long instructions in either format, for every planner back end.
FREE_MAX_TOKENS = 2048

# Printable ASCII minus '"' (0x22) and '\' (0x5c).
_CHAR = r"[ !#-\[\]-~]"
_FIRST = r"[!#-\[\]-~]"


# xgrammar (0.2.8) refuses a repeat bound above 128, so longer bounds are written in blocks.
_MAX_REPEAT = 100


def instruction_pattern(instruction_chars: int) -> str:
    if instruction_chars < 1:
        raise ValueError(f"instruction_chars must be at least 1 (got {instruction_chars})")
    return f"^{_FIRST}{_at_most(_CHAR, instruction_chars - 1)}$"


def _at_most(atom: str, most: int) -> str:
    """`atom{0,most}` with no repeat bound above _MAX_REPEAT: a length below q blocks is some full blocks
    and a short tail; q full blocks take a tail of at most the remainder."""
    if most <= _MAX_REPEAT:
        return f"{atom}{{0,{most}}}"
    q, r = divmod(most, _MAX_REPEAT)
    block = f"(?:{atom}{{{_MAX_REPEAT}}})"
    below = f"{_at_most(block, q - 1)}{atom}{{0,{_MAX_REPEAT - 1}}}"
    return f"(?:{below}|{_exactly(block, q)}{atom}{{0,{r}}})"


def _exactly(atom: str, n: int) -> str:
    if n <= _MAX_REPEAT:
        return f"{atom}{{{n}}}"
    q, r = divmod(n, _MAX_REPEAT)
    return f"(?:{_exactly(f'(?:{atom}{{{_MAX_REPEAT}}})', q)}{atom}{{{r}}})"


def shape_problem(max_steps: object, kinds: Sequence[str]) -> str | None:
    """Why a model planner cannot be held to this schema with these settings, or None."""
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or not 1 <= max_steps <= MAX_SCHEMA_STEPS:
        return f"max_steps must be a whole number from 1 to {MAX_SCHEMA_STEPS} (got {max_steps!r})"
    if all(k == "function" for k in kinds):
        return (f"kinds must include llm or planner: a plan's first step cannot be a function worker "
                f"(got {', '.join(kinds) or 'none'})")
    return None


def plan_schema(pool: Pool, max_steps: int = 5, instruction_chars: int = 600, *,
                kinds: Sequence[str] = WORKER_KINDS) -> dict[str, Any]:
    """JSON schema for {"steps": [...]} over the pool's workers of `kinds`."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be at least 1 (got {max_steps})")
    ids = [w.id for w in pool.workers if w.kind in kinds and w.kind != "function"]
    functions = [w.id for w in pool.workers if w.kind in kinds and w.kind == "function"]
    if not ids:
        raise ValueError(f"the pool has no workers of kind {', '.join(k for k in kinds if k != 'function')} "
                         f"to plan with")
    pattern = instruction_pattern(instruction_chars)
    steps = [_step_schema(i, ids, functions, pattern) for i in range(max_steps)]
    return {
        "type": "object",
        "properties": {
            "steps": {"type": "array", "minItems": 1, "maxItems": max_steps,
                      "prefixItems": steps, "items": False},
        },
        "required": ["steps"],
        "additionalProperties": False,
    }


def _step_schema(i: int, ids: list[str], functions: list[str], pattern: str) -> dict[str, Any]:
    if i == 0:
        return _one_step(i, ids, {"type": "array", "maxItems": 0}, pattern)
    # Up to i entries: enough to list every earlier step once.
    access = {"type": "array", "items": {"enum": [*range(i), "all"]}, "maxItems": i}
    step = _one_step(i, ids, access, pattern)
    if not functions:
        return step
    return {"anyOf": [step, _one_step(i, functions, {**access, "minItems": 1}, pattern)]}


def _one_step(i: int, ids: list[str], access: dict[str, Any], pattern: str) -> dict[str, Any]:
    props: dict[str, Any] = {
        "worker": {"type": "string", "enum": ids},
        "instruction": {"type": "string", "pattern": pattern},
        "access": access,
    }
    if i >= 2:
        sets = [list(c) for k in range(2, min(i, MAX_CONDITION_STEPS) + 1) for c in combinations(range(i), k)]
        listed = {"enum": sets}
        props["when"] = {"anyOf": [{"type": "object", "properties": {kind: listed}, "required": [kind],
                                    "additionalProperties": False} for kind in CONDITIONS]}
    return {
        "type": "object",
        "properties": props,
        "required": ["worker", "instruction", "access"],
        "additionalProperties": False,
    }


def max_plan_chars(pool: Pool, max_steps: int = 5, instruction_chars: int = 600, *,
                   kinds: Sequence[str] = WORKER_KINDS) -> int:
    """Length of the longest compact document `plan_schema` admits."""
    longest_id = max(len(w.id) for w in pool.workers if w.kind in kinds)
    longest_first = max(len(w.id) for w in pool.workers if w.kind in kinds and w.kind != "function")
    total = len('{"steps":[') + len("]}")
    for i in range(max_steps):
        total += len('{"worker":""') + (longest_id if i else longest_first) + len(',"instruction":""')
        total += instruction_chars
        total += len(',"access":[]}')
        if i:
            entry = max(len(str(i - 1)), len('"all"'))
            total += i * entry + (i - 1)  # entries and their commas
            total += 1  # the comma before this step
        if i >= 2:
            n = min(i, MAX_CONDITION_STEPS)
            total += len(',"when":{"":[]}') + max(len(k) for k in CONDITIONS) + n * len(str(i - 1)) + (n - 1)
    return total
