"""The simulated planner: a model with `simulate: {role: planner}` answers
planning prompts (conductor.planners.prompt) with a plan.

- With `response_format: {type: json_schema}`: a plan valid under the request's
  schema. Workers come from the schema's enum, step counts from its item
  limits, access entries from each position's enum (earlier steps only), and
  instructions are fitted to its pattern.
- Without it: one short reasoning line, then the three lists
  (model_id, subtasks, access_list) of the free mode.

The plan is random but sensible, so that executing it means something: the
first step solves the question (quoted verbatim when the schema allows, so the
simulated workers recognize it), later steps solve again, check an earlier
step, vote over all of them, or, with probability `replan_rate`, hand the rest
to a planner worker. With probability `cascade_rate` (when three llm workers
and three steps are available) the plan is a cascade instead: two workers
solve, and a third solves only when their answers disagree (`when`). Kinds
are read from the prompt's worker list ("3. vote [function]: ..."), or, when it
has none, from the schema: a worker it offers only to steps that must see an
earlier one is a function (vote, extract), which never starts or solves. Free
plans keep to the prompt's "at most N steps". Like every simulated answer, the
plan is a pure function of (seed, model, request), so a repeated request gets
the same plan and a different `seed` in the request gets another one.
"""

from __future__ import annotations

import random
import re
from typing import Any

import orjson

_WORKER_LINE = re.compile(r"(?m)^(\d+)\. (\S+) \[(llm|function|planner)\]:(.*)$")
_QUESTION = re.compile(r"Question:\n(.*?)\n\n(?:Write the plan|Work done so far:)", re.S)
_TASK = re.compile(r"Task type: (\w+)")
_STEP_LIMIT = re.compile(r"workflow of at most (\d+) steps")
_ANSWER = {"math": "<number>", "choice": "<letter>", "exact": "<answer>"}
# Printable ASCII without '"' and '\': what the planner schema's instructions allow.
_UNSAFE = re.compile(r'[^ !#-\[\]-~]')
_MAX_STEPS = 3  # plans the sim writes have at most this many steps


def plan_reply(messages: list[dict[str, Any]], texts: list[str], body: dict[str, Any], rng: random.Random,
               replan_rate: float = 0.0, cascade_rate: float = 0.0) -> str:
    """The planner's completion for one chat request."""
    system = "\n".join(t for m, t in zip(messages, texts) if m.get("role") == "system")
    user = next((t for m, t in zip(reversed(messages), reversed(texts)) if m.get("role") == "user"), "")
    m = _QUESTION.search(user)
    question = m.group(1).strip() if m else user.strip()
    t = _TASK.search(user)
    task = t.group(1) if t else None
    kinds = {wid: kind for _, wid, kind, _ in _WORKER_LINE.findall(system)}
    voters = {wid for _, wid, kind, desc in _WORKER_LINE.findall(system)
              if kind == "function" and "most common" in desc}
    replan = "Work done so far:" in user
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema") or {}
        if _is_plan_schema(schema):
            return orjson.dumps(_schema_plan(schema, kinds, voters, question, task, replan, rng,
                                             replan_rate, cascade_rate)).decode()
        return orjson.dumps(instance(schema, rng)).decode()
    ids = list(kinds) or ["0"]
    limit = _STEP_LIMIT.search(system)
    most = min(int(limit.group(1)), _MAX_STEPS) if limit else _MAX_STEPS
    steps = _draft(ids, kinds, voters, question, task, replan, rng, replan_rate, most, cascade_rate)
    reasoning = (f"Reasoning: {'the remaining work' if replan else 'this question'} needs {len(steps)} "
                 f"step(s): {', '.join(s['role'] for s in steps)}.")
    lines = [
        reasoning,
        "model_id = " + orjson.dumps([s["worker"] for s in steps]).decode(),
        "subtasks = " + orjson.dumps([s["instruction"] for s in steps]).decode(),
        "access_list = " + orjson.dumps([s["access"] for s in steps]).decode(),
    ]
    if any("when" in s for s in steps):  # the optional fourth list
        lines.append("conditions = " + orjson.dumps([_call(s.get("when")) for s in steps]).decode())
    return "\n".join(lines)


def _call(when: dict[str, list[int]] | None) -> str | None:
    """{"disagree": [0, 1]} as the fourth list writes it: "disagree(0, 1)"."""
    if not when:
        return None
    kind, listed = next(iter(when.items()))
    return f"{kind}({', '.join(map(str, listed))})"


