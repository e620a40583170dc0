"""Direct mode: no planner; each row is one step on the job's named worker with the
rendered prompt as its instruction, sent verbatim as the user message."""

from __future__ import annotations

from typing import Sequence

import orjson

from conductor.planners.base import PlanDraft, Query
from conductor.pool import Pool


class DirectPlanner:
    name = "direct"

    def __init__(self, worker: str):
        self.worker = worker

    def plan(self, queries: Sequence[Query], pool: Pool, samples: int) -> list[list[PlanDraft]]:
        out = []
        for q in queries:
            text = orjson.dumps({"steps": [{"worker": self.worker, "instruction": q.prompt, "access": []}]}).decode()
            out.append([PlanDraft(text, template_version="direct") for _ in range(samples)])
        return out
