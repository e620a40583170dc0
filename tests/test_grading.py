"""The answer graders on the forms models really answer in, and on the
equivalences a reader would accept as the same answer."""

from __future__ import annotations

import threading
import time

import pytest

from conductor.grading import TASKS, Grade, answers_agree, extract_answer, grade

# ------------------------------------------------------------------ math extraction

GSM_JSON = """```json
{
    "reasoning": "She sells 16 - 3 - 4 = 9 eggs at $2 each, so 9 * 2 = 18.",
    "answer": "18"
}
```"""
GSM_JSON_NUMBER = '{"reasoning": "4 + 12 + 60 = 76", "answer": 76}'
GSM_JSON_MALFORMED = '```json\n{\n  "reasoning": "He has "about" 5 - 2 = 3 left",\n  "answer": "3"\n```'
GSM_JSON_UNQUOTED = '{\n "reasoning": "the total is 5 + 4 + 2 = 11 per day, times 7",\n "answer": 77\n'
GSM_JSON_SENTENCE = '{"reasoning": "...", "answer": "Julie had $300 left."}'
GSM_JSON_EXPRESSION = '{"reasoning": "...", "answer": "50 * 1.20 = 60"}'
GSM_JSON_CORRECTED = ('```json\n{"reasoning": "...", "answer": "145"}\n```\nApologies, the subtraction was wrong: '
                      '400 - 355 = 45. The corrected JSON:\n```json\n{"reasoning": "...", "answer": "45"}\n```')
GSM_JSON_TEMPLATE_ECHO = ('{"reasoning": "20 / 2 = 10", "answer": "10"}\n\n## Instruction\nPresent your answer as\n'
                          '```json\n{\n    "reasoning": "___",\n    "answer": "___"\n}\n```')


