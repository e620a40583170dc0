"""Planner prompts and the plan schema: no engine needed, runs in a second."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from conductor.errors import PlanError
from conductor.planners import prompt as P
from conductor.planners.base import Query
from conductor.planners.schema import MAX_CONDITION_STEPS, max_plan_chars, plan_schema
from conductor.plans import parse_plan, validate_plan
from conductor.pool import parse_pool

POOL = parse_pool({"workers": [
    {"id": "qwen-small", "model": "openai/qwen-small", "description": "Fast small model, good at arithmetic."},
    {"id": "llama-large", "model": "openai/llama-large", "description": "Strong general model,\n  slower."},
    {"id": "mistral-mid", "model": "openai/mistral-mid"},
    {"id": "vote", "kind": "function", "function": "vote"},
    {"id": "sub-planner", "kind": "planner", "model": "openai/planner"},
]})
Q1 = Query("q1", "What is 6 * 7?", "math")
Q2 = Query("q2", "Which is a mammal? A) shark B) whale", "choice")


def render(messages):
    """ChatML, as the test model's template renders it."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


@pytest.mark.parametrize("mode", P.MODES)
def test_shared_prefix_is_identical_and_the_question_comes_last(mode):
    a, b = render(P.messages(Q1, POOL, mode)), render(P.messages(Q2, POOL, mode))
    system = P.system_prompt(POOL, mode)
    common = len(system) + len("<|im_start|>system\n")
    assert a[:common] == b[:common]
    assert Q1.prompt not in system and Q2.prompt not in system
    # Nothing query-specific before the user turn; the question sits in it.
    user_at = a.index("<|im_start|>user")
    assert a[:user_at] == b[:b.index("<|im_start|>user")]
    assert a.index(Q1.prompt) > user_at and "Task type: math" in a[user_at:]


def test_pool_is_numbered_from_zero_with_ids_kinds_and_descriptions():
    text = P.system_prompt(POOL, "structured")
    assert "0. qwen-small [llm]: Fast small model, good at arithmetic." in text
    assert "1. llama-large [llm]: Strong general model, slower." in text  # whitespace folded
    assert "2. mistral-mid [llm]: general model openai/mistral-mid" in text
    assert re.search(r"^3\. vote \[function\]: returns the most common final answer", text, re.M)
    assert "4. sub-planner [planner]:" in text


def test_kinds_filter_keeps_pool_numbers():
    text = P.system_prompt(POOL, "free", kinds=("llm", "function"))
    assert "sub-planner" not in text
    assert "3. vote [function]" in text


@pytest.mark.parametrize("max_steps", [1, 2, 5])
@pytest.mark.parametrize("mode", P.MODES)
def test_one_example_per_task_type_and_each_is_a_valid_plan(mode, max_steps):
    text = P.system_prompt(POOL, mode, max_steps=max_steps)
    examples = text.split("Examples:\n\n", 1)[1].split("\n\nTask type: ")
    assert [e.removeprefix("Task type: ").split("\n", 1)[0] for e in examples] == ["math", "choice", "exact"]
    for e in examples:
        plan = parse_plan(e.split("Plan:\n", 1)[1], POOL, max_steps=max_steps)
        assert plan.steps and all(s.worker in POOL.ids for s in plan.steps)
    if mode == "structured":
        assert '{"steps": [{"worker": "<worker id>"' in text
    else:
        assert "model_id = [" in text and "access_list = [" in text


def test_format_and_limits_are_stated():
    text = P.system_prompt(POOL, "structured", max_steps=3, instruction_chars=77)
    assert "at most 3 steps" in text and "at most 77 characters" in text
    with pytest.raises(ValueError, match="mode"):
        P.system_prompt(POOL, "freestyle")


def test_template_version_is_a_named_string():
    assert isinstance(P.TEMPLATE_VERSION, str) and P.TEMPLATE_VERSION.startswith("planner-prompt-v")


def test_replan_messages_show_prior_outputs_after_the_shared_prefix():
    msgs = P.replan_messages(Q1, [("Solve 6 * 7.", "Answer: 41"), ("Check it.", "Wrong; Answer: 42")], POOL)
    assert msgs[0] == P.messages(Q1, POOL)[0]
    user = msgs[1]["content"]
    assert user.index(Q1.prompt) < user.index("Answer: 41") < user.index("Wrong; Answer: 42")
    assert "Step 1 output:\nWrong; Answer: 42" in user


# --- the schema ---------------------------------------------------------------

SCHEMA = plan_schema(POOL, max_steps=4, instruction_chars=40)
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def step(worker="qwen-small", instruction="Solve it.", access=()):
    return {"worker": worker, "instruction": instruction, "access": list(access)}


def test_schema_accepts_good_plans():
    doc = {"steps": [step(), step("llama-large", access=[0]), step("vote", access=["all"]),
                     step("sub-planner", access=[2, 0, 1])]}
    VALIDATOR.validate(doc)
    assert validate_plan(doc, POOL, 4).steps[3].access == (0, 1, 2)


