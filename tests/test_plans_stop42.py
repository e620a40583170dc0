"""The three-list plan format as a user writes it (audit77 F2, F5, F6):

- a fourth list under a name the format does not read (`when`, `if`, `condition`: the JSON
  step's keys) is refused, naming it and `conditions`, instead of being ignored so that the
  escalation runs on every query;
- a list may mix Python's None and JSON's null, as the README's "also null" invites;
- the last plan in a reply is read whatever its format: a three-list plan after a JSON draft."""

from __future__ import annotations

import pytest

from conductor.errors import PlanError
from conductor.plans import parse_plan
from tests.test_plans import POOL

LISTS = ('model_id = ["small", "small", "big"]\n'
         'subtasks = ["Solve: 2+2", "Solve: 2+2", "Solve: 2+2"]\n'
         'access_list = [[], [], []]\n')
JSON = '{"steps": [{"worker": "small", "instruction": "Solve: 2+2", "access": []}]}'


@pytest.mark.parametrize("name", ["when", "if", "condition"])
def test_a_fourth_list_under_another_name_is_refused_naming_conditions(name):
    with pytest.raises(PlanError, match=rf"a list named '{name}' is not read; the optional fourth list, "
                                        r"of conditions, is named conditions"):
        parse_plan(LISTS + f'{name} = [None, None, "disagree(0, 1)"]', POOL)
    one_line = LISTS.replace("\n", "  ") + f'{name} = [None, None, "disagree(0, 1)"]'
    with pytest.raises(PlanError, match=f"a list named '{name}' is not read"):
        parse_plan(one_line, POOL)


def test_lists_that_are_not_a_fourth_list_are_still_read():
    # refused: one entry per step, under its own line
    with pytest.raises(PlanError, match="a list named 'Conditions' is not read"):
        parse_plan(LISTS + 'Conditions = [None, None, "disagree(0, 1)"]', POOL)
    # read: a list in a sentence, one of another length, and code inside an instruction
    for text in ("The question defines a = [1, 2, 3].\n" + LISTS,
                 "nums = [3, 1]\n" + LISTS,
                 LISTS.replace('"Solve: 2+2"]', '"Solve:\nwhen = [1, 2, 3]"]')):
        assert parse_plan(text, POOL).workers == ["small", "small", "big"]
    plan = parse_plan(LISTS + 'conditions = [None, None, "disagree(0, 1)"]', POOL)
    assert str(plan.steps[2].when) == "disagree(0, 1)"


def test_a_list_may_mix_none_and_null():
    plan = parse_plan(LISTS + 'conditions = [None, null, "disagree(0, 1)"]', POOL)
    assert [str(s.when) if s.when else None for s in plan.steps] == [None, None, "disagree(0, 1)"]
    plan = parse_plan(LISTS + "conditions = [None, None, null]", POOL)
    assert [s.when for s in plan.steps] == [None, None, None]
    # null inside a string stays text
    plan = parse_plan(LISTS.replace('"Solve: 2+2", "Solve: 2+2"]', "'say null', \"true\"]")
                      + "conditions = [None, null, None]", POOL)
    assert [s.instruction for s in plan.steps][1:] == ["say null", "true"]


def test_a_three_list_plan_after_a_json_plan_is_the_one_read():
    assert parse_plan(f"Draft:\n{JSON}\nFinal:\n{LISTS}", POOL).workers == ["small", "small", "big"]
    fenced = f"```json\n{JSON}\n```\nFinal:\n```python\n{LISTS}conditions = [None, None, null]\n```"
    assert parse_plan(fenced, POOL).workers == ["small", "small", "big"]
    # the JSON plan stays the plan when it comes last, or when what follows is not a whole three-list plan
    assert parse_plan(f"{LISTS}\n{JSON}", POOL).workers == ["small"]
    assert parse_plan(f"{JSON}\nmodels: [1, 2]", POOL).workers == ["small"]
    # the plan read last is the plan's error too
    with pytest.raises(PlanError, match="list lengths differ"):
        parse_plan(f"{JSON}\n{LISTS.replace('[[], [], []]', '[[], []]')}", POOL)
