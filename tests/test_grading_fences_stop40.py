"""Fenced answers after `Answer:` and corrupt text under `literal` and `exact` (audit68 F1, F7).

A fence's first line is its language tag ("```python"), never the answer: read as the answer, two
different answers under the same tag agreed and a `disagree` cascade skipped its strong model. NUL
bytes and lone surrogates are graded as unparsed, as the README says."""

from __future__ import annotations

import pytest

from conductor.execute.engine import condition_holds
from conductor.functions import extract, vote
from conductor.grading import answers_agree, extract_answer, grade
from conductor.plans import Condition

F = "```"
TAGS = ["python", "py", "text", "json", ""]


def fenced(body: str, tag: str = "python", fence: str = F) -> str:
    return f"Let me work it out.\nAnswer:\n{fence}{tag}\n{body}\n{fence}"


@pytest.mark.parametrize("tag", TAGS)
def test_literal_reads_the_fenced_block_not_its_tag(tag):
    g = grade("literal", fenced("[1, 2]", tag), "[1, 2]")
    assert (g.answer, g.parsed, g.correct) == ("[1, 2]", True, True)
    assert grade("literal", fenced("[3, 4]", tag), "[1, 2]").correct is False


@pytest.mark.parametrize("tag", TAGS)
def test_exact_reads_the_fenced_block_not_its_tag(tag):
    g = grade("exact", fenced("Rome", tag), "Rome")
    assert (g.answer, g.parsed, g.correct) == ("rome", True, True)
    g = grade("exact", fenced("Paris", tag), "Rome")
    assert (g.answer, g.parsed, g.correct) == ("paris", True, False)


def test_literal_of_several_lines_and_a_json_dict_under_tags():
    g = grade("literal", fenced("{'a': 1,\n 'b': [2, 3]}", "python"), "{'b': [2, 3], 'a': 1}")
    assert g.correct is True
    assert grade("literal", fenced('{"a": 1}', "json"), "{'a': 1}").correct is True


@pytest.mark.parametrize("response", [
    f"Answer: {F}python\n[1, 2]\n{F}",                     # the fence opens on the Answer line
    "Answer:\n~~~python\n[1, 2]\n~~~",                     # a tilde fence
    f"{F}python\n[1, 2]\n{F}",                             # no marker: the reply ends on the block
    '{"answer": "' + F + 'python\\n[1, 2]\\n' + F + '"}',  # a fenced block as the JSON answer
    f"Answer: {F}[1, 2]{F}",                               # inline triple backticks, as before
])
def test_other_fenced_layouts(response):
    assert grade("literal", response, "[1, 2]").answer == "[1, 2]"
    assert extract_answer(response, "exact") == "1 2"


@pytest.mark.parametrize("task", ["literal", "exact"])
def test_a_fence_that_never_closes_is_unparsed_not_its_tag(task):
    g = grade(task, f"Answer:\n{F}python\n[1, 2]", "[1, 2]")
    assert (g.answer, g.parsed, g.correct) == (None, False, False)
    assert grade(task, f"Answer: {F}", "[1, 2]").parsed is False


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("task,a,b", [("literal", "[3, 4]", "[1, 2]"), ("exact", "Rome", "Paris")])
def test_different_answers_under_the_same_tag_disagree(task, tag, a, b):
    assert answers_agree(task, fenced(a, tag), fenced(b, tag)) is False
    assert answers_agree(task, fenced(a, tag), fenced(a, "text" if tag != "text" else "")) is True


@pytest.mark.parametrize("task,a,b", [("literal", "[3, 4]", "[1, 2]"), ("exact", "Rome", "Paris"),
                                      (None, "Rome", "Paris")])
def test_a_disagree_cascade_escalates_on_fenced_answers(task, a, b):
    """What the executor decides for `when: disagree(0, 1)`: the strong model runs."""
    holds, why = condition_holds(Condition("disagree", (0, 1)), {0: fenced(a), 1: fenced(b)}, task)
    assert (holds, why) == (True, "steps 0, 1 disagree")
    holds, why = condition_holds(Condition("disagree", (0, 1)), {0: fenced(a), 1: fenced(a, "text")}, task)
    assert (holds, why) == (False, "steps 0, 1 agree")