@pytest.mark.parametrize("doc, why", [
    ({"steps": [step("gpt-9")]}, "unknown worker"),
    ({"steps": [step(access=[0])]}, "first step sees itself"),
    ({"steps": [step(), step(access=[1])]}, "step 1 sees step 1"),
    ({"steps": [step(), step(), step(access=[3])]}, "step 2 sees a later step"),
    ({"steps": [step(), step(access=[-1])]}, "negative access"),
    ({"steps": [step(), step(access=["none"])]}, "unknown access word"),
    ({"steps": []}, "no steps"),
    ({"steps": [step()] * 5}, "more than max_steps"),
    ({"steps": [step(instruction="   ")]}, "blank instruction"),
    ({"steps": [step(instruction="")]}, "empty instruction"),
    ({"steps": [step(instruction='say "hi"')]}, "quote in instruction"),
    ({"steps": [step(instruction="a\nb")]}, "control character"),
    ({"steps": [step(instruction="x" * 41)]}, "instruction too long"),
    ({"steps": [dict(step(), extra=1)]}, "extra field"),
    ({"steps": [{"worker": "vote", "instruction": "x"}]}, "access missing"),
    ({"plan": []}, "wrong top-level key"),
    ({"steps": [step("vote")]}, "a vote first: nothing to vote on"),
    ({"steps": [step(), step("vote")]}, "a vote that sees no step"),
])
def test_schema_rejects(doc, why):
    assert not VALIDATOR.is_valid(doc), why


def _random_doc(rng: random.Random, schema: dict) -> dict:
    """Sample a document the way a grammar would: any choice the schema allows."""
    steps_schema = schema["properties"]["steps"]
    n = rng.randint(1, steps_schema["maxItems"])
    chars = [chr(c) for c in range(0x20, 0x7F) if chr(c) not in '"\\']
    steps = []
    for i in range(n):
        s = rng.choice(steps_schema["prefixItems"][i].get("anyOf") or [steps_schema["prefixItems"][i]])["properties"]
        length = rng.randint(1, 40)
        instruction = rng.choice([c for c in chars if c != " "]) + "".join(rng.choices(chars, k=length - 1))
        acc = s["access"]
        n_access = rng.randint(acc.get("minItems", 0), acc["maxItems"]) if i else 0
        access = [rng.choice(acc["items"]["enum"]) for _ in range(n_access)]
        steps.append(step(rng.choice(s["worker"]["enum"]), instruction, access))
        if "when" in s and rng.random() < 0.5:  # a condition the schema allows
            kind = rng.choice(s["when"]["anyOf"])["required"][0]
            steps[-1]["when"] = {kind: rng.choice(s["when"]["anyOf"][0]["properties"]["disagree"]["enum"])}
    return {"steps": steps}


def test_every_document_the_schema_admits_is_a_valid_plan():
    rng = random.Random(7)
    seen_when = 0
    for _ in range(2000):
        doc = _random_doc(rng, SCHEMA)
        VALIDATOR.validate(doc)
        text = json.dumps(doc, separators=(",", ":"))
        assert len(text) <= max_plan_chars(POOL, 4, 40)
        plan = parse_plan(text, POOL, max_steps=4)  # raises PlanError if the schema let a bad plan through
        seen_when += any(s.when for s in plan.steps)
    assert seen_when > 100  # conditions were drawn too


def test_max_plan_chars_is_the_exact_bound():
    longest = max(POOL.ids, key=len)
    doc = {"steps": [step(longest, "x" * 40, ["all"] * i) for i in range(4)]}
    for i in (2, 3):  # the longest condition: no_majority over as many steps as it may list
        doc["steps"][i]["when"] = {"no_majority": list(range(i))[-MAX_CONDITION_STEPS:]}
    VALIDATOR.validate(doc)
    assert len(json.dumps(doc, separators=(",", ":"))) == max_plan_chars(POOL, 4, 40)


def test_the_schema_admits_conditions_only_on_earlier_steps():
    doc = {"steps": [step("qwen-small"), step("qwen-small"), step("vote", "x", [0, 1])]}
    doc["steps"][2]["when"] = {"disagree": [0, 1]}
    assert VALIDATOR.is_valid(doc)
    parse_plan(json.dumps(doc), POOL, max_steps=4)
    for bad in ({"disagree": [0, 2]}, {"disagree": [0]}, {"disagree": [1, 1]}, {"disagree": [1, 0]},
                {"sometimes": [0, 1]}, {"disagree": [0, 1], "no_majority": [0, 1]}):
        doc["steps"][2]["when"] = bad
        assert not VALIDATOR.is_valid(doc), bad
    doc["steps"][2]["when"] = {"disagree": [0, 1]}
    doc["steps"][1]["when"] = {"disagree": [0, 0]}
    assert not VALIDATOR.is_valid(doc)  # step 1 cannot have a condition: it has one earlier step


