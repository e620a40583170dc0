"""review42c 5 and 7:

- a reply whose final plan is three lists after a JSON draft is that plan: when the lists are
  broken (lengths differ, a list cut off, ids not quoted) the reply is invalid with their error,
  as a broken final JSON plan is, instead of running the draft with no word that the model's
  final plan was dropped;
- a conditions list that mixes None and null is read at any length (it was refused past 4,000
  characters), and under `when` too (past 4,000 characters it was ignored, so the escalation ran
  on every query)."""

from __future__ import annotations

import re

import orjson
import pytest

from conductor.errors import PlanError
from conductor.plans import parse_plan
from tests.plannersim import psim, queries, sim  # noqa: F401  (shared fixtures)
from tests.test_planner_replies import completion, planner, run  # noqa: F401  (planner: a fixture)
from tests.test_plans import POOL

LISTS = ('model_id = ["small", "small", "big"]\n'
         'subtasks = ["Solve: 2+2", "Solve: 2+2", "Solve: 2+2"]\n'
         'access_list = [[], [], []]\n')
JSON = '{"steps": [{"worker": "small", "instruction": "Solve: 2+2", "access": []}]}'
# What the error of such a reply begins with (written out: the old code has no name to import)
AFTER_JSON = "the three-list plan after the JSON plan (the reply's last plan, the one read)"


@pytest.mark.parametrize("final, error", [
    (LISTS.replace("[[], [], []]", "[[], []]"),
     "list lengths differ: model_id has 3, subtasks 3, access_list 2"),
    (LISTS.replace("[[], [], []]", "[[], [],"), "access_list: the list is not closed"),  # cut off
    (LISTS.replace('["small", "small", "big"]', "[small, small, big]"), "model_id: not a valid list literal"),
    (LISTS + 'conditions = [None, "disagree(0, 1)"]', "list lengths differ: model_id has 3, conditions 2"),
    (LISTS.replace('"big"]', '"huge"]'), "step 2: worker 'huge' is not in the pool (known: small, big, vote)"),
])
def test_a_broken_three_list_plan_after_a_json_draft_is_the_replys_error(final, error):
    for text in (f"Draft:\n{JSON}\nFinal plan:\n{final}", f"```json\n{JSON}\n```\n```python\n{final}\n```"):
        with pytest.raises(PlanError) as got:
            parse_plan(text, POOL)
        assert str(got.value) == f"{AFTER_JSON}: {error}", text


def test_the_json_plan_stays_the_plan_when_no_whole_three_list_plan_follows_it():
    """Only all three lists after the JSON plan are a plan: one or two lists (prose, a recap in
    part) leave the JSON plan read, and a good three-list plan after it is read as before."""
    assert parse_plan(f"{JSON}\nmodels: [1, 2]", POOL).workers == ["small"]
    assert parse_plan(f"{JSON}\nmodel_id = [0, 0, 1]\nsubtasks = [", POOL).workers == ["small"]
    assert parse_plan(f"{JSON}\n{LISTS}", POOL).workers == ["small", "small", "big"]
    with pytest.raises(PlanError, match=f"^{re.escape(AFTER_JSON)}: list lengths differ"):
        parse_plan(f"{JSON}\n{LISTS.replace('[[], [], []]', '[[], []]')}", POOL)


def _lists(n: int, conditions: list[str], name: str = "conditions") -> str:
    return (f"model_id = {[0] * n}\nsubtasks = {['Solve: 2+2'] * n}\naccess_list = {[[]] * n}\n"
            f"{name} = [{', '.join(conditions)}]")


@pytest.mark.parametrize("name", ["conditions", "when", "condition"])
def test_a_long_conditions_list_may_mix_none_and_null(name):
    n = 800  # a long plan (--max-steps takes up to 1,000): its conditions list is past 4,000 characters
    conditions = ["None" if i % 2 else "null" for i in range(n - 1)] + ['"disagree(0, 1)"']
    text = _lists(n, conditions, name)
    assert len(text.split(f"{name} = ")[1]) > 4_000
    plan = parse_plan(text, POOL, max_steps=1_000)
    assert [(i, str(s.when)) for i, s in enumerate(plan.steps) if s.when] == [(n - 1, "disagree(0, 1)")]
    # strings, triple-quoted ones and comments that hold null are read as Python reads them
    odd = ["null  # no condition, not true\n"] + ["'null'", "null"] * (n // 2 - 1) + ['"""disagree(0, 1)"""']
    plan = parse_plan(_lists(n, odd, name), POOL, max_steps=1_000)
    assert [(i, str(s.when)) for i, s in enumerate(plan.steps) if s.when] == [(n - 1, "disagree(0, 1)")]


def test_a_long_list_of_the_wrong_length_is_named_not_called_unreadable():
    text = _lists(3, ["None" if i % 2 else "null" for i in range(2_000)])
    with pytest.raises(PlanError, match="^list lengths differ: model_id has 3, conditions 2000$"):
        parse_plan(text, POOL)


@pytest.mark.slow
def test_a_run_records_the_broken_final_plan_as_its_error(sim, tmp_path, queries, planner):
    """Through the LLM planner: the plan is invalid with the final plan's error, and no step of
    the draft runs."""
    q = planner.questions
    draft = orjson.dumps({"steps": [{"worker": "fast", "instruction": q[0], "access": []}]}).decode()
    lists = f"model_id = ['fast', 'weak']\nsubtasks = [{q[0]!r}, {q[0]!r}]\naccess_list = [[]]"
    planner.replies = {0: (200, completion(f"A draft:\n{draft}\nThe final plan:\n{lists}"))}
    summary, plans = run(tmp_path, sim, planner, queries)
    by_query = {p["query_index"]: p for p in plans}
    assert not by_query[0]["valid"] and by_query[0]["steps_json"] is None
    assert by_query[0]["error"] == f"{AFTER_JSON}: list lengths differ: model_id has 2, subtasks 2, access_list 1"
    assert all(p["valid"] for i, p in by_query.items() if i != 0)
