"""The three-list plan format as a user writes it (audit77 F2, F5, F6):

- a fourth list named `when` or `condition` (the JSON step's key) is read as the conditions,
  instead of being ignored so that the escalation runs on every query; other lines that hold a
  list of one entry per step (the question's code, a draft) are prose, as before;
- a conditions list may mix Python's None and JSON's null, as the README's "also null" invites;
- the last plan in a reply is read whatever its format: a three-list plan after a JSON draft
  (all three lists; fewer leave the JSON plan read), which is the reply's error when broken."""

from __future__ import annotations

import pytest

from conductor.errors import PlanError
from conductor.plans import parse_plan
from tests.test_plans import POOL

LISTS = ('model_id = ["small", "small", "big"]\n'
         'subtasks = ["Solve: 2+2", "Solve: 2+2", "Solve: 2+2"]\n'
         'access_list = [[], [], []]\n')
JSON = '{"steps": [{"worker": "small", "instruction": "Solve: 2+2", "access": []}]}'


@pytest.mark.parametrize("name", ["when", "condition"])
def test_a_fourth_list_named_as_the_json_key_is_read_as_the_conditions(name):
    for text in (LISTS + f'{name} = [None, None, "disagree(0, 1)"]',
                 LISTS.replace("\n", "  ") + f'{name} = [None, None, "disagree(0, 1)"]'):
        plan = parse_plan(text, POOL)
        assert [str(s.when) if s.when else None for s in plan.steps] == [None, None, "disagree(0, 1)"]


def test_lists_that_are_no_part_of_the_plan_leave_it_as_it_is():
    """The review of the first version: a line `xs = [3, 1, 2]` (the question's code) or a draft
    `workers = [0, 1, 2]` of one entry per step refused a good plan."""
    for text in ("The question defines a = [1, 2, 3].\n" + LISTS,
                 "xs = [3, 1, 2]\n" + LISTS,
                 "workers = [0, 1, 2]\n" + LISTS,
                 "Expected: ['4', '4', '4']\n" + LISTS,
                 LISTS.replace('"Solve: 2+2"]', '"Solve:\nwhen = [1, 2, 3]"]')):
        assert parse_plan(text, POOL).workers == ["small", "small", "big"], text
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
    # all three lists after the JSON plan are the reply's last plan: broken, they are the reply's error
    # (review42c 5: the JSON draft ran in their place, with no word of it)
    with pytest.raises(PlanError, match=r"^the three-list plan after the JSON plan \(.*\): list lengths differ"):
        parse_plan(f"{JSON}\n{LISTS.replace('[[], [], []]', '[[], []]')}", POOL)
    with pytest.raises(PlanError, match=r"^the three-list plan after the JSON plan \(.*\): models: not a valid list"):
        parse_plan(f"{JSON}\n- models: [small]\n- instructions: [solve]\n- access: [[]]", POOL)


def test_an_untrusted_reply_full_of_lists_is_refused_or_read():
    """Nested lists of null, a long list of null, unclosed lists after a JSON plan (the review's
    100k-character replies, which took 14.6 s to read, a figure for bench, not for a test)."""
    for text in (LISTS + "conditions = " + "[" * 20 + ", ".join(["null"] * 12_000) + "]" * 20,
                 LISTS + "conditions = [" + ", ".join(["null"] * 20_000) + "]"):
        with pytest.raises(PlanError, match="conditions"):
            parse_plan(text, POOL)
    assert parse_plan(JSON + "\n" + "models: [ access: [ " * 5_000, POOL).workers == ["small"]


def test_a_when_or_condition_that_is_no_conditions_list_is_prose():
    """review42c 2: quoted code (`condition = [x > 0 for x in xs]`) or prose (`condition: [see below`)
    of that name refused a good plan."""
    for extra in ("condition = [x > 0 for x in xs]", "condition: [see below", "when = [1, 2]"):
        assert parse_plan(f"{extra}\n{LISTS}", POOL).workers == ["small", "small", "big"], extra
