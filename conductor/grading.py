"""Answer graders: read the final answer out of a model response and judge it.

Extraction is hand-written, because it must know the forms models really answer
in: a JSON "answer" field, an "Answer: ..." line (what our own workers are asked
to end with), "The answer is (C)", \\boxed{...}, a bare letter, a last number.
Mathematical equivalence is left to math-verify; a cheap exact comparison of
plain numbers runs first because nearly every math answer is one, and it keeps
grading tens of thousands of rows fast.

Tasks: "math" (a number or expression), "choice" (a letter A-J), "exact"
(normalized string equality), "literal" (a Python literal, compared by value:
code-output prediction), "code" (the answer's code must pass the reference's
tests, run in `conductor.sandbox`). No task or no reference: nothing to grade
by, so `correct` is None.

Every function here is total on any text: an answer a grader cannot handle is
graded as unparsed (with `detail` saying why), never an exception, so one odd
row never stops an evaluation.
"""

from __future__ import annotations

import ast
import bisect
import json
import os
import re
import string
import threading
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Iterable

TASKS = ("math", "choice", "exact", "literal", "code")
# The tasks a query may name: the graded ones, and "record", a row of an enrichment job, answered with
# a JSON record and scored by the job's references. Here, beside TASKS, so the pool file can check a
# skill tag without importing conductor.queries (which imports the pool's importers).
QUERY_TASKS = (*TASKS, "record")
_LITERAL_MAX_CHARS = 100_000  # literal_eval of a huge nested literal can exhaust the stack

# math-verify bounds its own work with signal.alarm, which only the main thread
# may use; elsewhere it runs without a timeout, so inputs on which its parser is
# known to blow up (long, deeply nested, exponent towers) never reach it.
_MV_TIMEOUT_S = 2
_MV_MAX_CHARS = 200
_MV_MAX_DEPTH = 12
_REL_TOL = Fraction(1, 10**6)
_LONG_DECIMAL = 6  # decimal places from which a number may be a float's rendering of a rounder one


@dataclass(frozen=True)
class Grade:
    answer: str | None      # the extracted final answer (normalized form), None when none found
    parsed: bool            # an answer was found
    correct: bool | None    # None when there is no reference or no task to grade by
    detail: str | None = None  # why: a grader that could not handle the text, a code run's outcome


def grade(task: str | None, response: str | None, reference: str | None) -> Grade:
    """Extract the final answer of `response` and judge it against `reference`."""
    _check_task(task)
    try:
        return _grade(task, response, reference)
    except Exception as e:  # noqa: BLE001 - total by design: see the module docstring
        return Grade(None, False, None if task is None or reference is None else False,
                     f"grader error: {type(e).__name__}: {str(e)[:200]}")


def grade_all(items: Iterable[tuple[str | None, str | None, str | None]]) -> list[Grade]:
    """`grade` over many (task, response, reference), in order. Code answers run in their sandboxes a
    few at a time (one per core: each thread waits on its own process, and one that hangs for its 10 s
    no longer holds up the rest); the other graders run here, one after another (math-verify's timeout
    uses signals, which only the main thread may set)."""
    items = list(items)
    code = [i for i, (task, _, _) in enumerate(items) if task == "code"]
    out: list[Grade | None] = [None] * len(items)
    if len(code) > 1:
        for i, g in zip(code, _grade_side_by_side([items[i] for i in code])):
            out[i] = g
    for i, item in enumerate(items):
        if out[i] is None:
            out[i] = grade(*item)
    return out  # type: ignore[return-value]


