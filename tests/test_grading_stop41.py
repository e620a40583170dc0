"""`math` and `choice` read a fenced answer after `Answer:` and treat corrupt text as unparsed, as
`literal` and `exact` do (stop 41).

Before, "Answer:\\n```\\n42\\n```" was unparsed under math and choice (graded wrong, and two such answers
never agreed), and "Answer: 42\\x00" was read as 42 under math while exact and literal call an answer
with a NUL byte or a lone surrogate unparsed."""

from __future__ import annotations

import pytest

from conductor.execute.engine import condition_holds
from conductor.grading import answers_agree, extract_answer, grade
from conductor.plans import Condition

F = "```"


def fenced(body: str, tag: str = "", fence: str = F) -> str:
    return f"Let me work it out.\nAnswer:\n{fence}{tag}\n{body}\n{fence}"


LAYOUTS = [
    lambda b: fenced(b),                              # the block on the line after the marker
    lambda b: fenced(b, "text"),                      # a language tag, never the answer
    lambda b: fenced(b, "", "~~~"),                   # a tilde fence
    lambda b: f"Answer: {F}\n{b}\n{F}",               # the fence opens on the marker's line
    lambda b: f"Answer: 7\nOn reflection:\nAnswer:\n{F}\n{b}\n{F}",  # the last marker's block
]
JSON_FENCED = '{"answer": "' + F + '\\n%s\\n' + F + '"}'  # a fenced block as the JSON answer: read before too


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_math_reads_the_fenced_block_after_answer(layout):
    make = LAYOUTS[layout]
    g = grade("math", make("42"), "42")
    assert (g.answer, g.parsed, g.correct) == ("42", True, True)
    g = grade("math", make("41"), "42")
    assert (g.answer, g.parsed, g.correct) == ("41", True, False)
    assert answers_agree("math", make("42"), "Answer: 42.0") is True
    assert answers_agree("math", make("42"), make("41")) is False


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_choice_reads_the_fenced_block_after_answer(layout):
    make = LAYOUTS[layout]
    g = grade("choice", make("C"), "C")
    assert (g.answer, g.parsed, g.correct) == ("C", True, True)
    g = grade("choice", make("(B) Paris"), "C")
    assert (g.answer, g.parsed, g.correct) == ("B", True, False)
    assert answers_agree("choice", make("C"), "The answer is (C).") is True
    assert answers_agree("choice", make("C"), make("B")) is False
    assert extract_answer(f"Answer: {F}C{F}", "choice") == "C"  # inline backticks, read as before


@pytest.mark.parametrize("task,a,b", [("math", "42", "41"), ("choice", "C", "B")])
def test_a_disagree_cascade_sees_fenced_math_and_choice_answers(task, a, b):
    """What the executor decides for `when: disagree(0, 1)`: agreeing fenced answers skip the strong model."""
    holds, why = condition_holds(Condition("disagree", (0, 1)), {0: fenced(a), 1: fenced(a, "text")}, task)
    assert (holds, why) == (False, "steps 0, 1 agree")
    holds, why = condition_holds(Condition("disagree", (0, 1)), {0: fenced(a), 1: fenced(b)}, task)
    assert (holds, why) == (True, "steps 0, 1 disagree")


def test_math_reads_the_last_markers_block_and_an_unclosed_one_is_unparsed():
    before = f"Working:\n{F}\n42\n{F}\nAnswer:\n{F}\n"
    assert extract_answer(before + "41\n", "math") is None  # not the earlier block's 42
    assert extract_answer(before + f"41\n{F}", "math") == "41"
    assert extract_answer(JSON_FENCED % "41", "math") == "41"
    assert extract_answer(JSON_FENCED % "(B) Paris", "choice") == "B"


# ------------------------------------------------------------------ NUL bytes, lone surrogates

CORRUPT = {
    "math": ["Answer: 42\x00", "Answer: 4\x002", "Answer: 42\ud800", "Answer: \udfff42", "So she has 42\x00 eggs",
             '{"answer": "42\x00"}', "\\boxed{42\x00}"],
    "choice": ["Answer: (C)\x00", "Answer: (C) Pa\x00ris", "Answer: (C)\ud800", "The answer is (C)\x00",
               "(C)\udfff", '{"answer": "(C)\x00"}'],
}


@pytest.mark.parametrize("task,response", [(t, r) for t, rs in CORRUPT.items() for r in rs])
def test_an_answer_with_nul_bytes_or_lone_surrogates_is_unparsed(task, response):
    ref = "42" if task == "math" else "C"
    g = grade(task, response, ref)
    assert (g.answer, g.parsed, g.correct) == (None, False, False)
    assert answers_agree(task, response, response) is False  # an unreadable answer agrees with nothing
    assert grade(task, fenced(ref + "\x00"), ref).parsed is False  # in a fenced block too
    # A NUL in the working, not in the answer, is fine.
    assert grade(task, f"Thinking\x00 it over.\nAnswer: {ref}", ref).correct is True


def test_a_corrupt_final_choice_answer_does_not_fall_back_to_an_earlier_one():
    """review41 3: 'Answer: B ... Answer: C<NUL>' read as B under choice, as no other grader does."""
    for response in ("Answer: B\nwait\nAnswer: C\x00", "Answer: B\nAnswer: \ud800C"):
        g = grade("choice", response, "B")
        assert (g.answer, g.parsed, g.correct) == (None, False, False), response
        assert grade("math", response.replace("B", "4").replace("C", "5"), "4").answer is None
