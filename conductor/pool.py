"""The worker pool: which LLMs exist, how to reach them, what they cost, and the
limits of the providers that serve them. Loaded from one YAML file.

API keys are named by environment variable only (`api_key_env`); the value is
read at call time and never stored in a `Pool`.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import orjson

from conductor.errors import PoolError
from conductor.masking import SECRET_NAME, looks_like_a_key, mask
from conductor import yamlkeys

WORKER_KINDS = ("llm", "function", "planner")
GOVERNOR_SCHEMES = ("memory", "redis", "rediss")  # where limits and budgets are held (conductor.execute.shared)
FUNCTION_NAMES = ("vote", "extract")
DEFAULT_MAX_TOKENS = 1024  # a call's completion cap when its worker's params set none
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]*")  # fullmatch: "$" would let a final newline in
POOL_VERSION = 1  # the `version:` a pool file may give
_ENV_START = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-|\})")  # `${NAME}`, or the start of `${NAME:-default}`


@dataclass(frozen=True)
class Provider:
    """A rate-limit and budget domain shared by every worker it serves."""

    id: str
    rpm: float | None = None
    tpm: float | None = None
    max_concurrency: int = 16
    budget_usd: float | None = None
    timeout_s: float = 120.0
    max_attempts: int = 6
    api_key_env: str | None = None
    # mode "batch": calls go through the provider's batch API (conductor.execute.batch)
    mode: str = "online"
    batch_poll_s: float = 30.0  # seconds between status checks of a submitted batch
    batch_collect_s: float = 1.0  # a batch is submitted once no new request joined it for this long
    batch_max_wait_s: float = 86400.0  # then the batch is cancelled and its undone requests retried
    batch_completion_window: str = "24h"
    batch_price_factor: float = 0.5  # batch price = online price x this (OpenAI's and Anthropic's: half)
    batch_retry: str = "online"  # failed or expired lines: retried online or in a new batch
    batch_max_requests: int = 50_000  # OpenAI's limit per input file
    # under a budget, a line left out of this many of its worker's batches (no room for its
    # worst case) is refused as budget_exhausted: near the cap, each round is a whole batch's wait
    batch_budget_rounds: int = 8
    # Where a user names this provider's key, for the message of a call sent without one; not a pool
    # file setting: the LLM planner's own provider is set on the command line
    key_hint: str | None = field(default=None, compare=False)

    def where_to_set_key(self) -> str:
        return self.key_hint or f"set api_key_env for provider {self.id} in the pool file"


PROVIDER_MODES = ("online", "batch")
BATCH_RETRY = ("online", "batch")


@dataclass(frozen=True)
class Price:
    """USD per token."""

    input: float
    output: float


@dataclass(frozen=True)
class Worker:
    id: str
    provider: str
    kind: str = "llm"
    model: str | None = None
    api_base: str | None = None
    description: str = ""
    skills: dict[str, float | None] = field(default_factory=dict)
    price: Price | None = None
    params: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    function: str | None = None
    simulate: dict[str, Any] | None = None
    context_tokens: int | None = None  # the model's context window, when litellm does not know it
    # The most one call can be charged when tokens x price cannot bound it: a replay worker's
    # largest recorded cost_usd, which is charged as recorded. Budgets reserve at least this.
    max_call_usd: float | None = None
    # api_base for messages: expanded, but a `${VAR}` holding the provider's key or named like a
    # secret (some gateways take the key in the URL) stays a name, whatever the variable is called
    api_base_shown: str | None = field(default=None, compare=False, repr=False)

    def max_tokens(self) -> int:
        """The completion cap of its calls: the executor counts no more completion tokens."""
        cap = self.params.get("max_tokens")
        return cap if isinstance(cap, int) and not isinstance(cap, bool) else DEFAULT_MAX_TOKENS

    def skill(self, task: str | None) -> float | None:
        """Expected accuracy on a task tag, None when the pool does not say."""
        if task is not None and task in self.skills:
            return self.skills[task]
        return self.skills.get("default")


@dataclass(frozen=True)
class Pool:
    workers: tuple[Worker, ...]
    providers: dict[str, Provider]
    path: str | None = None
    replay: dict[str, Any] | None = None  # set when the workers are served from recorded responses
    # Where limits and budgets are held: None/memory:// in this process, redis://... shared
    # by every process using it (conductor.execute.shared); CONDUCTOR_GOVERNOR overrides it.
    governor: str | None = None
    # For a replay pool: question text -> ids of the workers with a recorded response to it.
    # Never read from the file: the runner fills it (conductor.runner.planning_pool), so planners
    # and the policy plan only what the replay server can answer without importing replay.
    recorded: dict[str, frozenset[str]] | None = field(default=None, compare=False, repr=False)
    # The providers the file lists under providers: (the others were made for workers without a
    # provider, in a file without that section): what a worker added later must name (unlisted)
    listed: tuple[str, ...] = field(default=(), compare=False, repr=False)  # in file order, for messages

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {w.id: w for w in self.workers})

    def worker(self, worker_id: str) -> Worker:
        return self._by_id[worker_id]  # type: ignore[attr-defined]

    def has(self, worker_id: str) -> bool:
        return worker_id in self._by_id  # type: ignore[attr-defined]

    def servable_questions(self) -> dict[str, frozenset[str]] | None:
        """None for a live pool (any worker answers anything); for a replay pool, `recorded`."""
        if self.replay is None:
            return None
        if self.recorded is None:
            raise PoolError(f"pool {self.path or '(in memory)'}: a replay pool must be planned with its recorded "
                            f"questions (conductor.runner.planning_pool)")
        return self.recorded

    @property
    def ids(self) -> list[str]:
        return [w.id for w in self.workers]

    def provider_of(self, worker: Worker) -> Provider:
        return self.providers[worker.provider]

    def identity_hash(self, only: tuple[str, ...] | None = None) -> str:
        """Hash of what decides results (workers, models, endpoints, params),
        not of limits or budgets: raising a budget resumes the same run. `only`: those
        workers' alone (an enrichment job in direct mode, whose records its one worker
        decides); by default every worker's."""
        ident = [
            [w.id, w.kind, w.model, w.api_base, w.params, w.system, w.function]
            for w in self.workers if only is None or w.id in only
        ]
        # the replay table's fingerprint only guards against a table changed under the pool: a pool
        # written again (or a table touched) must not start a new run
        replay = {k: v for k, v in self.replay.items() if k != "fingerprint"} if self.replay else self.replay
        return hashlib.sha256(orjson.dumps([ident, replay], option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]

    def planning_hash(self) -> str:
        """Hash of what planners read besides the workers themselves (descriptions,
        skills, prices): a run's plans depend on them, an enrichment job's rows do not."""
        seen = [[w.id, w.description, w.skills, w.price and [w.price.input, w.price.output]]
                for w in self.workers]
        return hashlib.sha256(orjson.dumps(seen, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def redact_url(url: str) -> str:
    """The URL with any password replaced by ***, for messages and logs: in the
    `user:password@` part and in query parameters (`?password=`, as redis-py takes it).

    The user part is everything between `://` and the last `@`, whatever it holds: a
    password with an unencoded `#`, `/`, `?` or `@` cut it short for urlsplit, which then
    showed its tail as the host. One without `:` is masked whole (some clients take a
    bare `password@`). An `@` later in the path or query masks more than needed, never less."""
    scheme, sep, rest = url.partition("://")
    if not sep:  # a typo (`redis:/:pw@host`): all before the last `@` but a leading `scheme:/` is the user part
        lead = re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/*", url) if "@" in url else None
        scheme, rest = (url[:lead.end()], url[lead.end():]) if lead else ("", url)
    user, at, tail = rest.rpartition("@")
    shown = _masked_userinfo(user) + at if at else ""
    return f"{scheme}{sep}{shown}{_redact_query(tail)}"


def _masked_userinfo(userinfo: str) -> str:
    """`user:***`, or `***` when there is no `:` to tell a user name from a password."""
    name, colon, _ = userinfo.partition(":")
    return f"{name}:***" if colon else "***"


def _redact_query(text: str) -> str:
    """`text` with the values of its secret query parameters masked. Everything after the
    `?` is the query, a `#` included (a password may hold one); a piece with no `=` after a
    secret one is taken as the rest of its value (an unencoded `&` in it)."""
    head, q, query = text.partition("?")
    if not q:
        return text
    shown, secret = [], False
    for param in query.split("&"):
        if secret and "=" not in param:
            continue  # the secret's value went on past an `&`
        masked = _redact_param(param)
        secret = masked != param
        shown.append(masked)
    return f"{head}?{'&'.join(shown)}"


def shown_url(worker: Worker | None) -> str:
    """The worker's endpoint as messages and summaries show it: a `${VAR}` in it that holds the
    provider's key, or is named like a secret, shows its name, never its value; a password is masked."""
    base = worker and (worker.api_base_shown or worker.api_base)
    return mask(redact_url(base)) if base else "(provider default)"


def _redact_param(param: str) -> str:
    name = param.split("=", 1)[0]
    secret = SECRET_NAME.search(name) or name.lower() in ("pass", "pwd", "auth")
    return f"{name}=***" if secret and "=" in param else param


def unlisted(provider: str, listed: Iterable[str], named: bool, who: str = "the worker",
             where: str | None = None, model: str | None = None) -> str | None:
    """Why a worker may not run on `provider` in a pool file whose providers: lists `listed`, else
    None. Named or taken from its model's prefix, an unlisted provider would run it with default
    limits and outside every budget, silently: a typo, or a provider the user forgot to list.
    `where`: the file as a message from outside it names it (None: the pool file's own message).
    `model`: the worker's model, so that `default` (a model without a prefix) is not called its prefix."""
    listed = list(listed)
    if not listed or provider in listed:
        return None
    if named:
        near = difflib.get_close_matches(provider, listed, n=1)
        return (f"{provider!r} is not under providers:" + (f" in {where}" if where else "")
                + (f" (did you mean {near[0]!r}?)" if near else f" ({', '.join(listed)})")
                + f"; to give it default limits and no budget, list it as `{provider}: {{}}`")
    source = ("its model's prefix" if model is None or "/" in model
              else f"its model {model!r} has no provider prefix")
    return (f"required, since {where or 'the file'} has providers: ({', '.join(listed)}); without it {who} would "
            f"run on provider {provider!r} ({source}), which is not listed: default limits and no "
            f"budget. Name one of them, or list `{provider}: {{}}` to allow that")


def provider_from_model(model: str) -> str:
    """The provider a worker without `provider:` belongs to: its model string's prefix
    (`openai/gpt-4o` -> `openai`), else `default`."""
    return model.split("/", 1)[0] if model and "/" in model else "default"


def load_pool(path: str | os.PathLike) -> Pool:
    p = Path(path)
    raw, _ = yamlkeys.read_file(p, "pool file", PoolError)
    try:
        return parse_pool(raw, where=str(p))
    except PoolError as e:
        raise PoolError(f"pool file {p}: {e}") from None


def parse_pool(raw: Any, where: str | None = None) -> Pool:
    if not isinstance(raw, dict):
        raise PoolError(("the file is empty" if raw is None else "the top level must be a mapping")
                        + ": it needs a workers: list (providers:, version:, governor: and replay: are optional)")
    _no_unknown(raw, {"workers", "providers", "version", "replay", "governor"}, "")
    _check_version(raw.get("version"))
    governor = raw.get("governor")
    if governor is not None:
        if not isinstance(governor, str):
            raise PoolError("governor: must be a URL string (memory://, redis://HOST:PORT/DB)")
        governor = _expand_env(governor, "governor")
        if governor.split("://", 1)[0] not in GOVERNOR_SCHEMES or "://" not in governor:
            raise PoolError(f"governor: {redact_url(governor)!r} must start with memory://, redis:// or rediss:// "
                            f"(e.g. redis://127.0.0.1:6379/0; a password belongs in ${{VAR}})")
    replay = raw.get("replay")
    if replay is not None and not isinstance(replay, dict):
        raise PoolError("replay: must be a mapping (see `conductor replay --help`)")
    providers_raw = raw.get("providers") or {}
    if not isinstance(providers_raw, dict):
        raise PoolError("providers: must be a mapping of provider id to settings")
    providers = {pid: _provider(pid, cfg) for pid, cfg in providers_raw.items()}

    workers_raw = raw.get("workers")
    if not isinstance(workers_raw, list) or not workers_raw:
        raise PoolError("workers: must be a non-empty list")
    workers = []
    seen: dict[str, int] = {}  # id -> its position, which a duplicate's message names too
    for i, w in enumerate(workers_raw):
        worker = _worker(i, w, providers)
        if worker.id in seen:
            raise PoolError(f"workers[{i}].id: duplicate worker id {worker.id!r} (also workers[{seen[worker.id]}])")
        seen[worker.id] = i
        workers.append(worker)
    # Workers with no provider section share a default one with default limits.
    for i, w in enumerate(workers):
        if w.provider not in providers:
            providers[w.provider] = Provider(id=w.provider)
        if providers[w.provider].mode == "batch" and w.kind != "function" and w.model \
                and not w.model.startswith("openai/"):
            raise PoolError(f"workers[{i}] ({w.id}).model: provider {w.provider} has mode: batch, which sends "
                            f"through the OpenAI batch API (/v1/files, /v1/batches); the model must be an "
                            f"openai/ model of an OpenAI-compatible endpoint (got {w.model!r})")
    return Pool(workers=tuple(workers), providers=providers, path=where, replay=replay, governor=governor,
                listed=tuple(providers_raw))


def _check_version(version: Any) -> None:
    """null is the default, as for every key the README lets be null; "1" in quotes is text."""
    if version is None or (version == POOL_VERSION and not isinstance(version, bool)):  # True == 1
        return
    text = f": text, not a number; write version: {POOL_VERSION} without quotes" if isinstance(version, str) else ""
    raise PoolError(f"version: this conductor reads pool files of version {POOL_VERSION} "
                    f"(got {yamlkeys.shown_value(version)}{text})")


def _provider(pid: Any, cfg: Any) -> Provider:
    at = f"providers.{pid}"
    if not isinstance(pid, str) or not _ID_RE.fullmatch(pid):
        raise PoolError(f"{at}: provider id must be a plain name")
    cfg = cfg or {}
    if not isinstance(cfg, dict):
        raise PoolError(f"{at}: must be a mapping")
    _no_unknown(cfg, {f for f in Provider.__dataclass_fields__ if f not in ("id", "key_hint")}, at)
    key_env = cfg.get("api_key_env")
    if key_env is not None and (not isinstance(key_env, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*\Z", key_env)
                                or (looks_like_a_key(key_env) and key_env not in os.environ)):
        if isinstance(key_env, str) and looks_like_a_key(key_env):
            raise PoolError(f"{at}.api_key_env: must be the NAME of an environment variable, not a key (the value "
                            f"is not shown here; if it is a key, move it into a variable and revoke it)")
        raise PoolError(f"{at}.api_key_env: must be the NAME of an environment variable: letters, digits and _, "
                        f"not starting with a digit (the value is not shown here)")
    return Provider(
        id=pid,
        rpm=_num(cfg, "rpm", at, positive=True),
        tpm=_num(cfg, "tpm", at, positive=True),
        max_concurrency=_whole(cfg, "max_concurrency", at, default=16),
        budget_usd=_num(cfg, "budget_usd", at, minimum=0.0),
        timeout_s=_num(cfg, "timeout_s", at, positive=True, default=120.0),
        max_attempts=_whole(cfg, "max_attempts", at, default=6),
        api_key_env=key_env,
        **_batch_options(cfg, at),
    )


def _whole(cfg: dict, key: str, at: str, default: int) -> int:
    n = _num(cfg, key, at, positive=True, default=default)
    if n != int(n):
        raise PoolError(f"{at}.{key}: must be a whole number (got {n!r})")
    return int(n)


def _batch_options(cfg: dict, at: str) -> dict[str, Any]:
    """The provider's batch-API settings; batch_* keys only make sense with mode: batch."""
    mode = "online" if cfg.get("mode") is None else cfg["mode"]
    if mode not in PROVIDER_MODES:
        raise PoolError(f"{at}.mode: must be one of {', '.join(PROVIDER_MODES)} (got {mode!r})")
    given = sorted(k for k, v in cfg.items() if str(k).startswith("batch_") and v is not None)  # null: the default
    if given and mode != "batch":
        raise PoolError(f"{at}.{given[0]}: only applies with mode: batch (this provider is online)")
    out: dict[str, Any] = {"mode": mode}
    # A null value means the default, as for every other provider key: `batch_poll_s: null` was a
    # TypeError traceback and `batch_max_requests: null` a limit of 0 that hung the run.
    for key in ("batch_poll_s", "batch_collect_s", "batch_max_wait_s"):
        if cfg.get(key) is not None:
            out[key] = float(_num(cfg, key, at, positive=True))
    if cfg.get("batch_price_factor") is not None:
        factor = _num(cfg, "batch_price_factor", at, minimum=0.0)
        if factor > 1:
            raise PoolError(f"{at}.batch_price_factor: must be at most 1 (the batch price as a share of the "
                            f"online price, e.g. 0.5; got {factor!r})")
        out["batch_price_factor"] = float(factor)
    for key in ("batch_max_requests", "batch_budget_rounds"):
        if cfg.get(key) is not None:
            out[key] = _whole(cfg, key, at, default=0)
    if cfg.get("batch_retry") is not None:
        if cfg["batch_retry"] not in BATCH_RETRY:
            raise PoolError(f"{at}.batch_retry: must be one of {', '.join(BATCH_RETRY)} "
                            f"(got {cfg['batch_retry']!r})")
        out["batch_retry"] = cfg["batch_retry"]
    if cfg.get("batch_completion_window") is not None:
        window = cfg["batch_completion_window"]
        if not isinstance(window, str) or not re.match(r"^[0-9]+h\Z", window):
            raise PoolError(f"{at}.batch_completion_window: must be hours such as '24h' (got {window!r})")
        out["batch_completion_window"] = window
    return out


def _worker(i: int, w: Any, providers: dict[str, Provider]) -> Worker:
    at = f"workers[{i}]"
    if not isinstance(w, dict):
        raise PoolError(f"{at}: must be a mapping")
    wid = w.get("id")
    if not isinstance(wid, str) or not _ID_RE.fullmatch(wid):
        raise PoolError(f"{at}.id: required, letters, digits and _.:- only (got {wid!r})")
    at = f"workers[{i}] ({wid})"
    _no_unknown(w, set(Worker.__dataclass_fields__) - {"api_base_shown"}, at)  # that one is derived
    kind = "llm" if w.get("kind") is None else w["kind"]  # null: the default, as for the other keys
    if kind not in WORKER_KINDS:
        raise PoolError(f"{at}.kind: must be one of {', '.join(WORKER_KINDS)} (got {kind!r})")
    model = w.get("model")
    function = w.get("function")
    if kind == "llm":
        if not isinstance(model, str) or not model.strip():
            raise PoolError(f"{at}.model: required for an llm worker (a litellm model string such as 'openai/gpt-4o')")
        if function is not None:  # it would be ignored: the worker calls its model
            raise PoolError(f"{at}.function: only for a worker of kind: function (this one is an llm worker "
                            f"calling {model}); add kind: function, or remove function")
    if kind == "planner" and function is not None:  # it would be ignored: the step is re-planned
        raise PoolError(f"{at}.function: a worker of kind: planner ignores function (it plans and runs a new "
                        f"workflow for its step; function is only for a worker of kind: function); remove function")
    if kind == "function":
        if model is not None:  # it would be ignored: a function worker calls no model
            raise PoolError(f"{at}.model: a worker of kind: function calls no model (its function runs "
                            f"locally); remove model, or remove kind: function for an llm worker")
        _no_call_settings(w, at)
        function = function or wid
        if function not in FUNCTION_NAMES:
            raise PoolError(f"{at}.function: must be one of {', '.join(FUNCTION_NAMES)} (got {function!r})")
    provider = w.get("provider")
    named = provider is not None
    if provider is None:
        provider = "local" if kind == "function" else provider_from_model(model)
    if not isinstance(provider, str):
        raise PoolError(f"{at}.provider: must be a provider id")
    # a function worker calls nothing, and a planner worker without a model is the run's own
    # planner, which has its provider
    if (named or (kind != "function" and model is not None)) and (
            why := unlisted(provider, providers, named, model=model)):
        raise PoolError(f"{at}.provider: {why}")
    api_base = shown = w.get("api_base")
    if api_base is not None:
        if not isinstance(api_base, str):
            raise PoolError(f"{at}.api_base: must be a URL string")
        key_env = providers[provider].api_key_env if provider in providers else None
        shown = _expand_env(api_base, f"{at}.api_base",
                            keep=lambda name: name == key_env or SECRET_NAME.search(name))
        api_base = _expand_env(api_base, f"{at}.api_base")
        if not re.match(r"^https?://", api_base):
            raise PoolError(f"{at}.api_base: must start with http:// or https:// (got {shown!r})")
    description = "" if w.get("description") is None else w["description"]  # null: none
    if not isinstance(description, str):
        raise PoolError(f"{at}.description: must be a string")
    params = w.get("params") or {}
    if not isinstance(params, dict):
        raise PoolError(f"{at}.params: must be a mapping of sampling parameters")
    if (big := _beyond_64_bits(params)) is not None:  # the request body and the run's hash cannot hold it
        raise PoolError(f"{at}.params.{big}: a whole number too large to send (at most 64 bits)")
    params = _text_keys(params)
    _check_params(params, f"{at}.params")
    system = w.get("system")
    if system is not None and not isinstance(system, str):
        raise PoolError(f"{at}.system: must be a string")
    simulate = w.get("simulate")
    if simulate is not None and not isinstance(simulate, dict):
        raise PoolError(f"{at}.simulate: must be a mapping")
    context = _num(w, "context_tokens", at, positive=True)
    if context is not None and context != int(context):  # int(0.5) would turn the check off
        raise PoolError(f"{at}.context_tokens: must be a whole number of tokens (got {context!r})")
    max_call = _num(w, "max_call_usd", at, minimum=0.0)
    return Worker(
        id=wid,
        provider=provider,
        kind=kind,
        model=model,
        api_base=api_base,
        api_base_shown=shown,
        description=description.strip(),
        skills=_skills(w.get("skills"), at),
        price=_price(w.get("price"), at),
        params=params,
        system=system,
        function=function,
        simulate=simulate,
        context_tokens=None if context is None else int(context),
        max_call_usd=None if max_call is None else float(max_call),
    )


# What configures a model call. A function worker makes none, so each of these would be read by
# nothing (some of them changed the run id, and nothing else): refused as `model` is.
_CALL_SETTINGS = ("api_base", "price", "params", "system", "context_tokens", "max_call_usd")


def _no_call_settings(w: dict, at: str) -> None:
    given = [k for k in _CALL_SETTINGS if w.get(k) is not None and w[k] != {} and not _free(k, w[k])]
    if given:
        names = given[0] if len(given) == 1 else f"{', '.join(given[:-1])} and {given[-1]}"
        raise PoolError(f"{at}.{given[0]}: a worker of kind: function calls no model (its function runs locally, "
                        f"for free), so it ignores {names}; remove {'it' if len(given) == 1 else 'them'}")


def _free(key: str, value: Any) -> bool:
    """A price of all zeros on a function worker says what is so (it costs nothing), as null and
    `params: {}` say nothing: all three are taken, so pools that wrote them keep loading."""
    return key == "price" and isinstance(value, dict) and bool(value) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0 for v in value.values())


def _skills(raw: Any, at: str) -> dict[str, float | None]:
    if raw is None:
        return {}
    if isinstance(raw, list):
        if not all(isinstance(t, str) for t in raw):
            raise PoolError(f"{at}.skills: a list must hold task tags (strings)")
        for tag in raw:
            _check_skill_tag(tag, at)
        return {t: None for t in raw}
    if isinstance(raw, dict):
        out: dict[str, float | None] = {}
        for tag, acc in raw.items():
            _check_skill_tag(str(tag), at)
            if acc is not None and (not isinstance(acc, (int, float)) or isinstance(acc, bool) or not 0 <= acc <= 1):
                raise PoolError(f"{at}.skills.{tag}: expected accuracy must be a number in [0, 1] (got {acc!r})")
            out[str(tag)] = None if acc is None else float(acc)
        return out
    raise PoolError(f"{at}.skills: must be a list of task tags or a mapping of tag to expected accuracy")


def _check_skill_tag(tag: str, at: str) -> None:
    """A skill is read for a query's task, and a query set's tasks are a closed set (conductor.queries
    refuses any other): a tag outside it (`maths`) is never read, and its worker silently gets the
    planner's default_skill instead."""
    from conductor.grading import QUERY_TASKS as TASKS  # imported here: a pool file needs no grader

    known = (*TASKS, "default")
    if tag in known:
        return
    near = difflib.get_close_matches(tag.lower(), known, n=1)
    raise PoolError(f"{at}.skills.{tag}: not a task" + (f" (did you mean {near[0]!r}?)" if near else "")
                    + f"; a skill is read for a query's task: one of {', '.join(TASKS)}, or default (for a "
                      f"task the worker lists no skill for)")


def _price(raw: Any, at: str) -> Price | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise PoolError(f"{at}.price: must be a mapping, e.g. {{input_per_mtok: 0.15, output_per_mtok: 0.6}}")
    at = f"{at}.price"
    _no_unknown(raw, {"input_per_mtok", "output_per_mtok", "input_per_token", "output_per_token"}, at)
    per_tok = {"input_per_token", "output_per_token"} & raw.keys()
    per_m = {"input_per_mtok", "output_per_mtok"} & raw.keys()
    if per_tok and per_m:
        raise PoolError(f"{at}: give prices per token or per million tokens, not both")
    if not per_tok and not per_m:  # `price: {}`: "input_per_token: required" sent users the rarer way
        raise PoolError(f"{at}: give input_per_mtok and output_per_mtok (USD per million tokens), "
                        f"or input_per_token and output_per_token")
    if per_m:
        return Price(_num(raw, "input_per_mtok", at, minimum=0.0, required=True) / 1e6,
                     _num(raw, "output_per_mtok", at, minimum=0.0, required=True) / 1e6)
    return Price(_num(raw, "input_per_token", at, minimum=0.0, required=True),
                 _num(raw, "output_per_token", at, minimum=0.0, required=True))


def _num(cfg: dict, key: str, at: str, *, positive: bool = False, minimum: float | None = None,
         default: float | None = None, required: bool = False) -> Any:
    if key not in cfg or cfg[key] is None:
        if required:
            raise PoolError(f"{at}.{key}: required")
        return default
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PoolError(f"{at}.{key}: must be a number (got {yamlkeys.shown_value(v)})")
    if isinstance(v, int) and abs(v) > 2**53:  # past float's whole numbers; math.isfinite overflows past 1e308
        raise PoolError(f"{at}.{key}: too large (got {yamlkeys.shown_value(v)})")
    if not math.isfinite(v):  # YAML's .nan and .inf: NaN passes every comparison below
        raise PoolError(f"{at}.{key}: must be a finite number (got {v!r})")
    if positive and v <= 0:
        raise PoolError(f"{at}.{key}: must be greater than 0 (got {v!r})")
    if minimum is not None and v < minimum:
        raise PoolError(f"{at}.{key}: must be at least {minimum} (got {v!r})")
    return v


def _no_unknown(cfg: dict, allowed: set[str], at: str) -> None:
    unknown = sorted(set(map(str, cfg)) - allowed)
    if unknown:
        where = f"{at}." if at else ""
        raise PoolError(f"{where}{unknown[0]}: unknown field (allowed: {', '.join(sorted(allowed))})")


# Keys the executor sets itself on every call: given in params they clash with it (a TypeError on
# every call) or quietly undo it (the executor's retries through the rate limiter, its timeout).
_NOT_PARAMS = {
    "api_key": "use the provider's api_key_env", "api_base": "use the worker's api_base",
    "messages": "the plan's step writes them", "model": "use the worker's model",
    "stream": "answers are read whole", "timeout": "use the provider's timeout_s",
    "num_retries": "the executor retries, through the provider's rate limit",
    "max_retries": "the executor retries, through the provider's rate limit",
    "client": "set by the executor", "extra_headers": "set by the executor",
}


def _number_param(lo: float, hi: float):
    return (lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and lo <= v <= hi,
            f"a number from {lo:g} to {hi:g}")


def _whole_param(lo: int, what: str | None = None):
    return (lambda v: not isinstance(v, bool) and isinstance(v, int) and v >= lo,
            what if what and lo < -(2**62) else f"{what or 'a whole number'}, at least {lo}")


# The sampling parameters most pools set, checked here so that a typo (`temperature: "hot"`, a
# quoted number) is named at its key before the run, not a provider's 400 on every call.
_PARAM_TYPES = {
    "temperature": _number_param(0, 2), "top_p": _number_param(0, 1),
    "presence_penalty": _number_param(-2, 2), "frequency_penalty": _number_param(-2, 2),
    "max_tokens": _whole_param(1, "a whole number of tokens"),
    "max_completion_tokens": _whole_param(1, "a whole number of tokens"),
    "seed": _whole_param(-(2**63), "a whole number"), "top_k": _whole_param(-1),
    "n": (lambda v: v == 1 and not isinstance(v, bool), "1 (one answer is kept per step; more are paid for and thrown away)"),
    "stop": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
             "a string or a list of strings"),
    "logit_bias": (lambda v: isinstance(v, dict) and all(not isinstance(x, bool) and isinstance(x, (int, float))
                                                          for x in v.values()), "a mapping of token ids to numbers"),
    "reasoning_effort": (lambda v: isinstance(v, str), "a string such as low, medium or high"),
    "response_format": (lambda v: isinstance(v, dict), "a mapping such as {type: json_object}"),
}


def _check_params(params: dict[str, Any], at: str) -> None:
    for key, value in params.items():
        if key in _NOT_PARAMS:
            raise PoolError(f"{at}.{key}: not allowed here ({_NOT_PARAMS[key]})")
        if key in _PARAM_TYPES:
            ok, allowed = _PARAM_TYPES[key]
            if not ok(value):
                raise PoolError(f"{at}.{key}: must be {allowed} (got {yamlkeys.shown_value(value)})")


def _text_keys(value: Any) -> Any:
    """Mapping keys as text, as JSON sends them: `logit_bias: {50256: -100}` has integer keys,
    which the run's hash (orjson) refused with a traceback."""
    if isinstance(value, dict):
        return {str(k): _text_keys(v) for k, v in value.items()}
    return [_text_keys(v) for v in value] if isinstance(value, list) else value


def _beyond_64_bits(value: Any, at: str = "") -> str | None:
    """Where in `value` a whole number needs more than 64 bits, or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return at or "value" if not -(2**63) <= value < 2**64 else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if (found := _beyond_64_bits(v, f"{at}.{k}" if at else str(k))) is not None:
            return found
    return None


def _expand_env(value: str, at: str, keep: Callable[[str], Any] | None = None) -> str:
    """`${VAR}` and `${VAR:-default}` expanded as the shell does: `:-` takes the default when VAR is
    unset or empty (.env templates leave variables empty), and a default may hold `${OTHER}` itself.
    Those whose name `keep` picks are left as written."""
    out, pos = [], 0
    while m := _ENV_START.search(value, pos):
        name = m.group(1)
        default = None
        end = m.end()
        if m.group(2) == ":-":
            close = _closing_brace(value, m.end())
            if close is None:
                raise PoolError(f"{at}: ${{{name}:-...}} has no closing }} (a default may hold ${{OTHER}} "
                                f"itself, with its own braces)")
            default, end = value[m.end():close], close + 1
        out.append(value[pos:m.start()])
        if keep is not None and keep(name):
            out.append(value[m.start():end])
        elif default is None and name in os.environ:
            out.append(os.environ[name])
        elif default is not None:
            out.append(os.environ.get(name) or _expand_env(default, at, keep))
        else:
            raise PoolError(f"{at}: environment variable {name} is not set and has no default")
        pos = end
    out.append(value[pos:])
    return "".join(out)


def _closing_brace(text: str, start: int) -> int | None:
    """Where the `}` that closes a `${` opened before `start` is, braces inside counted as the shell counts them."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None