def _grade_side_by_side(items: list[tuple[str | None, str | None, str | None]]) -> list[Grade]:
    """`grade` over code answers, one sandbox per core. Interrupted (Ctrl-C, or SIGTERM, which takes
    its path), it kills the sandboxes running at once and then re-raises: waiting for them, it sat
    silent for up to their 10 s timeout (audit46 F5)."""
    from concurrent.futures import ThreadPoolExecutor, wait

    from conductor.sandbox import stop_all

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(grade, *item) for item in items]
        try:
            # In short waits: a signal that reaches another thread (polars' start their own) runs its
            # handler only once the main thread wakes, and a wait on one result slept to the 10 s timeout.
            pending = set(futures)
            while pending:
                pending = wait(pending, timeout=0.2).not_done
            return [f.result() for f in futures]
        except BaseException:
            running = [f for f in futures if not f.cancel()]  # the queued ones are cancelled
            stop_all()
            while wait(running, timeout=0.05).not_done:
                stop_all()  # one that a thread took up just as the others were cancelled
            raise


def _grade(task: str | None, response: str | None, reference: str | None) -> Grade:
    if task == "code":
        return _grade_code(response, reference)
    answer = extract_answer(response or "", task)
    if task is None or reference is None:
        return Grade(answer, answer is not None, None)
    if task == "literal":
        ref = _literal_value(reference)
        got = _literal_value(answer) if answer is not None else _NOTHING
        if ref is _NOTHING:  # the reference is not a literal: compare the text
            return Grade(answer, answer is not None, answer is not None and answer.strip() == reference.strip())
        return Grade(answer, answer is not None, got is not _NOTHING and _same_literal(got, ref))
    if task == "exact":
        ref = _normalize_text(reference) or reference.strip()
        ok = answer is not None and answer == ref
        if not ok and response and not _UNREADABLE.search(response):
            ok = _normalize_text(response) == ref  # a bare reply that is the answer itself
        return Grade(answer, answer is not None, ok)
    if answer is None:
        return Grade(None, False, False)
    if task == "choice":
        ref = _choice_from_span(reference.strip()) or reference.strip().upper()
        return Grade(answer, True, answer == ref)
    ref = _math_answer(reference)
    return Grade(answer, True, ref is not None and _math_equal(ref, answer))


def reads_whole(text: str | None, task: str | None) -> bool:
    """Whether the `task` grader also reads `text` whole, beside its final answer: an `exact` reply of
    several lines with no answer marker is correct by its last line or as the whole reply (`_grade`).
    A worker that relays it (vote, extract) passes it on as it is, else the whole reading is lost."""
    try:
        return (task == "exact" and bool(text) and not _UNREADABLE.search(text) and _final_span(text) is None
                and sum(1 for line in text.splitlines() if line.strip()) > 1)
    except Exception:  # noqa: BLE001 - total, as extract_answer: a text no grader can read is not read whole
        return False


def answers_agree(task: str | None, a: str | None, b: str | None) -> bool:
    """Whether two responses (or two extracted answers) give the same final answer."""
    _check_task(task)
    try:
        return _agree(task, a, b)
    except Exception:  # noqa: BLE001 - total: an answer no grader can read agrees with nothing
        return False


def _agree(task: str | None, a: str | None, b: str | None) -> bool:
    x, y = extract_answer(a or "", task), extract_answer(b or "", task)
    if x is None or y is None:
        return False
    if task == "math":
        return _math_equal(x, y) or _math_equal(y, x)
    if task is None:
        return _normalize_text(x) == _normalize_text(y)
    if task == "literal":
        vx, vy = _literal_value(x), _literal_value(y)
        if vx is not _NOTHING and vy is not _NOTHING:
            return _same_literal(vx, vy)
    return x == y


def extract_answer(text: str | None, task: str | None) -> str | None:
    """The final answer in `text`, in normalized form for `task`; None when there is none.

    Normalized forms: math, a plain number ("1234.5") when the answer is one, else
    the answer's expression; choice, the upper-case letter; exact, the case-folded
    text without punctuation, articles or extra spaces; no task, the answer's text
    as written; literal, the answer's text; code, the answer's code. Extracting again
    from a normalized answer gives it back. Total: None when nothing can be read.
    """
    _check_task(task)
    try:
        return _extract(text, task)
    except Exception:  # noqa: BLE001 - total by design
        return None


