"""The simulated worker's reply: right with probability skill[task], else a
plausible wrong answer, as a short worked answer ending "Answer: <answer>".

Everything here is a pure function of (seed, model, request hash), so a
repeated request gets the same reply and resumed runs reproduce exactly.
"""

from __future__ import annotations

import hashlib
import random
import re

from conductor.sim.index import Known, QueryIndex

UNKNOWN = "unknown"
_NUMBER = re.compile(r"-?\d(?:[\d,]*\d)?(?:\.\d+)?")
_LETTER = re.compile(r"[A-Z]")

_OPENERS = {
    "math": ("Let me work through this step by step.",
             "I will set up the quantities and compute carefully.",
             "Breaking the problem into parts and solving each in turn."),
    "choice": ("Let me consider each option in turn.",
               "Weighing the options against what the question asks.",
               "Eliminating the options that do not fit."),
    "exact": ("Recalling the relevant fact.",
              "Let me think about what is being asked.",
              "Answering directly."),
}
_MIDDLES = {
    "math": "Combining the intermediate results gives {a}.",
    "choice": "Option {a} is the best supported by the reasoning above.",
    "exact": "The answer is {a}.",
}


def draw(seed: int, model: str, request_hash: str) -> random.Random:
    digest = hashlib.sha256(f"{seed}\x00{model}\x00{request_hash}".encode()).digest()
    return random.Random(int.from_bytes(digest, "big"))


def reply(known: Known | None, skill: float, rng: random.Random, index: QueryIndex) -> tuple[str, bool | None]:
    """(text, correct); correct is None when the sim cannot judge (unknown question
    or no reference)."""
    if known is None:
        return ("I could not identify this question among the ones I know, so I cannot "
                f"answer it.\nAnswer: {UNKNOWN}"), None
    task = known.task if known.task in _OPENERS else "exact"
    if known.reference is None:
        return f"{_OPENERS[task][0]}\nI have no reliable answer to this.\nAnswer: {UNKNOWN}", None
    correct = rng.random() < skill
    if correct:
        answer = _letter(known.reference) if task == "choice" else known.reference
    else:
        answer = wrong_answer(known, task, rng, index)
    opener = rng.choice(_OPENERS[task])
    return f"{opener}\n{_MIDDLES[task].format(a=answer)}\nAnswer: {answer}", correct


def wrong_answer(known: Known, task: str, rng: random.Random, index: QueryIndex) -> str:
    ref = known.reference or ""
    if task == "choice":
        right = _letter(ref)
        letters = list(known.options) if len(known.options) >= 2 else list("ABCD")
        if right not in letters:
            letters.append(right)
        return rng.choice([x for x in letters if x != right])
    if task == "math":
        return perturb_number(ref, rng)
    others = index.refs_by_task.get(known.task) or []
    if len(others) > 1:
        for _ in range(8):
            pick = rng.choice(others)
            if pick.strip().lower() != ref.strip().lower():
                return pick
    return perturb_number(ref, rng) if _NUMBER.search(ref) else f"not {ref}"


def perturb_number(ref: str, rng: random.Random) -> str:
    """A different number in the same format: the last number in `ref` (the
    numerator of a fraction) changed by a slip of a few units or a factor,
    keeping its sign, decimals and thousands separators."""
    matches = list(_NUMBER.finditer(ref))
    if not matches:
        return f"{ref} + 1" if ref else "1"
    m = matches[0] if ("/" in ref or "frac" in ref) else matches[-1]
    s = m.group()
    decimals = len(s.split(".")[1]) if "." in s else 0
    value = float(s.replace(",", ""))
    unit = 10.0 ** -decimals
    step = rng.choice((1, 2, 3, 5, 10)) * rng.choice((-1, 1))
    if rng.random() < 0.25 and value != 0:
        new = value * rng.choice((2, 0.5, 10))
        new = round(new / unit) * unit
    else:
        new = value + step * unit
    if (value >= 0) != (new >= 0) or round(new, decimals) in (round(value, decimals), 0):
        new = value + abs(step) * unit if value >= 0 else value - abs(step) * unit
    text = f"{new:,.{decimals}f}" if "," in s else f"{new:.{decimals}f}"
    return ref[:m.start()] + text + ref[m.end():]


def _letter(ref: str) -> str:
    m = _LETTER.search(ref.upper())
    return m.group() if m else ref
