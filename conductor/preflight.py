"""Checks before any call: a run whose workers cannot work should say so at
once, naming the worker and the URL, instead of paying for half a run and
recording every plan as an error.

For each LLM worker the plans use: litellm knows its provider prefix (a typo
such as `openia/` is caught), and where the worker names an endpoint
(`api_base`), the endpoint answers and, when it lists its models
(GET /models, one request per endpoint and run), serves the worker's model.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any, Iterable, NamedTuple
from urllib.parse import unquote, urlsplit, urlunsplit

from conductor.masking import mask
from conductor.pool import Pool, Worker, shown_url

TIMEOUT_S = 5.0


def plannable(pool: Pool) -> str | None:
    """Why no plan could be made for any query of the pool (None: it can plan): every planner
    (embedded, llm, vllm) gives a query's first steps to llm workers, and a vote or extract
    only combines their answers. Checked before a run is written, so that a pool of function
    workers is refused as configuration, not found out as every plan invalid."""
    if any(w.kind == "llm" for w in pool.workers):
        return None
    have = ", ".join(f"{w.id} ({w.kind})" for w in pool.workers)
    return (f"pool file {pool.path or '(in memory)'}: has no llm workers (it has {have}); a plan needs at least "
            f"one worker of kind llm (a model) to answer the query, so add one")


class Problem(NamedTuple):
    """A preflight problem and what fixes it: `fix` is "env" (set a variable), "server" (start it, or
    change api_base), "served" (serve the model there, or change the model), "model" or "api_base"
    (change the pool file's worker). The caller says from it whether the fix keeps the run's id."""

    text: str
    fix: str


class Given(NamedTuple):
    """A worker the user never wrote in the pool file (the one the LLM planner's --planner-model
    adds), as its lines name it and the setting that changes its endpoint: they named worker
    `conductor-planner` and told the user to fix api_base in the pool file."""

    name: str  # "--planner-model openai/x", in place of "worker conductor-planner"
    api_base: str  # "--planner-option api_base", in place of "api_base in the pool file"


POOL_API_BASE = "api_base in the pool file"


def preflight(pool: Pool, worker_ids: Iterable[str], given: dict[str, Given] | None = None) -> list[str]:
    """Problems that would fail every call of a worker, one line each (empty: go)."""
    return [p.text for p in problems_of(pool, worker_ids, given)]


def problems_of(pool: Pool, worker_ids: Iterable[str], given: dict[str, Given] | None = None) -> list[Problem]:
    """preflight's problems, each with what fixes it (see Problem). `given`: workers (by id) that
    command-line options made, named as those options (see Given)."""
    given = given or {}

    def who(w: Worker) -> str:
        return given[w.id].name if w.id in given else f"worker {w.id}"

    problems: list[Problem] = []
    listed: dict[str, Any] = {}  # api_base -> model ids, None (cannot say) or an error line
    # (api_base, where it is set) -> its workers: one line per endpoint, not per worker
    unreachable: dict[tuple[str, str], list[Worker]] = {}
    for wid in sorted(set(worker_ids)):
        w = pool.worker(wid) if pool.has(wid) else None
        if w is None or w.kind == "function" or not w.model:
            continue
        provider = pool.providers.get(w.provider)
        hint = provider.key_hint if provider else None
        name, why = _provider_model(w)
        if why:
            problems.append(Problem(f"{who(w)}: {why}", "model"))
            continue
        if not w.api_base:
            if not (provider and provider.api_key_env) and (why := _missing_key(w, hint)):
                problems.append(Problem(f"{who(w)}: {why}", "env"))
            continue
        option = given[w.id].api_base if w.id in given else None
        place = option or POOL_API_BASE
        if why := _credentials_in_url(w, option or "api_base", hint):
            problems.append(Problem(f"{who(w)}: {why}", "api_base"))
        base = w.api_base.rstrip("/")
        key = os.environ.get(provider.api_key_env) if provider and provider.api_key_env else None
        if base not in listed:
            listed[base] = _list_models(base, key)
        models = listed[base]
        if isinstance(models, str):
            unreachable.setdefault((base, place), []).append(w)
        elif models is not None and name not in models:
            shown = mask(", ".join(sorted(models)[:10]) + (" ..." if len(models) > 10 else ""), key)
            problems.append(Problem(f"{who(w)}: {shown_url(w)} does not serve model {name!r} (model {w.model}); "
                                    f"it serves: {shown or 'nothing'}", "served"))
    for (base, place), workers in unreachable.items():
        hint = (f" (a replay pool's server: `conductor replay serve --pool {pool.path}`, or `--serve` "
                f"where the command has it)" if pool.replay is not None else "")
        names = (f"worker{'s' if len(workers) > 1 else ''} {', '.join(w.id for w in workers)}"
                 if place == POOL_API_BASE else who(workers[0]))
        problems.append(Problem(f"{names}: cannot reach {shown_url(workers[0])} {listed[base]}; start the server "
                                f"or fix {place}{hint}", "server"))
    return problems


def _provider_model(w: Worker) -> tuple[str, str | None]:
    """The model name the call sends, or why litellm cannot route the model string.
    A worker the direct client sends (execute/openai_http) needs no litellm: its seconds
    of import are not paid for it."""
    from conductor.execute.openai_http import direct_model

    if name := direct_model(w.api_base, w.model):
        return name, None
    import litellm

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # litellm prints a banner on this error
            name, _provider, _key, _base = litellm.get_llm_provider(w.model, api_base=w.api_base)
    except Exception:
        prefix = w.model.split("/", 1)[0] if "/" in w.model else w.model
        return w.model, (f"model {w.model!r}: litellm does not know the provider {prefix!r}; use a prefix such as "
                         f"openai/, anthropic/, hosted_vllm/ (see https://docs.litellm.ai/docs/providers)")
    return name, None


def _credentials_in_url(w: Worker, api_base: str = "api_base", key_hint: str | None = None) -> str | None:
    """Why every call to an api_base with `user:password@` would fail, or None. The HTTP client
    of the calls (aiohttp, in the direct client and inside litellm) refuses credentials in the
    URL beside the Authorization header that carries the key: each call would fail with a
    ValueError after the run was written. None as well once the direct client takes them out
    of its URL (its `url` has no userinfo)."""
    if "@" not in urlsplit(w.api_base).netloc:
        return None
    from conductor.execute.openai_http import OpenAIEndpoint, direct_model

    if direct_model(w.api_base, w.model) and "@" not in urlsplit(OpenAIEndpoint(w.api_base, None).url).netloc:
        return None
    how = key_hint or "give a key with the provider's api_key_env"
    return (f"api_base {shown_url(w)} holds user:password@, which its calls cannot send (the HTTP client refuses "
            f"credentials in the URL beside the key's Authorization header, so every call would fail); remove "
            f"user:password@ from {api_base}, and {how}")


def _missing_key(w: Worker, key_hint: str | None = None) -> str | None:
    """Why a hosted model's calls would all fail for want of its API key (litellm reads
    OPENAI_API_KEY and the like when the provider names no api_key_env); None when
    they would not, or when the credentials are not an API key (cloud roles, profiles)."""
    import litellm

    try:
        env = litellm.validate_environment(model=w.model)
    except Exception:
        return None
    missing = env.get("missing_keys") or []
    if env.get("keys_in_environment") or not missing or not all(k.endswith("_API_KEY") for k in missing):
        return None
    how = key_hint or f"name the variable that holds the key with api_key_env (provider {w.provider})"
    return f"model {w.model} needs {' or '.join(missing)}, which is not set; set it, or {how}"


def _read_by(resp, deadline: float, limit: int) -> bytes | None:
    """Up to `limit` bytes of the body, or None past the deadline: the socket timeout is
    per read, so a server sending a byte a second would otherwise hold the run for ever."""
    parts, size = [], 0
    while size < limit:
        if time.monotonic() > deadline:
            return None
        chunk = resp.read1(min(1 << 16, limit - size))
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


class _KeyStaysHome(urllib.request.HTTPRedirectHandler):
    """Follows a redirect, but sends the key only to the origin (scheme, host, port) it
    was meant for: urllib's own handler passes every header to wherever it is sent."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(new.full_url) != _origin(req.full_url):
            new.remove_header("Authorization")
        return new


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return parts.scheme, parts.hostname, port or {"http": 80, "https": 443}.get(parts.scheme)


def _without_userinfo(url: str) -> tuple[str, str | None]:
    """The URL without its `user:password@` part, and that part as a Basic Authorization
    header value (None without one): urllib would take `user:password@host` for the host
    name, where httpx sends the credentials as Basic auth in place of the key."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode("ascii")
    return urlunsplit(parts._replace(netloc=hostport)), f"Basic {token}"


def _list_models(base: str, api_key: str | None) -> set[str] | str | None:
    """The endpoint's model ids; None when it does not say; a message when it cannot be reached."""
    url, basic = _without_userinfo(f"{base}/models")
    auth = basic or (f"Bearer {api_key}" if api_key else None)
    req = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.build_opener(_KeyStaysHome).open(req, timeout=TIMEOUT_S) as resp:
            body = _read_by(resp, time.monotonic() + TIMEOUT_S, 1 << 22)
            if body is None:
                return None  # too slow to say: the calls themselves will tell
            doc = json.loads(body)
    except urllib.error.HTTPError:
        return None  # it answers, but not this question (no /models, or a key is needed)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        return f"({reason})"
    except ValueError:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    return {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}