def test_extract_and_vote_write_the_block_content():
    assert extract([fenced("[1, 2]")], "literal") == "Answer: [1, 2]"
    out = vote([fenced("[3, 4]"), fenced("[1, 2]"), fenced("[1,2]", "py")], "literal")
    assert out.splitlines()[-1] == "Answer: [1, 2]" and "[3, 4] x1" in out


# ------------------------------------------------------------------ NUL bytes, lone surrogates (F7)

CORRUPT = ["\x00", "\x00\x00\x00", "Answer: Paris\x00", "Answer: Pa\x00ris", "\ud800", "Answer: Paris\udfff",
           fenced("Paris\x00", "text")]


@pytest.mark.parametrize("task,ref", [("exact", "Paris"), ("literal", "'Paris'"), ("literal", "5")])
@pytest.mark.parametrize("response", CORRUPT)
def test_nul_bytes_and_lone_surrogates_are_unparsed(task, ref, response):
    g = grade(task, response, ref)
    assert (g.answer, g.parsed, g.correct) == (None, False, False)
    assert answers_agree(task, response, response) is False  # an unreadable answer agrees with nothing


def test_a_nul_outside_the_answer_or_escaped_in_a_literal_is_fine():
    assert grade("exact", "Thinking\x00...\nAnswer: Paris", "Paris").correct is True
    assert grade("literal", "Answer: '\\x00'", "'\\x00'").correct is True  # the escape, not the byte


# ------------------------------------------------------------------ math and choice: fenced answers and NUL too (stop 41)

@pytest.mark.parametrize("task,response,ref,expected", [
    ("math", f"Answer:\n{F}\n42\n{F}", "42", ("42", True, True)),
    ("math", f"Answer:\n{F}python\n42\n{F}", "42", ("42", True, True)),
    ("math", f"The answer is 42.\n{F}text\n41\n{F}", "42", ("42", True, True)),
    ("math", "Answer: 42\x00", "42", (None, False, False)),
    ("math", "\x00", "42", (None, False, False)),
    ("math", "\ud800", "42", (None, False, False)),
    ("choice", f"Answer:\n{F}text\nC\n{F}", "C", ("C", True, True)),
    ("choice", "Answer: (C)", "C", ("C", True, True)),
    ("choice", "Answer: C\x00", "C", (None, False, False)),
    ("choice", "\ud800", "C", (None, False, False)),
])
def test_math_and_choice_read_fences_and_refuse_nul(task, response, ref, expected):
    g = grade(task, response, ref)
    assert (g.answer, g.parsed, g.correct) == expected


def test_code_unchanged():
    g = grade("code", f"Answer:\n{F}python\ndef f():\n    return 2\n{F}", "assert f() == 1")
    assert (g.answer, g.parsed, g.correct) == ("def f():\n    return 2", True, False)
    g = grade("code", f"{F}python\ndef f():\n    return 1\n{F}", "assert f() == 1")
    assert (g.answer, g.parsed, g.correct) == ("def f():\n    return 1", True, True)
    g = grade("code", "\x00", "assert True")  # NUL bytes are code that runs and fails
    assert (g.answer, g.parsed, g.correct) == ("\x00", True, False)


@pytest.mark.parametrize("task", ["literal", "exact", None])
def test_an_answer_whose_fence_never_closes_is_unparsed_not_an_earlier_block(task):
    """review40: the text's last closed block was read in its place, so two different unclosed
    answers after the same code block agreed, and a disagree cascade skipped its strong model."""
    before = "Working:\n```python\nx = 1\n```\nAnswer:\n```python\n"
    assert extract_answer(before + "[1, 2]\n", task) is None
    assert answers_agree(task, before + "[1, 2]\n", before + "[3]\n") is False
    after = "Answer:\n```\n[1, 2]\n```\nHow I checked it:\n```python\nprint(f())\n```\n"
    assert extract_answer(after, task) == extract_answer("Answer: [1, 2]", task)  # its block, not a later one
