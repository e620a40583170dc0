"""Run ids: a digest of what decides a run's results, so that the same command resumes the same
run and another input starts a new one. What the digest covers changed over versions; a run
begun by an earlier one resumes under the id it was given (`earlier_digests`)."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import orjson

RUN_ID_RULE = "use up to 128 letters, digits, '-', '_' and '.', not starting with '.'"


def valid_run_id(s: str) -> bool:
    return bool(s) and len(s) <= 128 and all(c.isalnum() or c in "-_." for c in s) and not s.startswith(".")


def run_id_stem(stem: str) -> str:
    """The query file's name as the start of a default run id: unchanged when it is a valid id
    (runs on disk resume under the same id); else other characters become '_'. `my q (v2)`
    was refused, blaming a --run-id the user never gave."""
    if valid_run_id(f"{stem}-{'0' * 10}"):
        return stem
    cleaned = re.sub(r"_{2,}", "_", "".join(c if c.isalnum() or c in "-_." else "_" for c in stem))
    return cleaned.lstrip("._")[:128 - 11].rstrip("_") or "queries"


def digest(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(fingerprint, option=orjson.OPT_SORT_KEYS, default=str)).hexdigest()


def options_outside_run_id(planner: str) -> tuple[str, ...]:
    """The planner options that never change a plan (the LLM planner's api_key_env, the vLLM
    engine's memory and parallelism): the fix a failed start or a rejected key asks for must
    resume the run, not start a new one that plans again."""
    if planner == "llm":
        from conductor.planners.llm import OUTSIDE_RUN_ID

        return OUTSIDE_RUN_ID
    if planner == "vllm":
        from conductor.planners.vllm import ENGINE_ONLY

        return ENGINE_ONLY
    return ()


def id_options(planner: str, options: dict[str, Any]) -> dict[str, Any]:
    """The planner options the run id covers."""
    outside = options_outside_run_id(planner)
    return {k: v for k, v in options.items() if k not in outside}


def earlier_digests(fingerprint: dict[str, Any], options: dict[str, Any]) -> list[str]:
    """The digests earlier versions made of the same inputs, newest first: with every planner
    option (`options`, before stop 42 left out those that never change a plan), and without
    `pool_planning` (before skills, descriptions and prices were part of the id)."""
    whole = {**fingerprint, "planner_options": options}
    found = [whole] + [{k: v for k, v in f.items() if k != "pool_planning"} for f in (whole, fingerprint)]
    now = digest(fingerprint)
    return [d for d in dict.fromkeys(map(digest, found)) if d != now]


def with_recorded_outside_options(planner: str, options: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    """This command's planner options with the run's own values of those outside the id, as its
    manifest shows them: a run named by --run-id, begun by an earlier version with another
    api_key_env, resumes as one begun by this version does."""
    outside = options_outside_run_id(planner)
    recorded = (manifest.get("inputs") or {}).get("planner_options") or {}
    return {**id_options(planner, options), **{k: v for k, v in recorded.items() if k in outside}}


# What the fingerprint's keys are, for the run-exists refusal: "samples: 1 → 2", "queries file differs".
_FINGERPRINT_NAMES = {
    "queries_sha256": "the queries file's content differs",
    "pool_identity": "the pool's workers differ (models, endpoints, params, system prompts or functions)",
    "pool_planning": "the pool's descriptions, skills or prices differ",
    "planner_options": "the planner options differ",
}


def fingerprint_changes(before: dict[str, Any], now: dict[str, Any], planner: str, options: dict[str, Any]) -> str:
    """What differs between a run's recorded inputs (its manifest's `inputs`) and this command's."""
    changes = []
    outside = options_outside_run_id(planner)
    before = {**before, "planner_options": {k: v for k, v in (before.get("planner_options") or {}).items()
                                            if k not in outside}} if "planner_options" in before else before
    for key, value in now.items():
        if key == "planner_options":
            value = shown_options(id_options(planner, options))  # as the manifest keeps them
        if key not in before:
            if key != "pool_planning":  # a run older than that key, whose other inputs differ
                changes.append(f"{key} not recorded by that run")
        elif before[key] != value:
            changes.append(_FINGERPRINT_NAMES.get(key) or f"{key}: {before[key]} → {value}")
    if not changes and "planner_options" in before:
        changes.append(_FINGERPRINT_NAMES["planner_options"])  # a masked value (a key in a URL) changed
    return "; ".join(changes) or "its manifest records no inputs to compare"


def shown_options(options: dict[str, Any]) -> dict[str, Any]:
    """Planner options as the manifest keeps them, never a key: a password or token typed into a URL
    (`api_base=https://user:TOKEN@host`, `?api_key=`) is masked, as everywhere else, a value that
    looks like a key is not kept, and api_key_env only as a variable's NAME."""
    return {k: _shown_option(k, v) for k, v in options.items()}


NOT_KEPT = "(not kept: it looks like a key)"
NOT_A_NAME = "(not kept: not the name of an environment variable)"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _shown_option(name: Any, value: Any) -> Any:
    from conductor.masking import looks_like_a_key, mask
    from conductor.pool import redact_url

    if name == "api_key_env":
        named = isinstance(value, str) and ENV_NAME.fullmatch(value) and not looks_like_a_key(value)
        return value if named else NOT_A_NAME
    if isinstance(value, dict):
        return {k: _shown_option(k, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shown_option(name, v) for v in value]
    if not isinstance(value, str):
        return value
    if "://" in value:
        return mask(redact_url(value))
    return NOT_KEPT if _pasted_key(value) else mask(value)


def _pasted_key(value: str) -> bool:
    """A key given as an option's value: one token that masking.looks_like_a_key flags, with a
    long run of letters and digits; model names (`claude-3-5-sonnet-20241022`) have short parts."""
    from conductor.masking import looks_like_a_key

    parts = re.split(r"[-_]", value)
    return (re.fullmatch(r"[A-Za-z0-9_-]+", value) is not None and looks_like_a_key(value)
            and any(len(p) >= 16 and re.search(r"\d", p) and re.search(r"[A-Za-z]", p) for p in parts))
