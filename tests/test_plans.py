"""Plan parsing: both formats, every validation error, and access resolution."""

import pytest

from conductor.errors import PlanError
from conductor.plans import Plan, parse_plan
from conductor.pool import parse_pool

POOL = parse_pool({
    "workers": [
        {"id": "small", "model": "openai/small"},
        {"id": "big", "model": "openai/big"},
        {"id": "vote", "kind": "function"},
    ]
})


def test_json_plan_parses_with_ids_numbers_and_all():
    text = """{"steps": [
        {"worker": "small", "instruction": "solve it", "access": []},
        {"worker": 1, "instruction": "solve it too", "access": []},
        {"worker": "vote", "instruction": "vote", "access": "all"}]}"""
    plan = parse_plan(text, POOL)
    assert plan.workers == ["small", "big", "vote"]
    assert plan.steps[2].access == (0, 1)
    assert plan.steps[0].access == ()


def test_json_plan_inside_prose_and_fences():
    text = 'Here is my plan:\n```json\n{"steps": [{"worker": "big", "instruction": "go", "access": []}]}\n```\nDone.'
    assert parse_plan(text, POOL).workers == ["big"]


def test_json_tolerates_raw_control_characters_in_strings():
    text = '{"steps": [{"worker": "big", "instruction": "line one\nline\ttwo", "access": []}]}'
    assert parse_plan(text, POOL).steps[0].instruction == "line one\nline\ttwo"


def test_three_list_format_after_reasoning():
    text = """I think the small model should try first and the big one should check.
model_id = [0, "big"]
subtasks = ["Solve: 2+2", "Check the answer above"]
access_list = [[], ["all"]]"""
    plan = parse_plan(text, POOL)
    assert plan.workers == ["small", "big"]
    assert plan.steps[1].access == (0,)
    assert plan.steps[1].instruction == "Check the answer above"


def test_three_list_uses_the_last_assignment_and_python_literals():
    text = """Draft: model_id = [2]
final:
model_id = ['small', 'big', 'big']
subtasks = ['a', 'b', 'c']
access_list = [[], [0], [0, 1]]"""
    plan = parse_plan(text, POOL)
    assert plan.workers == ["small", "big", "big"]
    assert plan.steps[2].access == (0, 1)


def test_round_trip_json():
    plan = parse_plan('{"steps": [{"worker": "small", "instruction": "x", "access": []},'
                      '{"worker": "big", "instruction": "y", "access": [0]}]}', POOL)
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("text, message", [
    ("", "empty planner output"),
    ("no plan here at all", "no plan found"),
    ('{"steps": []}', "plan has no steps"),
    ('{"steps": {"worker": "big"}}', "'steps' must be a list"),
    ('{"steps": [{"worker": "gpt-9", "instruction": "x", "access": []}]}', "worker 'gpt-9' is not in the pool"),
    ('{"steps": [{"worker": 7, "instruction": "x", "access": []}]}', "worker number 7 is out of range"),
    ('{"steps": [{"instruction": "x", "access": []}]}', "worker is missing"),
    ('{"steps": [{"worker": "big", "instruction": "  ", "access": []}]}', "instruction must be a non-empty string"),
    ('{"steps": [{"worker": "big", "instruction": "x", "access": [0]}]}', "not earlier (the first step can see no other step)"),
    ('{"steps": [{"worker": "big", "instruction": "x", "access": []},'
     '{"worker": "big", "instruction": "y", "access": [2]}]}', "step 1: access entry 2 refers to a step that is not earlier"),
    ('{"steps": [{"worker": "big", "instruction": "x", "access": [-1]}]}', "negative"),
    ('{"steps": [{"worker": "big", "instruction": "x", "access": "some"}]}', "access must be a list"),
    ('{"steps": [{"worker": "big", "instruction": "x", "access": [true]}]}', "is not a step number"),
    ('{"steps": [' + ",".join(['{"worker": "big", "instruction": "x", "access": []}'] * 6) + "]}",
     "plan has 6 steps; at most 5 are allowed"),
    ("model_id = [0, 1]\nsubtasks = ['a']\naccess_list = [[], []]", "list lengths differ"),
    ("model_id = [0]\nsubtasks = ['a']", "missing access_list"),
    ("model_id = [0\nsubtasks = ['a']\naccess_list = [[]]", "model_id: the list is not closed"),
    ("model_id = [0]\nsubtasks = [a b c]\naccess_list = [[]]", "subtasks: not a valid list literal"),
])
def test_every_validation_error_is_named(text, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_plan(text, POOL)


def test_max_steps_is_configurable():
    text = '{"steps": [' + ",".join(['{"worker": "big", "instruction": "x", "access": []}'] * 3) + "]}"
    assert len(parse_plan(text, POOL, max_steps=3).steps) == 3
    with pytest.raises(PlanError, match="at most 2"):
        parse_plan(text, POOL, max_steps=2)
