"""Local function workers: deterministic steps that call no model and cost nothing.

vote     the majority final answer among the outputs the step's access grants;
         a tie goes to the tied answer given by the earliest step.
extract  the final answer of the one output the step's access grants.

Both end on the answer written so that the task's grader reads it back as the worker's
answer (see `written`): mostly a final line "Answer: <answer>", the form every grader
reads first, but code in a fenced block and an answer of several lines in a block or
a JSON "answer" field. An `exact` reply of several lines with no answer marker, which
the grader reads both by its last line and whole, is passed on as it is (`reads_whole`).
In a cascade some granted steps may have been skipped by their conditions: their
outputs are None (or absent) and both functions ignore them, so a vote counts
only the steps that ran and extract reads the one granted step that ran.
"""

from __future__ import annotations

import json
import re

from conductor.grading import answers_agree, extract_answer, reads_whole
from conductor.plans import Step


def run_function(name: str, step: Step, outputs: list[str | None], task: str | None) -> str:
    outputs = [o for o in outputs if o is not None]  # skipped steps have no output
    if name == "vote":
        return vote(outputs, task)
    if name == "extract":
        return extract(outputs, task)
    raise ValueError(f"unknown function {name!r}")


def vote(outputs: list[str], task: str | None) -> str:
    read = [(o, a) for o in outputs if (a := extract_answer(o, task)) is not None]
    if not outputs:
        raise ValueError("none of the granted steps ran: nothing to vote on")
    if not read:
        raise ValueError(f"none of the {len(outputs)} granted output(s) holds an answer to vote on")
    groups: list[list[tuple[str, str]]] = []  # (output, answer)s that agree, in order of first appearance
    for o, a in read:
        for g in groups:
            # compared as written: answers_agree reads the answer out again, and a literal of several
            # lines, given bare, would be read as its last line
            if answers_agree(task, written(g[0][1], task), written(a, task)):
                g.append((o, a))
                break
        else:
            groups.append([(o, a)])
    best = max(groups, key=len)  # max keeps the first of equals: the earliest step wins a tie
    if reads_whole(best[0][0], task):
        return best[0][0]  # graded as its worker's own reply: no room for the tally
    # On one line, and programs by number only: the code grader would run a program outside a fence.
    tally = ", ".join(f"{f'program {k + 1}' if task == 'code' else _one_line(g[0][1])} x{len(g)}"
                      for k, g in enumerate(groups))
    answer = written(best[0][1], task)
    if task == "code" and not answer.startswith(("```", "~~~")):
        return answer  # unfenced code is the whole text: no room for the tally
    return f"Votes over {len(outputs)} output(s): {tally}\n{answer}"


def extract(outputs: list[str], task: str | None) -> str:
    if len(outputs) != 1:
        raise ValueError(f"extract needs access to exactly one earlier step that ran (got {len(outputs)})")
    answer = extract_answer(outputs[0], task)
    if answer is None:
        raise ValueError("no final answer found in the granted output")
    return outputs[0] if reads_whole(outputs[0], task) else written(answer, task)


def written(answer: str, task: str | None) -> str:
    """`answer` (as `extract_answer` gives it) in a form from which the task's grader reads it back as
    it is (audit59 F3): an "Answer:" line holds one line, so a program goes in a fenced block (the code
    grader runs fenced code, not an "Answer:" line), a literal of several lines in a fenced block after
    "Answer:", and any other answer of several lines in a JSON "answer" field, its line breaks kept."""
    if task == "code":
        fence = next((f for f in ("```", "~~~") if f not in answer), None)
        return f"{fence}python\n{answer}\n{fence}" if fence else answer  # unfenced: the whole text is the code
    if "\n" not in answer:
        return f"Answer: {answer}"
    if task == "literal" and "```" not in answer:
        return f"Answer:\n```\n{answer}\n```"
    return json.dumps({"answer": answer})


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text)