@pytest.mark.parametrize("response, expected", [
    (GSM_JSON, "18"),
    (GSM_JSON_NUMBER, "76"),
    (GSM_JSON_MALFORMED, "3"),
    (GSM_JSON_UNQUOTED, "77"),
    (GSM_JSON_SENTENCE, "300"),
    (GSM_JSON_EXPRESSION, "60"),
    (GSM_JSON_CORRECTED, "45"),
    (GSM_JSON_TEMPLATE_ECHO, "10"),
    ("Working...\nAnswer: 42", "42"),
    ("**Final Answer:** 1,234.50", "1234.5"),
    ("Answer:\n  $18.", "18"),
    ("so the answer is 7.5 hours.", "7.5"),
    ("Thus $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("We get \\boxed{\\frac{\\sqrt{3}}{2}} in the end", "\\frac{\\sqrt{3}}{2}"),
    ("First 3 + 4 = 7 apples.\nThen she has 18 apples left.", "18"),
    ("Answer: 18 eggs", "18"),
    ("Answer: $1,450,000", "1450000"),
    ("Answer: €77", "77"),
    ("Answer: 42%", "42"),
    ("Answer: -$21", "-21"),
    ("Answer: 1/2 cup", "1/2"),
    ("Answer: x^2 + 1", "x^2 + 1"),
    ("Answer: 1234567890123456789012345678901234567890",
     "1234567890123456789012345678901234567890"),
])
def test_math_extraction_forms(response, expected):
    assert extract_answer(response, "math") == expected


def test_math_without_any_number_is_unparsed():
    g = grade("math", "I have no reliable answer to this.\nAnswer: unknown", "12")
    assert g == Grade(answer=None, parsed=False, correct=False)


# ------------------------------------------------------------------ math equivalence

@pytest.mark.parametrize("response, reference", [
    ("Answer: 1/2", "0.5"),
    ("Answer: 0.5", "1/2"),
    ("Answer: 1,000", "1000"),
    ("Answer: 1000", "1,000"),
    ("Answer: $18.", "18"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("Answer: 42%", "42"),
    ("Answer: 120.70", "120.7"),
    ("Answer: 2\\pi", "6.283185307179586"),
    ("Answer: (5 + 4 + 2) * 7", "77"),
    ("Answer: 2x + 2", "2(x+1)"),
    ('{"answer": "$1,596"}', "1,596"),
    ("Answer: 0.30000000000000004", "0.3"),  # a float's rendering of the rounded reference
    ("Answer: 2.9999999999999996", "3"),
    ("Answer: 0.333333", "1/3"),
])
def test_math_equivalent_answers_are_correct(response, reference):
    g = grade("math", response, reference)
    assert g.parsed and g.correct is True, g


@pytest.mark.parametrize("response, reference", [
    ("Answer: 19", "18"),
    ("Answer: 1/3", "0.33"),
    ("Answer: 120.71", "120.70"),
    ("Answer: 2x + 3", "2(x+1)"),
    ("Answer: 5/0", "5"),
    ("Answer: 1e-9", "0"),
    ("Answer: 0.33", "1/3"),
])
def test_math_different_answers_are_wrong(response, reference):
    g = grade("math", response, reference)
    assert g.parsed and g.correct is False, g


def test_math_verify_is_bounded_on_adversarial_input():
    start = time.perf_counter()
    for bad in ("Answer: " + "(" * 40 + "1" + ")" * 40, "Answer: 9^9^9^9^9^9", "Answer: 10^{10^{10^{10}}}"):
        assert grade("math", bad, "5").correct is False
    assert time.perf_counter() - start < 15


def test_math_grading_works_outside_the_main_thread():
    out = {}

    def run():
        out["plain"] = grade("math", "Answer: 1,000", "1000").correct
        out["latex"] = grade("math", "\\boxed{\\frac{1}{2}}", "0.5").correct

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert out == {"plain": True, "latex": True}


# ------------------------------------------------------------------ choice

@pytest.mark.parametrize("response, expected", [
    ("Let's think step by step. ... The answer is (C).", "C"),
    ("Answer: C", "C"),
    ("Reasoning...\nAnswer: (D)", "D"),
    ("so the answer is C.", "C"),
    ('{"reasoning": "...", "answer": "C"}', "C"),
    ('```json\n{"answer": "(B) mitochondria"}\n```', "B"),
    ("**C**", "C"),
    ("(C) The mitochondria", "C"),
    ("C", "C"),
    ("Answer: c", "C"),
    ("The answer is **(F)**.", "F"),
    # a letter in emphasis before a full stop or colon (gpt-4o writes it on MMLU-Pro)
    ("The answer is **A**.", "A"),
    ("Answer: **C**. Paris", "C"),
    ("The correct answer is:\n\n**G**.", "G"),
    ("The answer is `E`.", "E"),
    ("The answer is **A. Epithelial tissue proliferation**.", "A"),
    ("Thus the answer is $\\boxed{D}$.", "D"),
    ("The answer is \\( I \\).", "I"),
    ("The correct answer is:\n\nH. decrease the interest rate", "H"),
    ("The closest option is J. So the answer is J", "J"),
    # 5-shot chain of thought that runs on into made-up next questions: the first answer counts
    ("... The answer is (B).\nThe answer is (D).\nThe answer is (A).", "B"),
    ("The answer is (D).\n\nNow, combining all the answers:\nThe answer is (B).", "D"),
    ("Option E is the best supported by the reasoning above.\nAnswer: E", "E"),
])
def test_choice_extraction_forms(response, expected):
    assert extract_answer(response, "choice") == expected


@pytest.mark.parametrize("response", [
    "",
    "I cannot answer this question without more information.",
    "A. first option\nB. second option\nC. third option",   # a list of options, no choice made
    "The answer is (B,H,J).",                                 # several letters are not one answer
    "Answer: unknown",
    "Now, let's evaluate the options:\nA. Begging the Question:",
    "The answer is **C**, **D**.",                            # two letters in emphasis
    "**A**. first option\n**B**. second option",              # a list in emphasis is still a list
])
def test_choice_without_a_single_letter_is_unparsed(response):
    assert extract_answer(response, "choice") is None
    assert grade("choice", response, "B").parsed is False


def test_choice_grading():
    assert grade("choice", "The answer is (C).", "C") == Grade("C", True, True)
    assert grade("choice", "The answer is (C).", "D") == Grade("C", True, False)
    assert grade("choice", "The answer is (C).", "(C)").correct is True


# ------------------------------------------------------------------ exact

@pytest.mark.parametrize("response, reference, correct", [
    ("Answer: Paris", "paris", True),
    ("Answer: The Eiffel Tower!", "eiffel tower", True),
    ("Answer:   an  apple.", "Apple", True),
    ("The answer is F. Scott Fitzgerald.", "F. Scott Fitzgerald", True),
    ("Copenhagen", "Copenhagen", True),
    ("Recalling the relevant fact.\nThe answer is Hg.\nAnswer: Hg", "Hg", True),
    ("Answer: Oslo", "Copenhagen", False),
    ("Answer: Paris, France", "Paris", False),
])
def test_exact_normalized_equality(response, reference, correct):
    assert grade("exact", response, reference).correct is correct


def test_exact_answer_is_normalized():
    assert extract_answer("Answer: The Great  Gatsby.", "exact") == "great gatsby"


# ------------------------------------------------------------------ no task, no reference, no response

def test_no_task_extracts_but_does_not_grade():
    assert grade(None, "Working.\nAnswer: 42 apples", "42") == Grade("42 apples", True, None)


def test_no_reference_extracts_but_does_not_grade():
    assert grade("math", "Answer: 1,000", None) == Grade("1000", True, None)
    assert grade("choice", "The answer is (B).", None) == Grade("B", True, None)


@pytest.mark.parametrize("task", ["math", "choice", "exact", None])
@pytest.mark.parametrize("response", [None, "", "   \n "])
def test_empty_response_is_unparsed(task, response):
    g = grade(task, response, "5")
    assert g.parsed is False and g.answer is None
    assert g.correct is (None if task is None else False)


def test_unknown_task_is_refused():
    with pytest.raises(ValueError, match="unknown task 'maths'"):
        grade("maths", "Answer: 1", "1")


# ------------------------------------------------------------------ majority voting

def test_answers_agree_on_equivalent_final_answers():
    assert answers_agree("math", "I think 2 + 2.\nAnswer: 1/2", '{"answer": "0.50"}')
    assert answers_agree("math", "Answer: 1,000", "Answer: 1000 dollars")
    assert not answers_agree("math", "Answer: 18", "Answer: 19")
    assert answers_agree("choice", "The answer is (C).", "Answer: C")
    assert not answers_agree("choice", "The answer is (C).", "Answer: D")
    assert answers_agree("exact", "Answer: The Beatles", "answer: beatles")
    assert not answers_agree("math", "Answer: 18", "no idea")


@pytest.mark.parametrize("task, response", [
    ("math", '{"answer": "$1,234.50"}'),
    ("math", "\\boxed{\\frac{1}{2}}"),
    ("choice", "The answer is (C)."),
    ("exact", "Answer: The Great Gatsby."),
])
def test_extracting_again_from_an_answer_line_gives_it_back(task, response):
    """The vote and extract functions write "Answer: <extracted>" for later graders."""
    a = extract_answer(response, task)
    assert a is not None and extract_answer(f"Votes: x2\nAnswer: {a}", task) == a


# ---- literal, exact edge cases, totality ------------------------------------

@pytest.mark.parametrize("response, reference, correct", [
    ("Answer: [1, 2, 3]", "[1, 2, 3]", True),
    ("Answer: (1, 2)", "(1, 2)", True),
    ("Answer: [1, 2]", "(1, 2)", False),  # a list is not a tuple
    ("Answer: {'a': 1, 'b': [2]}", "{'b': [2], 'a': 1}", True),
    ("Answer: ''", "''", True),
    ('Answer: ""', "''", True),
    ("Answer: []", "[]", True),
    ("Answer: {}", "{}", True),
    ("Answer: 3.0", "3", True),
    ("Answer: True", "1", False),  # a bool is not a number here
    ("Answer: '1'", "1", False),
    ("Answer: `'hello'`", "'hello'", True),
    ("Answer: [1, 2", "[1, 2]", False),  # not a literal: wrong, not a crash
    ("Answer: {1.0: 'a'}", "{1: 'a'}", True),
    ("Answer: {1.0, 2}", "{1, 2}", True),
    ("Answer: {'a': [1, 2], 'b': {3}}", "{'b': {3}, 'a': [1, 2]}", True),
])
def test_literal_compares_python_values(response, reference, correct):
    assert grade("literal", response, reference).correct is correct


def test_literal_answers_agree_by_value():
    assert answers_agree("literal", "Answer: (1, 2)", "Answer: (1,2)")
    assert not answers_agree("literal", "Answer: [1]", "Answer: (1,)")


@pytest.mark.parametrize("response, reference", [("Answer: []", "[]"), ("Answer: {}", "{}"), ("Answer: ''", "''"),
                                                 ("Answer: .", ".")])
def test_exact_keeps_answers_that_normalize_to_nothing(response, reference):
    g = grade("exact", response, reference)
    assert g.answer and g.correct is True
    assert grade("exact", "Answer: [1]", reference).correct is False


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("response", [
    "Answer: 1234567890123456789012345678901234567890", "Answer: NaN", "Answer: inf", "Answer: 1e999999999",
    "Answer: \\frac{1}{", "Answer: \\boxed{\\sqrt{", "\x00\x00Answer: 4\x00", "Answer: \ud800\udfff 7",
    "Answer: " + "(" * 5000, "Answer: " + "9" * 10000, "", None, "\u202eAnswer: 5\u202c", "Answer: \ufffd"])
def test_every_grader_is_total(task, response):
    g = grade(task, response, "4" if task != "code" else "assert True")
    assert g.correct in (True, False)
    extract_answer(response, task)
    answers_agree(task, response, "Answer: 4")


def test_math_reads_boxed_and_plain_answer_lines():
    assert grade("math", "so we get $\\boxed{3}$", "3").correct
    assert grade("math", "Answer: 3", "3").correct
    assert grade("math", "Answer: 1234567890123456789012345678901234567890",
                 "1234567890123456789012345678901234567890").correct


# ------------------------------------------------------------------ audit 32: exactness, corrections, scale

@pytest.mark.parametrize("response, reference", [
    ("Answer: 1000001", "1000000"),
    ("Answer: 999999", "1000000"),
    ("Answer: 12,345,679", "12345678"),
    ("Answer: 1000000.5", "1000000"),
    ("Answer: 0.0000001", "0"),
    ("Answer: 1234567890123456789012345678901234567902", "1234567890123456789012345678901234567901"),
])
def test_math_numbers_close_but_not_equal_are_wrong(response, reference):
    assert grade("math", response, reference).correct is False


def test_math_cascade_sees_nearby_integers_disagree():
    assert not answers_agree("math", "1000000", "1000001")
    assert not answers_agree("math", "Answer: 123456789", "Answer: 123456700")


@pytest.mark.parametrize("response, reference", [
    ("Answer: 2.5e6", "2500000"),
    ("Answer: 1e3", "1000"),
])
def test_math_rounding_and_scientific_notation_are_correct(response, reference):
    assert grade("math", response, reference).correct is True


@pytest.mark.parametrize("task, response, reference, answer", [
    ("math", "The answer is 5. Wait, actually the answer is 6.", "6", "6"),
    # choice reads the first "the answer is", as MMLU-Pro's rule and its labels do: a correction
    # read as the answer cost agreement with them (5-shot replies run on into other questions)
    ("choice", "The answer is A.\nOn reflection, the answer is C.", "C", "A"),
    ("choice", "The answer is A. Hmm, no: the answer is C.", "A", "A"),
])
def test_a_corrected_answer_is_the_one_graded_in_math_and_the_first_in_choice(task, response, reference, answer):
    g = grade(task, response, reference)
    assert g.answer == answer and g.correct is (answer == reference)


@pytest.mark.parametrize("response", ["Answer: 5 (or 6)", "Answer: 5 or 6", "Answer: between 5 and 6",
                                      "Answer: either 5 or 6 apples"])
def test_math_hedge_is_not_credited(response):
    assert grade("math", response, "5").correct is False
    assert grade("math", response, "6").correct is False


def test_nested_boxes_read_as_the_outer_box():
    assert grade("math", "\\boxed{\\frac{1}{\\boxed{2}}}", "0.5").correct is True
    assert grade("math", "\\boxed{\\boxed{42}}", "42").correct is True
    assert grade("math", "\\boxed{42} and later \\boxed{43}", "43").correct is True


@pytest.mark.parametrize("response", ["```\n[1, 2]\n```", "```python\n[1, 2]\n```", "Answer:\n```\n[1, 2]\n```",
                                      "The output is:\n```\n[1, 2]\n```", "```\n[0]\n```\nso:\n```\n[1, 2]\n```"])
def test_literal_reads_a_fenced_answer(response):
    g = grade("literal", response, "[1, 2]")
    assert (g.answer, g.correct) == ("[1, 2]", True)


@pytest.mark.parametrize("response, reference, correct", [
    ("Answer: {True: 1}", "{1: 1}", False),
    ("Answer: {True}", "{1}", False),
    ("Answer: {(True, 2)}", "{(1, 2)}", False),
])
def test_literal_dict_keys_and_set_members_compare_by_kind(response, reference, correct):
    assert grade("literal", response, reference).correct is correct


_MB = 250_000  # a quarter of a megabyte: the old quadratic scans took many minutes on these


@pytest.mark.parametrize("shape", [
    "Let me see \\boxed{" * (_MB // 17),
    "\\boxed{" * (_MB // 8) + "5" + "}" * (_MB // 8),
    "\\boxed{5} " * (_MB // 10),
    "Answer:\n" * (_MB // 8),
    "the answer is A. " + "the answer is B. " * (_MB // 17),
    "```" + "a" * _MB,
])
@pytest.mark.parametrize("task", ["math", "choice", "literal", None])
def test_a_large_adversarial_response_grades_promptly(shape, task):
    # Each took many minutes when a scan restarted at every marker; linear, each
    # takes well under a second. 30 s leaves a loaded machine ample room.
    start = time.perf_counter()
    g = grade(task, shape, "5")
    assert time.perf_counter() - start < 30
    assert g.detail is None or not g.detail.startswith("grader error")
