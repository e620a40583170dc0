"""Local function workers: deterministic steps that call no model and cost nothing.

vote     the majority final answer among the outputs the step's access grants;
         a tie goes to the tied answer given by the earliest step.
extract  the final answer of the one output the step's access grants.

Both write a final line "Answer: <answer>", the form every grader reads first.
In a cascade some granted steps may have been skipped by their conditions: their
outputs are None (or absent) and both functions ignore them, so a vote counts
only the steps that ran and extract reads the one granted step that ran.
"""

from __future__ import annotations

from conductor.grading import answers_agree, extract_answer
from conductor.plans import Step


def run_function(name: str, step: Step, outputs: list[str | None], task: str | None) -> str:
    outputs = [o for o in outputs if o is not None]  # skipped steps have no output
    if name == "vote":
        return vote(outputs, task)
    if name == "extract":
        return extract(outputs, task)
    raise ValueError(f"unknown function {name!r}")


def vote(outputs: list[str], task: str | None) -> str:
    answers = [a for a in (extract_answer(o, task) for o in outputs) if a is not None]
    if not outputs:
        raise ValueError("none of the granted steps ran: nothing to vote on")
    if not answers:
        raise ValueError(f"none of the {len(outputs)} granted output(s) holds an answer to vote on")
    groups: list[list[str]] = []  # answers that agree, in order of first appearance
    for a in answers:
        for g in groups:
            if answers_agree(task, g[0], a):
                g.append(a)
                break
        else:
            groups.append([a])
    best = max(groups, key=len)  # max keeps the first of equals: the earliest step wins a tie
    tally = ", ".join(f"{g[0]} x{len(g)}" for g in groups)
    return f"Votes over {len(outputs)} output(s): {tally}\nAnswer: {best[0]}"


def extract(outputs: list[str], task: str | None) -> str:
    if len(outputs) != 1:
        raise ValueError(f"extract needs access to exactly one earlier step that ran (got {len(outputs)})")
    answer = extract_answer(outputs[0], task)
    if answer is None:
        raise ValueError("no final answer found in the granted output")
    return f"Answer: {answer}"
