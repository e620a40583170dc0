"""Every prompt an LLM planner sees, in one place, versioned by TEMPLATE_VERSION.

The system prompt (role, numbered worker pool, output format, one example per
task type) depends only on the pool and the settings, never on the query, so
it is the same leading text for every query and an engine's prefix cache
serves it once per batch. The question comes last, in the user turn.

Change any wording here, bump TEMPLATE_VERSION: it is stored with every plan.
"""

from __future__ import annotations

from typing import Sequence

from conductor.planners.base import Query
from conductor.pool import WORKER_KINDS, Pool, Worker

TEMPLATE_VERSION = "planner-prompt-v2"  # v2: conditional steps (cascades)
MODES = ("structured", "free")
DEFAULT_INSTRUCTION_CHARS = 600

ROLE = """\
You are the planner of a team of AI workers. For each question you write a short \
workflow of at most {max_steps} steps. Each step gives one worker an instruction. \
A worker sees only its own instruction and the steps it has access to (their \
instructions and outputs, as earlier turns of its conversation); so the first \
step's instruction must restate the question in full. Steps are numbered from 0. \
The output of the last step is the final answer, so the last step must state it."""

ACCESS = """\
Access says which earlier steps a step sees: a list of earlier step numbers, \
"all" for every earlier step, or an empty list for none. A step can only see \
steps that come before it. Use few steps for easy questions: one step is fine.

A step may have a condition: it runs only if the condition holds, else it is \
skipped at no cost, and the final answer is the output of the last step that \
ran. "disagree" lists earlier steps and holds when their final answers differ; \
"no_majority" holds when no answer has a majority among them. Two cheap workers \
followed by a strong one that runs only when they disagree is a cascade: the \
strong worker is paid for only on the hard questions."""

_FUNCTION_TEXT = {
    "vote": "returns the most common final answer among the steps it sees (no model call)",
    "extract": "extracts the final answer from the steps it sees (no model call)",
}

_ANSWER_LINE = {
    "math": "End with a final line 'Answer: <number>'.",
    "choice": "End with a final line 'Answer: <letter>'.",
    "exact": "End with a final line 'Answer: <answer>'.",
    "literal": "End with a final line 'Answer: <Python literal>'.",
    "code": "Give the complete solution as one ```python code block.",
}

# One example workflow per task type: (question, reasoning, [(role, instruction, access[, when])]).
# Roles are resolved to pool workers by `_cast`, so examples only name real workers.
_EXAMPLES = {
    "math": ("A shop sells pens at 3 dollars each. How much do 14 pens cost?",
             "Two cheap workers solve it; the strong worker runs only if their answers disagree.", [
        ("solver", "A shop sells pens at 3 dollars each. How much do 14 pens cost? "
                   "Solve step by step. " + _ANSWER_LINE["math"], []),
        ("checker", "A shop sells pens at 3 dollars each. How much do 14 pens cost? "
                    "Solve step by step. " + _ANSWER_LINE["math"], []),
        ("expert", "A shop sells pens at 3 dollars each. How much do 14 pens cost? "
                   "Solve step by step. " + _ANSWER_LINE["math"], [], {"disagree": [0, 1]}),
    ]),
    "choice": ("Which planet is largest? A) Mars B) Jupiter C) Venus D) Earth",
               "Three independent answers, then the majority decides.", [
        ("solver", "Which planet is largest? A) Mars B) Jupiter C) Venus D) Earth. "
                   + _ANSWER_LINE["choice"], []),
        ("checker", "Which planet is largest? A) Mars B) Jupiter C) Venus D) Earth. "
                    + _ANSWER_LINE["choice"], []),
        ("solver2", "Which planet is largest? A) Mars B) Jupiter C) Venus D) Earth. "
                    + _ANSWER_LINE["choice"], []),
        ("aggregator", "Pick the answer the solutions above agree on. " + _ANSWER_LINE["choice"], "all"),
    ]),
    "exact": ("What is the capital of Australia?", "A single fact: one worker is enough.", [
        ("solver", "What is the capital of Australia? Answer concisely. " + _ANSWER_LINE["exact"], []),
    ]),
}