def _extract(text: str | None, task: str | None) -> str | None:
    if not text or not text.strip():
        return None
    if task == "code":
        return _code_of(text)
    if task == "choice":
        return _choice_answer(text)
    span = _final_span(text)
    if task == "math":
        if span is None:
            return _math_answer(_readable(_last_line(text)), lead=False)
        return _math_answer(_readable(_fenced_or(span, text)))  # a fenced block after "Answer:": its content
    span = span if span is not None else _last_line(text)
    if span is None:
        return None
    fenced = _fenced_answer(span, text)
    if task == "literal":
        value = fenced if fenced is not None else span.strip().strip("`").strip()
        if not value:  # "Answer: ``": the answer is a fenced block, its last one
            value = _fenced_answer("```", text) or ""
        return _readable(_bare_literal(value))
    if task == "exact":
        if fenced is not None:
            span = fenced
        # "[]", "''" or "." normalize to nothing: keep them as written rather than lose them.
        return _readable(_normalize_text(span) or span.strip())
    return _strip_markup(span if fenced is None else fenced) or None


_NOTHING = object()
_FENCE = re.compile(r"(```|~~~)[ \t]*+([A-Za-z0-9_+-]*+)[^\n`~]*+\n(.*?)\1", re.S)
# A span that opens a fenced block (or is a fence line alone): "```python", "~~~", "```".
_FENCE_START = re.compile(r"(?:```|~~~)[^`~\n]*+(?:\n|$)")
# NUL bytes and lone surrogates: corrupt text, not an answer (literal_eval refuses both).
_UNREADABLE = re.compile("[\x00\ud800-\udfff]")


def _fenced_answer(span: str, text: str) -> str | None:
    """The content of the fenced block that `span` opens, None when `span` opens none: after "Answer:",
    a fence's first line is its language tag ("```python"), never the answer (audit68 F1). A span that
    holds the whole block (a JSON "answer") gives that block; a fence line alone gives the block that
    opens at the last "Answer:" marker (never an earlier one), or without a marker the text's last
    block; one that never closes: "" (unparsed)."""
    span = span.strip()
    if not _FENCE_START.match(span):
        return None
    blocks = _FENCE.findall(span)
    if blocks:
        return blocks[-1][2].strip()
    marker = None
    for marker in _ANSWER_LINE.finditer(text):
        pass
    if marker is None:  # the reply ends in a block (its last line a fence): that block
        blocks = _FENCE.findall(text)
        return blocks[-1][2].strip() if blocks else ""
    block = _FENCE.search(text, marker.start())
    return block.group(3).strip() if block is not None else ""


def _fenced_or(span: str, text: str) -> str:
    """The fenced block `span` opens (see `_fenced_answer`), else `span` itself."""
    fenced = _fenced_answer(span, text)
    return span if fenced is None else fenced


def _readable(answer: str | None) -> str | None:
    """`answer`, or None where it is empty or holds NUL bytes or lone surrogates (audit68 F7)."""
    return answer if answer and not _UNREADABLE.search(answer) else None


def _bare_literal(value: str) -> str:
    """A literal without the markup or full stop around it ("`[1, 2]`.", "**[1, 2]**"), only where the
    text as written is no literal and what is left is one: a string's own "'a.'" stays as it is."""
    if _literal_value(value) is not _NOTHING:
        return value
    bare = value.rstrip(".").strip().strip("*_`").strip().rstrip(".").strip()
    return bare if bare and _literal_value(bare) is not _NOTHING else value


def _literal_value(text: str | None):
    if text is None or len(text) > _LITERAL_MAX_CHARS:
        return _NOTHING
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOTHING


