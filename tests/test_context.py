"""What a step's worker sees, built from its access list."""

from conductor.context import step_messages
from conductor.plans import Step

STEPS = [
    Step("a", "solve 2+2", ()),
    Step("b", "solve 3+3", ()),
    Step("c", "compare the answers", (0, 1)),
    Step("d", "check step 1 only", (1,)),
]
OUT = {0: "4", 1: "6"}


def test_access_grants_prior_turns_in_step_order():
    msgs = step_messages(STEPS[2], STEPS, OUT)
    assert msgs == [
        {"role": "user", "content": "solve 2+2"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "solve 3+3"}, {"role": "assistant", "content": "6"},
        {"role": "user", "content": "compare the answers"},
    ]


def test_a_step_sees_only_what_it_is_granted():
    msgs = step_messages(STEPS[3], STEPS, OUT)
    assert [m["content"] for m in msgs] == ["solve 3+3", "6", "check step 1 only"]


def test_empty_access_and_system_prompt():
    msgs = step_messages(STEPS[0], STEPS, {}, system="be brief")
    assert msgs == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "solve 2+2"}]
