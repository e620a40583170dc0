"""Plan parsing: both formats, every validation error, and access resolution."""

import re

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
    ('{"steps": [{"worker": 1.0, "instruction": "x", "access": []}]}',
     "step 0: worker must be an id or a whole number, not 1.0"),
    ('{"steps": [{"worker": "big", "instruction": "x", "access": [], "when": {"disagree": [0, 1]}}]}',
     "step 0: the first step cannot have a condition"),
    # Valid JSON, but a lone surrogate is no text: the plan could be neither stored nor sent.
    ('{"steps": [{"worker": "big", "instruction": "x \\ud800", "access": []}]}',
     r"step 0: instruction holds a lone surrogate \\ud800, which is not valid Unicode"),
    ("model_id = [0]\nsubtasks = ['x \\udfff']\naccess_list = [[]]",
     r"step 0: instruction holds a lone surrogate \\udfff"),
])
def test_every_validation_error_is_named(text, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_plan(text, POOL)


def test_an_instruction_over_the_limit_is_refused_with_its_length():
    from conductor.plans import MAX_INSTRUCTION_CHARS

    step = '{"worker": "big", "instruction": "%s", "access": []}'
    assert MAX_INSTRUCTION_CHARS == 100_000
    assert parse_plan('{"steps": [%s]}' % (step % ("x" * 100_000)), POOL).steps[0].instruction == "x" * 100_000
    with pytest.raises(PlanError, match=r"^step 1: instruction is 3,000,000 characters long; at most 100,000 are "
                                        r"allowed$"):
        parse_plan('{"steps": [%s, %s]}' % (step % "x", step % ("y" * 3_000_000)), POOL)
    with pytest.raises(PlanError, match="step 0: instruction is 100,001 characters long"):
        parse_plan(f"model_id = [0]\nsubtasks = ['{'z' * 100_001}']\naccess_list = [[]]", POOL)


def test_the_last_of_several_json_plans_is_the_plan():
    draft = '{"steps": [{"worker": "gpt-9", "instruction": "x", "access": []}]}'
    final = '{"steps": [{"worker": "big", "instruction": "y", "access": []}]}'
    assert parse_plan(f"Draft:\n{draft}\nFixed:\n{final}", POOL).workers == ["big"]
    with pytest.raises(PlanError, match="worker 'gpt-9' is not in the pool"):  # the last one, as written
        parse_plan(f"{final}\n{draft}", POOL)


def test_max_steps_is_configurable():
    text = '{"steps": [' + ",".join(['{"worker": "big", "instruction": "x", "access": []}'] * 3) + "]}"
    assert len(parse_plan(text, POOL, max_steps=3).steps) == 3
    with pytest.raises(PlanError, match="at most 2"):
        parse_plan(text, POOL, max_steps=2)


def test_a_plan_cut_off_at_max_tokens_says_so(tmp_path, sample_queries):
    """A vLLM plan truncated by max_tokens was recorded as "no plan found", with the cause
    only in info_json (audit 32)."""
    import pyarrow.parquet as pq

    from conductor.planners.base import PlanDraft
    from conductor.runner import RunConfig, run_all
    from tests.conftest import write_pool

    class CutOff:
        name = "cutoff"

        def plan(self, queries, pool, samples):
            return [[PlanDraft(text='{"steps": [{"worker": "fa', info={"truncated": True, "max_tokens": 20})]
                    * samples for _ in queries]

    queries = tmp_path / "q.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 2), queries)
    pool = write_pool(tmp_path / "pool.yaml", "http://127.0.0.1:9/v1")
    summary = run_all(RunConfig(queries=queries, pool=pool, data_dir=tmp_path / "data", progress=False),
                      planner=CutOff())
    plans = pq.read_table(tmp_path / "data" / "runs" / summary["run_id"] / "plans.parquet").to_pylist()
    assert all("cut off at max_tokens=20" in p["error"] for p in plans), plans[0]["error"]


# audit59 F1: '²'.isdigit() is true and int('²') raises: the ValueError crashed planning, and every
# rerun with it (the reply is cached); '١' was taken for worker 1
@pytest.mark.parametrize("text, error", [
    ('model_id = ["²"]\nsubtasks = ["x"]\naccess_list = [[]]', "step 0: worker '²' is not in the pool"),
    ('model_id = ["١"]\nsubtasks = ["x"]\naccess_list = [[]]', "step 0: worker '١' is not in the pool"),
    ('model_id = ["small", "big"]\nsubtasks = ["x", "y"]\naccess_list = [[], ["①"]]',
     "step 1: access entry '①' is not a step number"),
    ('{"steps": [{"worker": "small", "instruction": "a"}, {"worker": "big", "instruction": "b"},'
     ' {"worker": "big", "instruction": "c", "when": {"disagree": ["0", "¹"]}}]}',
     "step 2: condition disagree: '¹' is not a step number"),
    ('{"steps": [{"worker": "small", "instruction": "a"}, {"worker": "big", "instruction": "b"},'
     ' {"worker": "big", "instruction": "c", "when": "disagree(0, ²)"}]}',
     "step 2: condition 'disagree(0, ²)': the steps must be step numbers"),
])
def test_a_digit_that_is_not_ascii_is_a_plan_error_not_a_crash(text, error):
    with pytest.raises(PlanError, match=re.escape(error)):
        parse_plan(text, POOL)


def test_of_two_fenced_plans_the_last_is_read():
    """audit59 F2: the README says the last plan of a reply is read; fenced blocks gave the first."""
    draft = '{"steps": [{"worker": "small", "instruction": "draft", "access": []}]}'
    final = '{"steps": [{"worker": "big", "instruction": "final", "access": []}]}'
    text = f"A draft:\n```json\n{draft}\n```\nOn reflection:\n```json\n{final}\n```\n"
    assert parse_plan(text, POOL).steps[0].instruction == "final"


def test_a_null_when_does_not_hide_an_if():
    """audit59 F6: `"when": null` beside `"if"` ran the step unconditionally."""
    steps = ('{"steps": [{"worker": "small", "instruction": "a"}, {"worker": "big", "instruction": "b"},'
             ' {"worker": "big", "instruction": "c", %s}]}')
    plan = parse_plan(steps % '"when": null, "if": "disagree(0, 1)"', POOL)
    assert plan.steps[2].when is not None and plan.steps[2].when.steps == (0, 1)
    with pytest.raises(PlanError, match="step 2: gives when and if with different conditions; give one"):
        parse_plan(steps % '"when": "disagree(0, 1)", "if": {"no_majority": [0, 1]}', POOL)


def test_any_error_reading_a_reply_is_that_plans_error(monkeypatch):
    """A reply that trips the reader some other way is still one invalid plan, not a crash of the batch."""
    import conductor.plans as plans

    def trips(text):
        raise ValueError("a reader bug")

    monkeypatch.setattr(plans, "_parse_json", trips)
    with pytest.raises(PlanError, match=r"the plan could not be read \(ValueError: a reader bug\)"):
        parse_plan('{"steps": []}', POOL)