def token_logprobs(content: str, rng: random.Random) -> dict[str, Any]:
    """OpenAI-style `logprobs` for a completion: 4-character tokens with made-up log-probabilities."""
    tokens = [content[i:i + 4] for i in range(0, len(content), 4)] or [""]
    return {"content": [{"token": tok, "logprob": round(-rng.random() * 0.5, 6), "bytes": list(tok.encode()),
                         "top_logprobs": []} for tok in tokens]}


# ---- the plan ---------------------------------------------------------------

def _draft(ids: list[str], kinds: dict[str, str], voters: set[str], question: str, task: str | None,
           replan: bool, rng: random.Random, replan_rate: float, max_steps: int,
           cascade_rate: float = 0.0) -> list[dict[str, Any]]:
    """Steps as {worker, instruction, access, role[, when]}; workers from `ids` only."""
    llms = [w for w in ids if kinds.get(w, "llm") == "llm"] or list(ids)
    planners = [w for w in ids if kinds.get(w) == "planner"]
    votes = [w for w in ids if w in voters]
    answer = f" End with a final line Answer: {_ANSWER.get(task, '<answer>')}"
    first = (f"Check the work done so far on this question, then answer it: {question}{answer}" if replan
             else f"{question}{answer}")
    # Three distinct workers: a repeated one would get the same request and the same answer.
    if cascade_rate > 0 and max_steps >= 3 and len(set(llms)) >= 3 and rng.random() < cascade_rate:
        a, b, c = rng.sample(sorted(set(llms)), 3)
        return [{"worker": a, "instruction": first, "access": [], "role": "solve"},
                {"worker": b, "instruction": first, "access": [], "role": "solve"},
                {"worker": c, "instruction": first, "access": [], "role": "escalate",
                 "when": {"disagree": [0, 1]}}]
    n = rng.randint(1, max(1, max_steps))
    steps = [{"worker": rng.choice(llms), "instruction": first, "access": [], "role": "solve"}]
    for i in range(1, n):
        last = i == n - 1
        if planners and rng.random() < replan_rate:
            steps.append({"worker": rng.choice(planners), "access": list(range(i)), "role": "re-plan",
                          "instruction": f"Plan and run a check of the answers above to this question: {question}"})
        elif votes and last and i >= 2 and rng.random() < 0.5:
            steps.append({"worker": rng.choice(votes), "access": list(range(i)), "role": "vote",
                          "instruction": "Pick the answer most of the steps above agree on."})
        elif rng.random() < 0.5:
            steps.append({"worker": rng.choice(llms), "access": [i - 1], "role": "check",
                          "instruction": f"Check the solution above to this question and correct it if it is "
                                         f"wrong: {question}{answer}"})
        else:
            steps.append({"worker": rng.choice(llms), "access": [], "role": "solve",
                          "instruction": f"{question}{answer}"})
    return steps


def _is_plan_schema(schema: dict[str, Any]) -> bool:
    steps = (schema.get("properties") or {}).get("steps") or {}
    items = steps.get("prefixItems") or ([steps["items"]] if isinstance(steps.get("items"), dict) else [])
    return bool(items) and all(
        {"worker", "instruction", "access"} <= set((b.get("properties") or {})) for s in items for b in _branches(s))


def _branches(step_schema: dict[str, Any]) -> list[dict[str, Any]]:
    """A step's alternatives (conductor's schema gives function workers their own branch)."""
    return step_schema.get("anyOf") or [step_schema]


def _schema_plan(schema: dict[str, Any], kinds: dict[str, str], voters: set[str], question: str,
                 task: str | None, replan: bool, rng: random.Random, replan_rate: float,
                 cascade_rate: float = 0.0) -> dict[str, Any]:
    steps_schema = schema["properties"]["steps"]
    prefix = steps_schema.get("prefixItems")
    at = (lambda i: prefix[i]) if prefix else (lambda i: steps_schema["items"])
    most = steps_schema.get("maxItems", len(prefix) if prefix else _MAX_STEPS)
    if prefix:
        most = min(most, len(prefix))
    least = steps_schema.get("minItems", 1)
    branches = [b for i in range(most) for b in _branches(at(i))]
    ids = list(dict.fromkeys(w for b in branches for w in _workers(b))) or list(kinds) or ["0"]
    kinds = kinds or _kinds_in(branches)
    if most < 3 or "when" not in _branches(at(2))[0]["properties"]:
        cascade_rate = 0.0  # the schema cannot carry the escalation's condition
    steps = _draft(ids, kinds, voters, question, task, replan, rng, replan_rate, min(most, _MAX_STEPS),
                   cascade_rate)
    while len(steps) < least:
        steps.append(dict(steps[0]))
    out = []
    for i, s in enumerate(steps[:most]):
        branches = _branches(at(i))
        props = next((b["properties"] for b in branches
                      if s["worker"] in (b["properties"]["worker"].get("enum") or ())), branches[0]["properties"])
        enum = props["worker"].get("enum")
        worker = s["worker"] if not enum or s["worker"] in enum else rng.choice(enum)
        step = {"worker": worker, "instruction": fit(s["instruction"], props["instruction"]),
                "access": _fit_access(s["access"], props["access"])}
        when = _fit_when(s.get("when"), props.get("when"))
        if when is not None:
            step["when"] = when
        out.append(step)
    return {"steps": out}


