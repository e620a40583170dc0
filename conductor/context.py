"""What a step's worker sees: its access list turned into prior conversation turns."""

from __future__ import annotations

from typing import Sequence

from conductor.plans import Step


def step_messages(step: Step, steps: Sequence[Step], outputs: dict[int, str],
                  system: str | None = None) -> list[dict[str, str]]:
    """Messages for `step`: each granted earlier step as a user turn (its
    instruction) and an assistant turn (its output), in step order, then the
    step's own instruction."""
    messages: list[dict[str, str]] = []
    if system:
        messages.append({"role": "system", "content": system})
    for j in step.access:
        if j not in outputs:
            continue  # skipped by its condition: there is nothing to see
        messages.append({"role": "user", "content": steps[j].instruction})
        messages.append({"role": "assistant", "content": outputs[j]})
    messages.append({"role": "user", "content": step.instruction})
    return messages
