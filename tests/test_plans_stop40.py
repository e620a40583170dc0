"""audit68 F2, F5, F6: the last plan of a reply is read, fenced or not; one condition written
twice in two spellings is one condition; a worker or step written as thousands of digits is
that step's plan error in the plan's own words, not Python's advice."""

from __future__ import annotations

import orjson
import pytest

from conductor.errors import PlanError
from conductor.plans import parse_plan
from conductor.pool import parse_pool
from tests.plannersim import psim, queries, sim  # noqa: F401  (shared fixtures)
from tests.test_planner_replies import completion, planner, run  # noqa: F401  (planner: a fixture)

POOL = parse_pool({"workers": [{"id": "small", "model": "openai/small"}, {"id": "big", "model": "openai/big"}]})
BIG = "9" * 5000


def one_step(worker: str, instruction: str) -> str:
    return orjson.dumps({"steps": [{"worker": worker, "instruction": instruction, "access": []}]}).decode()


DRAFT, FINAL = one_step("small", "draft"), one_step("big", "final")


@pytest.mark.parametrize("text", [
    f"```json\n{DRAFT}\n```\nActually: {FINAL}",  # the audit's reply
    f"```\n{DRAFT}\n```\nOn second thought, the final plan:\n{FINAL}\nThat is all.",
    f"{DRAFT}\n```json\n{DRAFT}\n```\nfinal: {FINAL}",
    f"```json\n[{orjson.dumps({'worker': 'small', 'instruction': 'draft'}).decode()}]\n```\n{FINAL}",
])
def test_the_last_plan_of_a_reply_is_read_fenced_or_not(text):
    plan = parse_plan(text, POOL)
    assert [(s.worker, s.instruction) for s in plan.steps] == [("big", "final")]


def cascade(condition_keys: str) -> str:
    return ('{"steps": [{"worker": "small", "instruction": "a"}, {"worker": "big", "instruction": "b"},'
            ' {"worker": "big", "instruction": "c", %s}]}' % condition_keys)


@pytest.mark.parametrize("keys", [
    '"when": "disagree(0,1)", "if": {"disagree": [0, 1]}',  # the audit's plan
    '"when": "disagree(0,1)", "if": "disagree(0, 1)"',
    '"if": "disagree(1, 0)", "condition": {"kind": "disagree", "steps": ["0", 1]}',
    '"when": {"no_majority": [0, 1]}, "if": "no majority(0, 1)", "condition": {"kind": "no-majority", "steps": [1, 0]}',
    '"when": "none", "if": "disagree(0, 1)"',  # "none" is no condition, as a null is (review40 5)
    '"when": "", "if": {"disagree": [0, 1]}',
])
def test_one_condition_in_two_spellings_is_one_condition(keys):
    when = parse_plan(cascade(keys), POOL).steps[2].when
    assert when is not None and when.steps == (0, 1)


def refusal(text: str) -> str:
    with pytest.raises(PlanError) as e:
        parse_plan(text, POOL)
    return str(e.value)


@pytest.mark.parametrize("text, start", [
    (one_step(BIG, "a"), "step 0: worker '9999"),
    ('{"steps": [{"worker": %s, "instruction": "a"}]}' % BIG, "step 0: worker '9999"),
    ('model_id = ["%s"]\nsubtasks = ["a"]\naccess_list = [[]]' % BIG, "step 0: worker '9999"),
    ('{"steps": [{"worker": "small", "instruction": "a"}, {"worker": "big", "instruction": "b", "access": ["%s"]}]}'
     % BIG, "step 1: access entry '9999"),
    ('{"steps": [{"worker": "small", "instruction": "a"}, {"worker": "big", "instruction": "b", "access": [%s]}]}'
     % BIG, "step 1: access entry '9999"),
    (cascade('"when": "disagree(0, %s)"' % BIG), "step 2: condition 'disagree(0, 9999"),
    (cascade('"when": {"disagree": [0, "%s"]}' % BIG), "step 2: condition disagree: '9999"),
])
def test_thousands_of_digits_are_the_steps_error_in_plan_terms(text, start):
    message = refusal(text)
    assert message.startswith(start)
    assert "set_int_max_str_digits" not in message and "could not be read" not in message
    assert "(5,0" in message and len(message) < 200  # the length is told, the digits are not repeated


def test_the_worker_message_names_the_pool():
    message = refusal(one_step(BIG, "a"))
    assert message.endswith("(5,000 characters) is not in the pool (known: small, big)")


@pytest.mark.slow
def test_a_run_reads_the_final_plan_the_same_condition_and_names_a_huge_worker(sim, tmp_path, queries, planner):
    """The same three replies through the LLM planner: the run's plans are what the user reads."""
    q = planner.questions
    draft, final = one_step("weak", q[0]), one_step("fast", q[0])
    same_twice = orjson.dumps({"steps": [
        {"worker": "fast", "instruction": q[2], "access": []}, {"worker": "weak", "instruction": q[2], "access": []},
        {"worker": "fast", "instruction": q[2], "access": [], "when": "disagree(0,1)", "if": {"disagree": [0, 1]}},
    ]}).decode()
    planner.replies = {0: (200, completion(f"A draft:\n```json\n{draft}\n```\nThe final plan: {final}")),
                       1: (200, completion(one_step(BIG, q[1]))),
                       2: (200, completion(same_twice))}
    summary, plans = run(tmp_path, sim, planner, queries)
    by_query = {p["query_index"]: p for p in plans}
    assert by_query[0]["valid"] and orjson.loads(by_query[0]["steps_json"])["steps"][0]["worker"] == "fast"
    assert not by_query[1]["valid"]
    assert by_query[1]["error"].startswith("step 0: worker '9999")
    assert "is not in the pool" in by_query[1]["error"] and "set_int_max_str_digits" not in by_query[1]["error"]
    assert by_query[2]["valid"]
    assert orjson.loads(by_query[2]["steps_json"])["steps"][2]["when"] == {"disagree": [0, 1]}