def test_schema_follows_kinds_and_rejects_empty_choices():
    only_llm = jsonschema.Draft202012Validator(plan_schema(POOL, 2, 40, kinds=("llm",)))
    assert only_llm.is_valid({"steps": [step("qwen-small")]})
    assert not only_llm.is_valid({"steps": [step("vote")]})
    with pytest.raises(ValueError, match="no workers of kind"):
        plan_schema(POOL, kinds=("nothing",))
    with pytest.raises(ValueError, match="max_steps"):
        plan_schema(POOL, max_steps=0)


@pytest.mark.slow  # compiles the plan grammar with vLLM's xgrammar
def test_xgrammar_compiles_the_schema_and_enforces_it():
    """The engine's grammar, not just jsonschema, must agree."""
    xgr = pytest.importorskip("xgrammar", reason="xgrammar is installed with vllm")
    testing = pytest.importorskip("xgrammar.testing")
    grammar = xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))

    def accepts(doc):
        return testing._is_grammar_accept_string(grammar, json.dumps(doc, separators=(",", ":")))

    assert accepts({"steps": [step(), step(), step("vote", access=[0, "all"])]})
    assert accepts({"steps": [step(), step(), step(), step("vote", access=[2, 0, 1])]})
    assert not accepts({"steps": [step(), step(access=[1])]})
    assert not accepts({"steps": [step("gpt-9")]})
    assert not accepts({"steps": [step(instruction=" leading space")]})
    assert not accepts({"steps": [step()] * 5})
    cascade = {"steps": [step(), step(), dict(step("llama-large"), when={"disagree": [0, 1]})]}
    assert accepts(cascade)
    assert not accepts({"steps": [step(), dict(step(), when={"disagree": [0, 1]})]})  # reads itself
    assert not accepts({"steps": [step(), step(), dict(step(), when={"disagree": [0, 2]})]})


def test_plan_error_is_the_only_failure_of_garbage_three_lists():
    """Free-mode text is arbitrary; the parser must answer PlanError, never crash."""
    for text in ["model_id = [{[]}] subtasks = ['x'] access_list = [[]]",
                 "model_id = " + "[" * 5000 + "]" * 5000 + " subtasks = ['x'] access_list = [[]]",
                 "model_id = [0 subtasks = ['x']", "\x00\x19 model_id=[] subtasks=[] access_list=[]"]:
        with pytest.raises(PlanError):
            parse_plan(text, POOL)


def test_the_simulated_planner_keeps_to_the_schema_without_the_worker_list():
    """audit46: without the prompt's worker list the sim ignored minItems, and 1,243 of 6,000 plans had a
    vote that sees no step, which the schema forbids."""
    from conductor.sim.planner import plan_reply

    schema = plan_schema(POOL, max_steps=4, instruction_chars=40)
    messages = [{"role": "user", "content": "Question: what is 2 + 2?"}]
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    rng = random.Random(3)
    for _ in range(400):
        text = plan_reply(messages, [m["content"] for m in messages], body, rng)
        VALIDATOR.validate(json.loads(text))
        parse_plan(text, POOL, max_steps=4)


FUNCTIONS_FIRST = parse_pool({"workers": [
    {"id": "vote", "kind": "function", "function": "vote"},
    {"id": "extract", "kind": "function", "function": "extract"},
    {"id": "qwen-small", "model": "openai/qwen-small"},
    {"id": "llama-large", "model": "openai/llama-large"},
    {"id": "mistral-mid", "model": "openai/mistral-mid"},
    {"id": "sub-planner", "kind": "planner", "model": "openai/planner"},
]})


@pytest.mark.parametrize("max_steps", [1, 2, 3, 5])
def test_every_plan_of_the_simulated_planner_is_valid(max_steps):
    """audit46 F6: given no worker kinds, the sim took vote and extract for models, and handed them the
    question to solve; free plans also ignored the prompt's step limit (3 steps where 2 were allowed).
    Over many seeds, on a pool that lists its function workers first: every plan passes validate_plan
    (and the schema, where one is sent), and a function worker only ever combines earlier steps."""
    from conductor.sim.planner import plan_reply

    schema = plan_schema(FUNCTIONS_FIRST, max_steps=max_steps, instruction_chars=200)
    validator = jsonschema.Draft202012Validator(schema)
    structured = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    listed = {mode: P.messages(Q1, FUNCTIONS_FIRST, mode, max_steps, instruction_chars=200)
              for mode in ("free", "structured")}
    unlisted = [{"role": "user", "content": P.user_prompt(Q1)}]  # no worker list: no kinds
    # (A free reply to a prompt without the list can only name workers by number, blind to their kinds.)
    asks = [(listed["free"], {}), (listed["structured"], structured), (unlisted, structured)]
    for seed in range(150):
        for messages, body in asks:
            rng = random.Random(seed)
            text = plan_reply(messages, [m["content"] for m in messages], body, rng, replan_rate=0.3,
                              cascade_rate=0.3)
            plan = parse_plan(text, FUNCTIONS_FIRST, max_steps=max_steps)  # validate_plan
            if body:
                validator.validate(json.loads(text))
            for step in plan.steps:
                if FUNCTIONS_FIRST.worker(step.worker).kind == "function":
                    assert step.access and Q1.prompt not in step.instruction, (seed, text)