def _same_literal(a, b) -> bool:
    """Equal values of the same kind: 1 == 1.0 holds, but True is not 1 and "1" is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float, complex)) and isinstance(b, (int, float, complex)):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_literal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        keys = {_typed(k): k for k in b}
        return (len(a) == len(b) and all(_typed(k) in keys for k in a)
                and all(_same_literal(v, b[keys[_typed(k)]]) for k, v in a.items()))
    if isinstance(a, (set, frozenset)):
        return {_typed(x) for x in a} == {_typed(x) for x in b}
    return a == b


def _typed(x):
    """A hashable key under which two set members or dict keys are the same exactly when
    `_same_literal` would say so: True and 1 differ, 1 and 1.0 do not."""
    if isinstance(x, bool):
        return ("bool", x)
    if isinstance(x, (int, float, complex)):
        return ("number", x)
    if isinstance(x, tuple):
        return ("tuple", tuple(_typed(y) for y in x))
    if isinstance(x, frozenset):
        return ("frozenset", frozenset(_typed(y) for y in x))
    return (type(x).__name__, x)


_PYTHON = ("python", "py", "python3", "py3")


def _code_of(text: str) -> str | None:
    """The answer's program: its fenced Python blocks (``` or ~~~) joined in order, since models often
    define a function in one block and use it in the next (the last block alone, where the joined blocks
    do not compile, as a draft followed by its fix); else its unlabeled fenced blocks, likewise; else its
    last fenced block; else the text. A leading byte-order mark is dropped."""
    blocks = [(lang.lower(), body) for _, lang, body in _FENCE.findall(text.lstrip("\ufeff"))]
    python = [body for lang, body in blocks if lang in _PYTHON]
    bare = [body for lang, body in blocks if not lang]
    chosen = python or bare or [body for _, body in blocks][-1:] or [text]
    code = "\n".join(b.lstrip("\ufeff") for b in chosen).lstrip("\ufeff").strip()
    if len(chosen) > 1 and not _compiles(code):
        code = chosen[-1].lstrip("\ufeff").strip()
    return code or None


def _compiles(code: str) -> bool:
    try:
        compile(code, "main.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, UnicodeError):
        return False
    return True


def _grade_code(response: str | None, reference: str | None) -> Grade:
    """Run the answer's code, then the reference's tests (asserts), in the sandbox: correct only if the
    tests ran to the end (see conductor.sandbox; exiting early or an always-equal `__eq__` does not pass)."""
    from conductor.sandbox import run_python

    code = _code_of(response or "") if response else None
    if reference is None:
        return Grade(code, code is not None, None)
    if code is None:
        return Grade(None, False, False, "no code in the response")
    result = run_python(code, tests=reference)
    return Grade(code, True, result.ok, result.detail)


def _check_task(task: str | None) -> None:
    if task is not None and task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)} or None")


# ---------------------------------------------------------------- locating the answer

_ANSWER_LINE = re.compile(
    r"(?im)^[#>*_\-\t ]*(?:final[\t ]+|correct[\t ]+)?answer[*_]*[\t ]*(?:is[\t ]*)?[:：][*_]*[\t ]*(.*)$")
_ANSWER_IS = re.compile(r"(?i)\banswer\s+is\b[\s:]*")
_CORRECTION = re.compile(
    r"(?i)\b(?:wait|actually|on (?:second thought|reflection|closer (?:look|inspection))|correction|"
    r"i made (?:a|an) (?:mistake|error)|(?:that|this) (?:is|was) (?:wrong|incorrect)|let me (?:re-?check|reconsider|correct)|"
    r"re-?(?:examin|consider|evaluat)|no,|hmm)")
_NEXT_LINE = re.compile(r"\s*+([^\n]*)")
_JSON_KEY = re.compile(r'(?i)"answer"\s*:\s*')


def _final_span(text: str) -> str | None:
    """The raw text of the final answer, found by the strongest marker present."""
    span = _json_answer(text)
    if span is not None:
        return span
    lines = _answer_lines(text)
    if lines:
        return lines[-1]
    boxed = _boxed_contents(text)
    if boxed:
        return boxed[-1]
    return _stated_last(text, _ANSWER_IS, _rest_of_sentence)


def _rest_of_sentence(m: re.Match) -> str | None:
    """The sentence after an "answer is", read no further than 1,000 characters, so that
    many statements on one huge line cost linear time."""
    text, start = m.string, m.end()
    end = text.find("\n", start, start + 1000)
    return _first_sentence(text[start:end if end >= 0 else start + 1000]) or None


def _stated_last(text: str, marker: re.Pattern, read) -> str | None:
    """The answer a response settles on among its "the answer is ..." statements.

    A later statement of a different answer replaces the current one only when the
    text between them takes it back ("wait", "actually", "on reflection", "I made a
    mistake", ...). Without that, a later different answer is most often the model
    running on into other questions (a few-shot prompt's examples, "combining all
    the answers"), and the first is its answer to this one, as the benchmarks' own
    extraction rules have it."""
    answer, end, cues = None, 0, None
    for m in marker.finditer(text):
        got = read(m)
        if not got:
            continue
        if answer is not None and got != answer:
            if cues is None:  # found once, so that many statements cost one pass
                cues = [c.start() for c in _CORRECTION.finditer(text)]
            i = bisect.bisect_left(cues, end)
            if i < len(cues) and cues[i] < m.start():
                answer = got
        elif answer is None:
            answer = got
        if got == answer:
            end = m.end()
    return answer


def _answer_lines(text: str) -> list[str]:
    """What follows each "Answer:" marker; an empty marker line takes the next line."""
    out = []
    for m in _ANSWER_LINE.finditer(text):
        span = m.group(1).strip()
        if not span:
            nxt = _NEXT_LINE.search(text, m.end())
            span = nxt.group(1).strip() if nxt else ""
        if span:
            out.append(span)
    return out


def _last_line(text: str) -> str | None:
    rows = [r.strip() for r in text.strip().splitlines() if r.strip()]
    return rows[-1] if rows else None


def _json_answer(text: str) -> str | None:
    """The "answer" value of the last JSON object that has one; tolerant of broken JSON."""
    if '"answer"' not in text.lower():
        return None
    found = None
    decoder = json.JSONDecoder(strict=False)
    starts = [m.start() for m in re.finditer(r"\{", text)][:200]
    pos_done = -1
    for i in starts:
        if i < pos_done:
            continue
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            continue
        pos_done = end
        if isinstance(obj, dict):
            value = next((v for k, v in obj.items() if str(k).lower() == "answer"), None)
            if _is_filled(value):
                found = value
    if found is not None:
        if isinstance(found, (list, dict)):
            return json.dumps(found)
        return str(found)
    # Malformed JSON: read the value after the last "answer": by hand.
    keys = list(_JSON_KEY.finditer(text))
    if not keys:
        return None
    rest = text[keys[-1].end():]
    if rest.startswith('"'):
        m = re.match(r'"((?:[^"\\]|\\.)*)"', rest, re.S)
        value = m.group(1) if m else rest[1:].split("\n")[0]
        return value.replace('\\"', '"').replace("\\\\", "\\").strip()
    m = re.match(r"([^,}\n]*)", rest)
    value = m.group(1).strip() if m else ""
    return value or None


def _is_filled(value: object) -> bool:
    """False for a missing answer or a template's placeholder such as "___"."""
    return value is not None and bool(re.search(r"\w", str(value).replace("_", "")))


_BOX_TOKEN = re.compile(r"\\(?:boxed|fbox)\s*+\{|[{}]")


def _boxed_contents(text: str) -> list[str]:
    """Contents of every outermost \\boxed{...} / \\fbox{...}, nested braces respected,
    with the box markers of any box inside it removed: \\boxed{\\frac{1}{\\boxed{2}}}
    gives \\frac{1}{2}. One pass over the text with a stack of open braces."""
    if "box" not in text:
        return []
    out: list[str] = []
    stack: list[tuple[bool, int, int]] = []  # open braces: (a box's, its marker's start, its content's start)
    boxes = 0                                # how many of them are boxes'
    inner: list[tuple[int, int, int]] = []   # closed boxes inside the open outermost box: marker, content, end
    for m in _BOX_TOKEN.finditer(text):
        if m.group(0) != "}":
            box = m.group(0) != "{"
            if box and not boxes:
                inner = []
            stack.append((box, m.start(), m.end()))
            boxes += box
        elif stack:
            box, start, content = stack.pop()
            if not box:
                continue
            boxes -= 1
            if boxes:  # a box inside a box: its markers go when the outermost one closes
                inner.append((start, content, m.start()))
            else:
                out.append(_unwrap(text, content, m.start(), inner))
    return out


def _unwrap(text: str, start: int, end: int, inner: list[tuple[int, int, int]]) -> str:
    """text[start:end] without the markers and closing braces of the boxes in `inner`."""
    cuts = sorted([(s, c) for s, c, _ in inner] + [(e, e + 1) for _, _, e in inner])
    parts, pos = [], start
    for a, b in cuts:
        parts.append(text[pos:a])
        pos = b
    parts.append(text[pos:end])
    return "".join(parts).strip()


_ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "st", "jr", "sr", "vs", "no", "approx", "etc", "prof"}


def _first_sentence(s: str) -> str:
    """Up to the first full stop that ends a sentence: not a decimal point, an
    initial ("F. Scott Fitzgerald") or a common abbreviation."""
    s = s.strip().split("\n")[0]
    for m in re.finditer(r"(\S*)\.(?=\s|$)", s):
        word = m.group(1).lower().lstrip("([\"'")
        if len(word) > 1 and word not in _ABBREVIATIONS and not word[-1].isdigit():
            return s[:m.end() - 1].strip()
    return s.strip()


def _strip_markup(s: str) -> str:
    s = s.strip()
    boxed = _boxed_contents(s)
    if boxed:
        s = boxed[-1]
    s = re.sub(r"\\(?:text(?:bf|rm)?|mathrm)\{([^{}]*)\}", r"\1", s)
    s = s.strip().strip("*_`").strip()
    if len(s) >= 2 and s[0] == s[-1] == "$" and "$" not in s[1:-1]:
        s = s[1:-1].strip()
    for a, b in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(a) and s.endswith(b):
            s = s[2:-2].strip()
    return s.rstrip(".").strip()


# ---------------------------------------------------------------- choice


_LETTER = re.compile(r"""^(?:[\s*_`"'$}:]|\\[(\[]|\\(?:boxed|text|textbf|mathrm)\{)*
    (?:\(([A-J])(?:\)|$)|\[([A-J])\]|
       ([A-J])(?=$|[\s*_`"'$}]*$|[*_`]*[.:)\]}]|\s*\\[)\]]|\s*[-–—]\s|,(?!\s*\(?[A-J]\b)))""", re.X)


_CHOICE_IS = re.compile(r"(?i)\banswer\s+is\b(?=[\s:]*(.{0,40}))", re.S)


def _choice_from_span(span: str) -> str | None:
    """The letter an answer span starts with: "C", "(C) text", "C. text", "**C**", "**C**. text", "\\boxed{C}".
    None for a span with NUL bytes or lone surrogates: corrupt text, as under exact and literal."""
    if _UNREADABLE.search(span):
        return None
    m = _LETTER.match(span)
    if m:
        return next(g for g in m.groups() if g)
    m = (re.match(r"(?i)^\W*(?:option|choice)\s*\(?([A-J])\b", span)
         or re.match(r"^[\W_]*\(?([a-j])\)?[\W_]*$", span))  # "option c", a lone lower-case "c"
    return m.group(1).upper() if m else None


def _choice_answer(text: str) -> str | None:
    span = _json_answer(text)
    if span is not None:
        span = _fenced_or(span, text)
        return _choice_from_span(span.strip()) or (_choice_answer(span) if span != text else None)
    lines = _answer_lines(text)
    if lines:  # the last "Answer:" may open a fenced block, as under literal and exact
        lines[-1] = _fenced_or(lines[-1], text)
        if _UNREADABLE.search(lines[-1]):  # the final answer is corrupt: not an earlier one instead
            return None
    for span in reversed(lines):
        letter = _choice_from_span(span)
        if letter:
            return letter
    # The first "the answer is" naming a letter, as MMLU-Pro's own rule reads it (and its labels
    # were made): 5-shot replies run on into other questions; a take-back is not read here (math does).
    for m in _CHOICE_IS.finditer(text):
        letter = _choice_from_span(m.group(1))
        if letter:
            return letter
    for b in reversed(_boxed_contents(text)):
        letter = _choice_from_span(b)
        if letter:
            return letter
    # No marker: a reply that is just the option ("C", "(C) text", "**C**"), or
    # ends on a line naming one; a run of such lines is a list of options, not an answer.
    rows = [r.strip() for r in text.strip().splitlines() if r.strip()]
    # A line ending in ":" ("A. Begging the Question:") heads a discussion of that option.
    letters = [None if r.endswith(":") else _choice_from_span(r) for r in rows]
    if sum(1 for x in letters if x) == 1 and (letters[0] or letters[-1]):
        return letters[0] or letters[-1]
    return None


# ---------------------------------------------------------------- math

_NUM = r"[-−]?(?:\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d{1,3}(?![\d.]))?"  # "2.5e6": at most 3 exponent digits
_PLAIN = re.compile(rf"^{_NUM}(?:/{_NUM})?$")  # an integer, a decimal or a simple fraction
_WITH_UNIT = re.compile(rf"^({_NUM}(?:/{_NUM})?)\s*%?\s*[^\d\s=+*^\\(][^\d=+*^\\]*$")
_FIRST = re.compile(rf"(?<![\w.]){_NUM}(?:/\d+(?![\d.]))?")
_HEDGE = re.compile(rf"(?i){_NUM}\s*[()]?\s*,?\s*\(?\s*(?:or|and/or)\s*\(?\s*{_NUM}"
                    rf"|\b(?:between|either)\b[^\d\n]{{0,20}}{_NUM}[^\d\n]{{0,20}}\b(?:and|or)\b")
_MATH_CHARS = re.compile(r"[\w\s+\-*/^()\[\]{}.,×÷·√π\\|!<>]*")
_CURRENCY = re.compile(r"[$€£¥₹₩₽¢]")


def _clean_numbers(s: str) -> str:
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands separators
    s = re.sub(r"(?<=\d)[\u00a0\u202f](?=\d{3}(?!\d))", "", s)
    return s.replace("−", "-")


def _is_expression(s: str) -> bool:
    """Maths rather than prose: no word of two letters or more outside LaTeX commands."""
    if not re.search(r"\d|\\[A-Za-z]", s) or not _MATH_CHARS.fullmatch(s):
        return False
    return not re.search(r"[A-Za-z]{2,}", re.sub(r"\\[A-Za-z]+", " ", s))


def _math_answer(span: str | None, lead: bool = True) -> str | None:
    """Normalize a math answer: a plain number or fraction when the answer states one,
    else its expression (for math-verify); None when it holds no number at all.
    Among words, a marked answer ("Answer: 18 eggs") leads with its number; an
    unmarked last line ("So she has 18 eggs left") ends with it."""
    if span is None:
        return None
    s = _clean_numbers(_strip_markup(span))
    s = re.sub(r"\\[$%]", lambda m: m.group(0)[1], s)
    s = re.sub(r"\\(?:,|;|!|quad|qquad)", " ", s)
    s = _CURRENCY.sub("", s).strip()
    if "=" in s:  # "x = 18", "12 + 6 = 18": the value after the last equals sign
        tail = s.rsplit("=", 1)[1].strip()
        if tail:
            s = tail
    s = s.strip().rstrip(".").strip()
    bare = s[:-1].strip() if s.endswith("%") else s
    if _PLAIN.match(bare):
        return _canonical(bare)
    m = _WITH_UNIT.match(s)  # "18 dollars", "1/2 cup", "12.5 m/s"
    if m:
        return _canonical(m.group(1))
    if _is_expression(s):
        return s
    found = [m.group(0) for m in _FIRST.finditer(s)]
    if not found:
        return None
    if len({_canonical(x) for x in found}) > 1 and _HEDGE.search(s):  # "5 (or 6)": two answers, none given
        return None
    return _canonical(found[0] if lead else found[-1])


def _canonical(num: str) -> str:
    num = num.replace("−", "-")
    if "/" in num:
        return num
    try:
        d = Decimal(num)
    except InvalidOperation:
        return num
    if not d.is_finite():
        return num
    if d == d.to_integral_value():
        # Not quantize(): it raises past the context's 28 digits.
        return format(d.to_integral_value(), "f")
    return format(d.normalize(), "f")


def _math_equal(ref: str, answer: str) -> bool:
    """Plain numbers and fractions compare by value (see `_numbers_equal`); anything
    else goes to math-verify."""
    a, b = _fraction(ref), _fraction(answer)
    if a is not None and b is not None:
        return _numbers_equal(a, b)
    return _verify(ref, answer)


def _numbers_equal(a: Fraction, b: Fraction) -> bool:
    """Exact equality, with one allowance for rounding.

    Integers and decimals are exact values: 1000001 is not 1000000, 1000000.5 is
    not 1000000 and 0.0000001 is not 0, however close. The one allowance is where
    one number is plausibly a rounded form of the other: the more precise one has
    at least 6 decimal places (a float's rendering such as 0.30000000000000004 or
    2.9999999999999996, or a fraction such as 1/3 that no decimal ends), the other
    has fewer, is the first cut to that many places (rounded or truncated: at most
    one unit in its last place away), and they are within a relative 1e-6. So 0.3
    matches 0.30000000000000004, 3 matches 2.9999999999999996 and 0.333333 matches
    1/3, but 0.33 does not match 1/3 and two integers never match unless equal.
    """
    if a == b:
        return True
    if abs(a - b) > _REL_TOL * max(abs(a), abs(b)):  # relative: nothing but 0 is close to 0
        return False
    short, long_ = sorted((_decimal_places(a), _decimal_places(b)))
    return long_ >= _LONG_DECIMAL and short < long_ and abs(a - b) <= Fraction(1, 10**short)


def _decimal_places(x: Fraction) -> int | float:
    """How many decimal places `x` takes written out: inf for 1/3, which never ends."""
    den = x.denominator
    twos = fives = 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    return float("inf") if den != 1 else max(twos, fives)


def _fraction(s: str) -> Fraction | None:
    if not _PLAIN.match(s):
        return None
    num, _, den = s.partition("/")
    try:
        return Fraction(num) / Fraction(den) if den else Fraction(num)
    except (ValueError, ZeroDivisionError):
        return None


def _too_complex(s: str) -> bool:
    """Inputs on which math-verify's parser blows up: long, deeply nested, exponent towers."""
    depth = deepest = 0
    for ch in s:
        depth += 1 if ch in "({[" else -1 if ch in ")}]" else 0
        deepest = max(deepest, depth)
    return len(s) > _MV_MAX_CHARS or deepest > _MV_MAX_DEPTH or s.count("^") > 3


def _verify(ref: str, answer: str) -> bool:
    from math_verify import parse, verify  # imported late: it pulls in sympy (~1 s)

    if _too_complex(ref) or _too_complex(answer):
        return False
    in_main = threading.current_thread() is threading.main_thread()
    t = _MV_TIMEOUT_S if in_main else None
    try:
        gold = parse(f"${ref}$", parsing_timeout=t)
        pred = parse(f"${answer}$", parsing_timeout=t)
        if not gold or not pred:
            return False
        return bool(verify(gold, pred, timeout_seconds=t))
    except Exception:  # math-verify raises for odd inputs despite raise_on_error=False
        return False


# ---------------------------------------------------------------- exact

_PUNCT = re.compile(f"[{re.escape(string.punctuation)}‘’“”–—…]")
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")


def _normalize_text(s: str) -> str:
    s = _strip_markup(s).casefold()
    s = _PUNCT.sub(" ", s)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())
