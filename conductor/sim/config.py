"""What the simulated server serves, read from a pool file's `simulate:` blocks.

Every llm or planner worker whose model is `openai/<name>` is served as model
`<name>`. Per worker, `simulate` may hold:

    role:            "worker" (default): answers questions; "planner": answers
                     planning prompts with a plan (see conductor/sim/planner.py)
    replan_rate:     planner role: chance that a step after the first hands the
                     rest to a planner worker, when the prompt offers one (default 0)
    cascade_rate:    planner role: chance that a plan is a cascade (two workers
                     solve, a third runs only when they disagree), when the
                     pool has two llm workers and plans may have 3 steps (default 0.25)

    skill:           {math|choice|exact|record|default: probability of a correct answer;
                     for a record, of each field that has a reference}
                     (or one number for every task); default: the worker's
                     `skills`, else 0.5
    latency_ms:      {mean, sd, per_token_ms} or one number (the mean)
    per_token_ms:    extra latency per completion token (also allowed in latency_ms)
    rpm:             requests per minute, sliding window per model; above it 429
    rpm_window_s:    the window's length (default 60; shorter only for tests)
    error_rate:      fraction answered 500/502/503
    rate_limit_rate: fraction answered 429 with Retry-After (retry_after_ms, default 1000)
    retry_after_ms:  the wait those random 429s ask for
    hang_rate, hang_s: fraction that sleep hang_s seconds before answering
    drop_rate:       fraction whose connection is closed without a response
    require_key_env: NAME of an env var holding the key the server demands
    fail_status:     answer every request with this HTTP error status (400-599),
                     to test how clients treat statuses the other faults don't make
    refusal_rate:    fraction of requests answered 200 with `content: null` and a
                     `refusal`, as a safety refusal or a content filter answers; billed
                     like any answer, and decided per request, so a repeat refuses again
    malformed_json:  fraction of structured (JSON record) replies that are broken,
                     half so they do not parse, half so they break the schema;
                     decided per request, so a repeated request breaks the same way
    usage_factor:    the reported `usage` is the billed tokens times this (default 1);
                     negative or huge values test clients against usage lies. What is
                     billed (the request log's `billed_tokens`) never changes

    Batch API (OpenAI's /v1/files and /v1/batches, see conductor/sim/batch.py):
    batch_delay_s:   seconds from submission until a batch is done (default 0: done at
                     the first poll); a batch of several models takes the longest delay
    batch_expire:    fraction of a batch's lines left undone when it ends, and then it
                     ends "expired" (default 0: batches complete); likewise the largest
    batch_line_error_rate: fraction of batch lines answered 500 in the error file,
                     drawn per batch and line, so a resubmitted line gets a new draw
    batch_fail_rate: fraction of batches that fail validation: status "failed" with
                     `errors`, no line done (as OpenAI fails a batch it cannot start)

Fault values can be overridden for all models ("*") or one model, at start
and at run time; a model's override beats "*", which beats the pool.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from typing import Any

from conductor.errors import ConductorError
from conductor.pool import Pool

SKILL_TASKS = ("math", "choice", "exact", "record", "default")
DEFAULT_SKILL = 0.5
RATE_KEYS = ("error_rate", "rate_limit_rate", "hang_rate", "drop_rate", "refusal_rate", "malformed_json",
             "batch_expire", "batch_line_error_rate", "batch_fail_rate")
# Flat fault names, as used by overrides (CLI flags, start_sim kwargs, /admin/faults).
FAULT_KEYS = ("rpm", "rpm_window_s", *RATE_KEYS, "hang_s", "latency_ms", "latency_sd_ms", "per_token_ms",
              "fail_status", "retry_after_ms", "usage_factor", "batch_delay_s")
FAULT_DEFAULTS: dict[str, float | None] = {
    "rpm": None, "rpm_window_s": 60.0, "error_rate": 0.0, "rate_limit_rate": 0.0,
    "hang_rate": 0.0, "drop_rate": 0.0, "hang_s": 30.0,
    "latency_ms": 20.0, "latency_sd_ms": 5.0, "per_token_ms": 0.0, "fail_status": None,
    "retry_after_ms": 1000.0, "refusal_rate": 0.0, "malformed_json": 0.0, "usage_factor": 1.0,
    "batch_expire": 0.0, "batch_line_error_rate": 0.0, "batch_delay_s": 0.0,
    "batch_fail_rate": 0.0,
}
ROLES = ("worker", "planner")
SIMULATE_KEYS = ("role", "replan_rate", "cascade_rate", "skill", "latency_ms", "per_token_ms", "rpm",
                 "rpm_window_s", *RATE_KEYS,
                 "hang_s", "require_key_env", "fail_status", "retry_after_ms", "usage_factor", "batch_delay_s")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


class SimConfigError(ConductorError):
    """A `simulate:` block or a fault override that cannot be used."""


@dataclass(frozen=True)
class Faults:
    rpm: float | None
    rpm_window_s: float
    error_rate: float
    rate_limit_rate: float
    hang_rate: float
    drop_rate: float
    hang_s: float
    latency_ms: float
    latency_sd_ms: float
    per_token_ms: float
    fail_status: float | None
    retry_after_ms: float
    refusal_rate: float
    malformed_json: float
    usage_factor: float
    batch_expire: float
    batch_line_error_rate: float
    batch_fail_rate: float
    batch_delay_s: float


@dataclass(frozen=True)
class ModelSpec:
    """One served model. `faults` holds only what the pool set (flat names)."""

    name: str
    worker_id: str
    skill: dict[str, float]
    faults: dict[str, float | None]
    require_key_env: str | None = None
    role: str = "worker"
    replan_rate: float = 0.0
    cascade_rate: float = 0.25

    def skill_for(self, task: str | None) -> float:
        if task is not None and task in self.skill:
            return self.skill[task]
        return self.skill.get("default", DEFAULT_SKILL)


def served_models(pool: Pool) -> dict[str, ModelSpec]:
    """The models the server answers for, keyed by served name."""
    specs: dict[str, ModelSpec] = {}
    for w in pool.workers:
        if w.kind not in ("llm", "planner") or not w.model or not w.model.startswith("openai/"):
            continue
        spec = _spec(w)
        prior = specs.get(spec.name)
        if prior is not None and prior != replace(spec, worker_id=prior.worker_id):  # settings differ
            raise SimConfigError(
                f"workers {prior.worker_id} and {w.id} both use model {w.model!r} with different "
                f"simulate settings; give them distinct model names")
        specs.setdefault(spec.name, spec)
    if not specs:
        raise SimConfigError("the pool has no llm or planner worker with an 'openai/<name>' model to simulate")
    return specs


def _spec(w) -> ModelSpec:
    at = f"worker {w.id}: simulate"
    sim = w.simulate or {}
    unknown = sorted(set(map(str, sim)) - set(SIMULATE_KEYS))
    if unknown:
        raise SimConfigError(f"{at}.{unknown[0]}: unknown field (allowed: {', '.join(SIMULATE_KEYS)})")
    name = w.model.split("/", 1)[1]
    if not name:
        raise SimConfigError(f"worker {w.id}: model {w.model!r} has no name after 'openai/'")
    if "skill" in sim:
        skill = _skill(sim["skill"], f"{at}.skill")
    else:
        skill = {t: float(v) for t, v in w.skills.items() if v is not None}
    faults: dict[str, float | None] = {}
    role = sim.get("role", "worker")
    if role not in ROLES:
        raise SimConfigError(f"{at}.role: must be one of {', '.join(ROLES)} (got {role!r})")
    rates = {}
    for key, default in (("replan_rate", 0.0), ("cascade_rate", 0.25)):
        rates[key] = sim.get(key, default)
        if not _is_num(rates[key]) or not 0 <= rates[key] <= 1:
            raise SimConfigError(f"{at}.{key}: must be a fraction in [0, 1] (got {rates[key]!r})")
    for key in sim:
        if key in ("skill", "require_key_env", "latency_ms", "role", "replan_rate", "cascade_rate"):
            continue
        faults[key] = check_fault(key, sim[key], f"{at}.{key}")
    if "latency_ms" in sim:
        lat = sim["latency_ms"]
        if isinstance(lat, dict):
            bad = sorted(set(map(str, lat)) - {"mean", "sd", "per_token_ms"})
            if bad:
                raise SimConfigError(f"{at}.latency_ms.{bad[0]}: unknown field (allowed: mean, sd, per_token_ms)")
            for src, dst in (("mean", "latency_ms"), ("sd", "latency_sd_ms"), ("per_token_ms", "per_token_ms")):
                if src in lat:
                    faults[dst] = check_fault(dst, lat[src], f"{at}.latency_ms.{src}")
        else:
            faults["latency_ms"] = check_fault("latency_ms", lat, f"{at}.latency_ms")
    key_env = sim.get("require_key_env")
    if key_env is not None and (not isinstance(key_env, str) or not _ENV_NAME.match(key_env)):
        raise SimConfigError(f"{at}.require_key_env: must be the NAME of an environment variable")
    return ModelSpec(name=name, worker_id=w.id, skill=skill, faults=faults, require_key_env=key_env,
                     role=role, replan_rate=float(rates["replan_rate"]),
                     cascade_rate=float(rates["cascade_rate"]))


def _skill(raw: Any, at: str) -> dict[str, float]:
    if _is_num(raw):
        raw = {"default": raw}
    if not isinstance(raw, dict):
        raise SimConfigError(f"{at}: must be a number or a mapping of task ({', '.join(SKILL_TASKS)}) to probability")
    out = {}
    for task, p in raw.items():
        if task not in SKILL_TASKS:
            raise SimConfigError(f"{at}.{task}: unknown task (allowed: {', '.join(SKILL_TASKS)})")
        if not _is_num(p) or not 0 <= p <= 1:
            raise SimConfigError(f"{at}.{task}: must be a probability in [0, 1] (got {p!r})")
        out[task] = float(p)
    return out


def check_fault(key: str, value: Any, at: str) -> float | None:
    """Validate one flat fault value; None means 'not set here'."""
    if key not in FAULT_KEYS:
        raise SimConfigError(f"{at}: unknown fault (allowed: {', '.join(FAULT_KEYS)})")
    if value is None:
        return None
    if not _is_num(value) or not math.isfinite(value):
        raise SimConfigError(f"{at}: must be a number (got {value!r})")
    given, value = value, float(value)  # `given` as written: 200, not 200.0
    if key in RATE_KEYS and not 0 <= value <= 1:
        raise SimConfigError(f"{at}: must be a fraction in [0, 1] (got {given!r})")
    if key == "fail_status" and (value != int(value) or not 400 <= value <= 599):
        raise SimConfigError(f"{at}: must be an HTTP error status from 400 to 599 (got {given!r})")
    if key in ("rpm", "rpm_window_s") and value <= 0:
        raise SimConfigError(f"{at}: must be greater than 0 (got {given!r})")
    if value < 0 and key != "usage_factor":
        raise SimConfigError(f"{at}: must be at least 0 (got {given!r})")
    return value


def check_overrides(raw: dict[str, Any], at: str) -> dict[str, float | None]:
    return {k: check_fault(k, v, f"{at}.{k}") for k, v in raw.items()}


def effective_faults(spec: ModelSpec, overrides: dict[str, dict[str, float | None]]) -> Faults:
    """Defaults < pool < "*" override < per-model override."""
    merged: dict[str, float | None] = dict(FAULT_DEFAULTS)
    for layer in (spec.faults, overrides.get("*", {}), overrides.get(spec.name, {})):
        merged.update(layer)
    return Faults(**merged)  # type: ignore[arg-type]


def read_keys(specs: dict[str, ModelSpec], default_env: str | None,
              environ: dict[str, str] | None = None) -> dict[str, str]:
    """Expected API key per model, read once at start. Errors name the variable, never a value."""
    environ = os.environ if environ is None else environ
    keys = {}
    for name, spec in specs.items():
        env = spec.require_key_env or default_env
        if env is None:
            continue
        value = environ.get(env)
        if not value:
            raise SimConfigError(
                f"model {name} (worker {spec.worker_id}) requires a key from environment variable "
                f"{env}, which is not set")
        keys[name] = value
    return keys


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
