"""Audit 59: what `vote` and `extract` write is graded as the answer they picked (F3); a literal
in markup (F5) is read. (F4, a choice letter as "**C**.", is read since the policy benchmark's
rerun of 2026-11-29; its forms are in test_grading.py.)"""

from __future__ import annotations

import pytest

from conductor.functions import extract, vote
from conductor.grading import extract_answer, grade

CODE_OK = "Here it is:\n```python\ndef add(a, b):\n    total = a + b\n    return total\n```\nDone."
CODE_WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
CODE_BARE = "def add(a, b):\n    return a + b"
CODE_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
DICT = "{'a': [1, 2], 'b': {'c': 3}}"
DICT_LINES = "The function returns:\n```python\n{'a': [1,\n      2],\n 'b': {'c': 3}}\n```"
TRIPLE = "Output:\n```\n'''x\ny'''\n```"

CASES = [  # (task, response, reference, the response's own verdict)
    ("math", "So 6 + 6 = 12.\nAnswer: 12", "12", True),
    ("math", "Answer: 13", "12", False),
    ("math", "we get $\\boxed{\\frac{1}{2}}$", "0.5", True),
    ("math", '{"answer": "$1,234.50"}', "1234.5", True),
    ("math", "so \\boxed{x^2\n+ 1}", "x^2+1", False),  # math-verify misreads the line break: still so
    ("choice", "The answer is (C).", "C", True),
    ("choice", "Answer: **C.**", "C", True),
    ("choice", "Answer: B", "C", False),
    ("exact", "Answer: The Great Gatsby.", "great gatsby", True),
    ("exact", "Answer: Paris", "London", False),
    ("literal", "Answer: [1, 2, 3]", "[1, 2, 3]", True),
    ("literal", "Answer: (1, 2)", "[1, 2]", False),
    ("literal", DICT_LINES, DICT, True),
    ("literal", DICT_LINES, "{'a': [1, 2], 'b': {'c': 4}}", False),
    ("literal", TRIPLE, "'x\\ny'", True),
    ("literal", "Answer: **[1, 2]**", "[1, 2]", True),
    ("code", CODE_OK, CODE_TESTS, True),
    ("code", CODE_WRONG, CODE_TESTS, False),
    ("code", CODE_BARE, CODE_TESTS, True),
    ("code", "```python\ns = '~~~'\n```\n~~~python\ns = '```'\ndef add(a, b):\n    return a + b\n~~~", CODE_TESTS, True),
]


@pytest.mark.parametrize("task, response, reference, correct", CASES)
def test_extract_and_vote_keep_the_workers_verdict(task, response, reference, correct):
    """The same answer is graded alike straight from the worker and after extract or vote:
    a program, or a literal of several lines, was written on one "Answer:" line and lost."""
    assert grade(task, response, reference).correct is correct
    other = "Answer: 0" if task != "code" else "```python\nadd = None\n```"
    for out in (extract([response], task), vote([response], task), vote([response, other, response], task),
                vote([other, response, response], task)):
        assert grade(task, out, reference).correct is correct, out
        assert extract_answer(out, task) == extract_answer(response, task), out


def test_extract_writes_a_program_in_a_fenced_block():
    out = extract([CODE_OK], "code")
    assert out == "```python\ndef add(a, b):\n    total = a + b\n    return total\n```"


def test_extract_writes_a_literal_of_several_lines_whole():
    out = extract([DICT_LINES], "literal")
    assert extract_answer(out, "literal") == "{'a': [1,\n      2],\n 'b': {'c': 3}}"


def test_vote_counts_a_literal_of_several_lines_with_the_same_value_on_one():
    out = vote(["Answer: [9]", DICT_LINES, f"Answer: {DICT}"], "literal")
    assert out.startswith(f"Votes over 3 output(s): [9] x1, {DICT} x2\n")
    assert grade("literal", out, DICT).correct is True


def test_vote_over_programs_names_them_by_number_and_runs_the_winner():
    out = vote([CODE_WRONG, CODE_OK, CODE_OK], "code")
    assert out.startswith("Votes over 3 output(s): program 1 x1, program 2 x2\n")
    assert grade("code", out, CODE_TESTS).correct is True


# ---- choice: the forms read today, which the vote and extract output must keep ------------------

@pytest.mark.parametrize("response, expected", [
    ("Answer: C", "C"), ("Answer: (C)", "C"), ("Answer: C. Paris", "C"), ("Answer: **C**", "C"),
    ("Answer: \\boxed{C}", "C"), ("Answer: C, D", None), ("Answer: **A**, **B**", None),
    ("Answer: **C** is my pick", None), ("Answer: A, (B)", None), ("Answer: c", "C"),
])
def test_choice_reads_other_forms_as_before(response, expected):
    assert extract_answer(response, "choice") == expected


# ---- F5: literal answers in markup ---------------------------------------------------------

@pytest.mark.parametrize("response", [
    "Answer: `[1, 2]`.", "Answer: **[1, 2]**", "Answer: [1, 2].", "Answer: **[1, 2]**.", "Answer: *[1, 2]*",
    "Answer: **`[1, 2]`**",
])
def test_literal_reads_through_markup_and_a_full_stop(response):
    assert extract_answer(response, "literal") == "[1, 2]"
    assert grade("literal", response, "[1, 2]").correct is True


def test_literal_keeps_a_strings_own_content():
    assert extract_answer("Answer: 'a.'", "literal") == "'a.'"
    assert grade("literal", "Answer: 'a.'", "'a.'").correct is True
    assert grade("literal", "Answer: 'a.'", "'a'").correct is False
    assert grade("literal", "Answer: **'a.'**.", "'a.'").correct is True
    assert extract_answer("Answer: 1.", "literal") == "1."  # a literal as written stays as written
    assert grade("literal", "Answer: **hello**", "**hello**").correct is True  # not a literal: the text