def planner_workers(pool: Pool, kinds: Sequence[str] = WORKER_KINDS) -> list[tuple[int, Worker]]:
    """Workers a plan may use, with their 0-based positions in the pool."""
    return [(i, w) for i, w in enumerate(pool.workers) if w.kind in kinds]


def first_step_workers(pool: Pool, kinds: Sequence[str] = WORKER_KINDS) -> list[Worker]:
    """Workers a plan may start with: a function worker (vote, extract) combines earlier steps."""
    return [w for _, w in planner_workers(pool, kinds) if w.kind != "function"]


def system_prompt(pool: Pool, mode: str = "structured", max_steps: int = 5, *,
                  instruction_chars: int = DEFAULT_INSTRUCTION_CHARS,
                  kinds: Sequence[str] = WORKER_KINDS) -> str:
    """The shared part: identical for every query of a batch."""
    _check_mode(mode)
    workers = planner_workers(pool, kinds)
    pool_text = "\n".join(_worker_line(i, w) for i, w in workers)
    parts = [ROLE.format(max_steps=max_steps), "Workers (number. id [kind]: what it does):\n" + pool_text, ACCESS,
             _format_text(mode, instruction_chars)]
    examples = [_example_text(task, workers, mode, max_steps) for task in _EXAMPLES]
    parts.append("Examples:\n\n" + "\n\n".join(e for e in examples if e))
    return "\n\n".join(parts)


def user_prompt(query: Query) -> str:
    """The per-query part: task type and question, last so the prefix stays shared."""
    task = query.task or "general"
    return f"Task type: {task}\nQuestion:\n{query.prompt}\n\nWrite the plan."


def messages(query: Query, pool: Pool, mode: str = "structured", max_steps: int = 5, *,
             instruction_chars: int = DEFAULT_INSTRUCTION_CHARS,
             kinds: Sequence[str] = WORKER_KINDS) -> list[dict[str, str]]:
    """Chat messages for one query (usable by any chat-model planner)."""
    return [{"role": "system", "content": system_prompt(pool, mode, max_steps,
                                                        instruction_chars=instruction_chars, kinds=kinds)},
            {"role": "user", "content": user_prompt(query)}]


def replan_messages(query: Query, prior_steps: Sequence[tuple[str, str]], pool: Pool,
                    mode: str = "structured", max_steps: int = 5, *,
                    instruction_chars: int = DEFAULT_INSTRUCTION_CHARS,
                    kinds: Sequence[str] = WORKER_KINDS) -> list[dict[str, str]]:
    """Messages for planning a sub-workflow after some steps have run.

    prior_steps: (instruction, output) of the steps the sub-planner may see.
    The new steps are numbered from 0 again and do not see that work, so the
    planner must copy what they need into their instructions.
    """
    done = "\n\n".join(f"Step {j} instruction:\n{instr}\nStep {j} output:\n{out}"
                       for j, (instr, out) in enumerate(prior_steps))
    user = (f"Task type: {query.task or 'general'}\nQuestion:\n{query.prompt}\n\n"
            f"Work done so far:\n\n{done or '(none)'}\n\n"
            "Write the plan for the remaining work. Its steps are numbered from 0 and do not "
            "see the work above: put whatever they need from it into their instructions.")
    return [{"role": "system", "content": system_prompt(pool, mode, max_steps,
                                                        instruction_chars=instruction_chars, kinds=kinds)},
            {"role": "user", "content": user}]


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"planner mode must be one of {', '.join(MODES)} (got {mode!r})")


def _worker_line(i: int, w: Worker) -> str:
    text = w.description
    if not text and w.kind == "function":
        text = _FUNCTION_TEXT.get(w.function or w.id, "")
    if not text and w.kind == "planner":
        text = "plans and runs a sub-workflow for its instruction"
    if not text:
        text = f"general model {w.model}" if w.model else "general worker"
    return f"{i}. {w.id} [{w.kind}]: {' '.join(text.split())}"