def _workers(branch: dict[str, Any]) -> list[str]:
    return branch["properties"]["worker"].get("enum") or []


def _kinds_in(branches: list[dict[str, Any]]) -> dict[str, str]:
    """Kinds told by the schema alone: a worker offered only where the step must see an earlier
    one (access minItems, conductor's branch for vote and extract) is a function; the rest are
    taken for models."""
    def must_see(b: dict[str, Any]) -> bool:
        return b["properties"]["access"].get("minItems", 0) > 0

    free = {w for b in branches if not must_see(b) for w in _workers(b)}
    return {w: "llm" if w in free else "function" for b in branches for w in _workers(b)}


def fit(text: str, schema: dict[str, Any]) -> str:
    """`text`, changed as little as needed to match the schema's pattern and length."""
    pattern = schema.get("pattern")
    most = schema.get("maxLength")
    candidate = text[:most] if most else text
    if pattern is None or re.search(pattern, candidate):
        return candidate
    candidate = " ".join(_UNSAFE.sub(" ", candidate).split())
    lo, hi = 1, len(candidate)
    if re.search(pattern, candidate):
        return candidate
    best = None
    while lo <= hi:  # the longest prefix that matches: patterns here bound the length
        mid = (lo + hi) // 2
        if re.search(pattern, candidate[:mid].rstrip()):
            best, lo = candidate[:mid].rstrip(), mid + 1
        else:
            hi = mid - 1
    return best if best is not None else "Answer the question."


def _fit_when(when: dict[str, list[int]] | None, schema: dict[str, Any] | None) -> dict[str, list[int]] | None:
    """The condition as the schema allows it, or None when it allows no such condition."""
    if not when or not schema:
        return None
    kind, listed = next(iter(when.items()))
    for option in schema.get("anyOf") or [schema]:
        spec = (option.get("properties") or {}).get(kind)
        if spec is None:
            continue
        if "enum" in spec:  # the allowed step sets, listed
            return {kind: list(listed)} if list(listed) in spec["enum"] else None
        enum = (spec.get("items") or {}).get("enum")
        steps = [j for j in listed if enum is None or j in enum][:spec.get("maxItems", len(listed))]
        if len(steps) >= spec.get("minItems", 0):
            return {kind: steps}
    return None


def _fit_access(access: list[int], schema: dict[str, Any]) -> list[Any]:
    enum = (schema.get("items") or {}).get("enum")
    allowed = [a for a in access if enum is None or a in enum]
    most = schema.get("maxItems")
    allowed = allowed[:most] if most is not None else allowed
    for a in enum or []:  # a vote's branch asks for at least one earlier step (minItems)
        if len(allowed) >= schema.get("minItems", 0):
            break
        if a not in allowed and a != "all":
            allowed.append(a)
    return allowed


# ---- any other schema --------------------------------------------------------

def instance(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    """A random document valid under a simple JSON schema (types, enum, const,
    properties/required, items/prefixItems, min/max items, numeric bounds)."""
    if not isinstance(schema, dict) or depth > 8:
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return instance(rng.choice(schema[key]), rng, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = rng.choice([k for k in kind if k != "null"] or kind)
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        return {k: instance(v, rng, depth + 1) for k, v in props.items() if k in required or rng.random() < 0.5}
    if kind == "array":
        prefix = schema.get("prefixItems") or []
        items = schema.get("items")
        least = schema.get("minItems", 0)
        most = schema.get("maxItems", max(least, len(prefix), 3))
        if items is False:
            most = min(most, len(prefix))
        n = rng.randint(least, max(least, min(most, least + 3)))
        return [instance(prefix[i] if i < len(prefix) else items, rng, depth + 1) for i in range(n)]
    if kind == "integer":
        lo, hi = schema.get("minimum", 0), schema.get("maximum", 100)
        return rng.randint(int(lo), int(hi))
    if kind == "number":
        return rng.uniform(schema.get("minimum", 0.0), schema.get("maximum", 1.0))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "string":
        return fit("simulated text", schema)
    return None
