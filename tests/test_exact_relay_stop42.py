"""An `exact` answer of several lines is graded alike straight from its worker and after `vote` or
`extract` (carried since stop 37). The exact grader reads a bare reply with no "Answer:" marker both
by its last line and whole; the function workers wrote "Answer: <last line>", so a reply that is the
answer, line breaks and all ("Paris\\nLondon" for "Paris London"), was right from one worker and
wrong once three workers voted for it, or one step extracted it."""

from __future__ import annotations

import pytest

from conductor.functions import extract, run_function, vote
from conductor.grading import extract_answer, grade
from conductor.plans import Step

TWO_LINES = "Paris\nLondon"

# (the worker's reply, a reference): the verdict straight from the worker is the one to keep
CASES = [
    (TWO_LINES, "Paris London"),  # the whole reply is the answer
    (TWO_LINES, "Paris\nLondon"),
    (TWO_LINES, "London"),  # its last line is
    (TWO_LINES, "Paris"),  # neither: wrong, relayed or not
    ("Let me think.\nThe city is\nRome", "Rome"),
    ("Let me think.\nThe city is\nRome", "Paris"),
    ("The Great\nGatsby.", "The Great Gatsby"),
    ("Answer: The Great Gatsby.", "great gatsby"),  # the forms relayed as before
    ("Answer: Paris", "London"),
    ('{"answer": "Paris\\nLondon"}', "Paris London"),
    ("Answer:\n```\nParis\nLondon\n```", "Paris London"),
    ("So the answer is Rome.\nThanks!", "Rome"),
    ("Rome", "Rome"),
]


def relayed(reply: str) -> list[str]:
    other = "Answer: Berlin"
    return [extract([reply], "exact"), vote([reply], "exact"), vote([reply, reply, reply], "exact"),
            vote([reply, other, reply], "exact"), vote([other, reply, reply], "exact")]


@pytest.mark.parametrize("reply, reference", CASES)
def test_vote_and_extract_keep_the_workers_verdict(reply, reference):
    own = grade("exact", reply, reference).correct
    for out in relayed(reply):
        assert grade("exact", out, reference).correct is own, out
        assert extract_answer(out, "exact") == extract_answer(reply, "exact"), out


def test_three_workers_voting_for_an_answer_of_two_lines_are_right_as_one_is():
    assert grade("exact", TWO_LINES, "Paris London").correct is True
    out = run_function("vote", Step(worker="vote", instruction="", access=(0, 1, 2)), [TWO_LINES] * 3, "exact")
    assert grade("exact", out, "Paris London").correct is True, out
    out = run_function("extract", Step(worker="extract", instruction="", access=(0,)), [TWO_LINES], "exact")
    assert grade("exact", out, "Paris London").correct is True, out


def test_the_majority_still_wins_and_a_minority_answer_is_not_relayed():
    """Replies of several lines are voted by their final answer, as before; the one relayed
    is the majority's, never the earlier minority's."""
    out = vote(["Answer: Berlin", TWO_LINES, "Some thought\nLondon"], "exact")
    assert grade("exact", out, "London").correct is True
    assert grade("exact", out, "Paris London").correct is True  # the majority's first reply, as it was
    assert grade("exact", out, "Berlin").correct is False
    out = vote([TWO_LINES, "Answer: Berlin", "Answer: Berlin"], "exact")
    assert grade("exact", out, "Berlin").correct is True and grade("exact", out, "Paris London").correct is False


@pytest.mark.parametrize("task, reply", [("math", "Thinking\n12"), ("choice", "Thinking\nC"),
                                         ("literal", "Thinking\n[1, 2]")])
def test_other_tasks_relay_the_answer_line_as_before(task, reply):
    """Only `exact` reads a reply whole: the other tasks' votes still end on the answer with a tally."""
    out = vote([reply, reply], task)
    assert out.startswith("Votes over 2 output(s): ") and extract_answer(out, task) == extract_answer(reply, task)
    assert extract([reply], task).startswith("Answer: ")