def _format_text(mode: str, instruction_chars: int) -> str:
    if mode == "structured":
        return ("Output format: one JSON object and nothing else:\n"
                '{"steps": [{"worker": "<worker id>", "instruction": "<text>", "access": [<step numbers>]}]}\n'
                'A step with a condition adds "when": {"disagree": [<step numbers>]} or '
                '"when": {"no_majority": [<step numbers>]}.\n'
                f"Instructions are plain text of at most {instruction_chars} characters, "
                "without double quotes or backslashes.")
    return ("Output format: first think briefly about the question and which workers suit it. "
            "Then write the plan as three Python lists, each on its own line:\n"
            "model_id = [<worker number or id for each step>]\n"
            "subtasks = [<instruction for each step, as a quoted string>]\n"
            "access_list = [<access of each step: a list of step numbers, or [\"all\"]>]\n"
            "Optionally a fourth list: conditions = [<None, or \"disagree(0, 1)\" or \"no_majority(0, 1, 2)\" "
            "for each step>]\n"
            "The lists have one entry per step, in step order.")


def _cast(pool_workers: list[tuple[int, Worker]]) -> dict[str, tuple[int, Worker]]:
    """Map example roles to real pool workers, so every example is a valid plan."""
    llms = [iw for iw in pool_workers if iw[1].kind == "llm"] or pool_workers
    voters = [iw for iw in pool_workers if iw[1].kind == "function" and (iw[1].function or iw[1].id) == "vote"]
    first, second = llms[0], llms[1 % len(llms)]
    third = llms[2 % len(llms)]
    expert = _dearest(llms)
    return {"solver": first, "checker": second, "solver2": third, "expert": expert,
            "aggregator": voters[0] if voters else first}


def _dearest(llms: list[tuple[int, Worker]]) -> tuple[int, Worker]:
    """The strong worker of a cascade: the dearest, priced as planning prices them (the pool's price,
    else litellm's cost map; one of no known price counts as the dearest known, and a known one wins
    the tie); the last listed when none has a known price. The map's prices counted as none before."""
    from conductor.execute.prices import resolve_price
    from conductor.policy.actions import planning_prices

    known = {w.id for _, w in llms if resolve_price(w) is not None}
    if not known:
        return llms[-1]
    price = planning_prices(w for _, w in llms)
    return max(llms, key=lambda iw: (price[iw[1].id].input + price[iw[1].id].output, iw[1].id in known))


def _example_text(task: str, workers: list[tuple[int, Worker]], mode: str, max_steps: int) -> str:
    if not workers:
        return ""
    question, why, steps = _EXAMPLES[task]
    steps = [(s[0], s[1], s[2], s[3] if len(s) > 3 else None) for s in steps]
    if len(steps) > max_steps:
        if any(w for *_, w in steps):  # a cascade cut short is no cascade: its first step alone
            steps = [(r, i, a, None) for r, i, a, _ in steps[:1]]
        else:  # keep the first steps and the deciding last one
            steps = steps[:max_steps - 1] + steps[-1:] if max_steps > 1 else steps[:1]
    cast = _cast(workers)
    head = f"Task type: {task}\nQuestion:\n{question}\nPlan:\n"
    if mode == "structured":
        body = ", ".join(
            '{"worker": "%s", "instruction": "%s", "access": %s%s}'
            % (cast[role][1].id, instr, '["all"]' if acc == "all" else str(list(acc)),
               "" if when is None else ', "when": {"%s": %s}' % next(iter(when.items())))
            for role, instr, acc, when in steps)
        return head + '{"steps": [' + body + "]}"
    ids = ", ".join(str(cast[role][0]) for role, _, _, _ in steps)
    subtasks = ", ".join(_py_str(instr) for _, instr, _, _ in steps)
    access = ", ".join('["all"]' if acc == "all" else str(list(acc)) for _, _, acc, _ in steps)
    text = head + why + "\n" + f"model_id = [{ids}]\nsubtasks = [{subtasks}]\naccess_list = [{access}]"
    if any(when for *_, when in steps):
        conds = ", ".join("None" if when is None else f'"{_call(when)}"' for *_, when in steps)
        text += f"\nconditions = [{conds}]"
    return text


def _call(when: dict[str, list[int]]) -> str:
    kind, steps = next(iter(when.items()))
    return f"{kind}({', '.join(map(str, steps))})"


def _py_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
