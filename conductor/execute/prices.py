"""Worker prices: the pool file's, else litellm's cost map. Unknown stays unknown
(None), never a silent $0."""

from __future__ import annotations

import os

from conductor.pool import Price, Worker

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def resolve_price(worker: Worker) -> Price | None:
    if worker.price is not None:
        return worker.price
    if worker.kind == "function":
        return Price(0.0, 0.0)
    if not worker.model:  # a planner worker without a model of its own (the run's planner)
        return None
    import litellm  # imported late: loading its cost map takes a moment

    names = [worker.model]
    if "/" in worker.model:
        names.append(worker.model.split("/", 1)[1])
    for name in names:
        info = litellm.model_cost.get(name)
        if info and info.get("input_cost_per_token") is not None and info.get("output_cost_per_token") is not None:
            return Price(float(info["input_cost_per_token"]), float(info["output_cost_per_token"]))
    return None


def call_cost(price: Price | None, prompt_tokens: int, completion_tokens: int) -> float | None:
    if price is None:
        return None
    return prompt_tokens * price.input + completion_tokens * price.output
