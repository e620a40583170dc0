"""The simulated worker pool as an OpenAI-compatible HTTP server (aiohttp).

Endpoints: POST /v1/chat/completions, GET /v1/models, GET /health, OpenAI's
Files and Batch API (see `batch`), and for
tests and benchmarks GET /admin/log, POST /admin/reset, GET|POST /admin/faults.
Faults and latency are random (seeded); the answer is a pure function of the
request, see `answers` and, for structured requests, `structured`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import random
import time
from collections import Counter, deque
from dataclasses import asdict
from typing import Any, Callable

import orjson
from aiohttp import web

from conductor.localserver import LocalServer, RequestLog, message_text, openai_app
from conductor.sim.answers import draw, reply
from conductor.sim.batch import BatchAPI
from conductor.sim.config import (ModelSpec, SimConfigError, check_overrides, effective_faults,
                                  Faults)
from conductor.sim.index import QueryIndex
from conductor.sim.outcome import (FINGERPRINT, REFUSAL, Answer, Rejection, failed_status, rate_limited,
                                   server_error, unauthorized)
from conductor.sim.planner import plan_reply, token_logprobs
from conductor.sim.structured import StructuredRequest, StructuredRequestError, parse_request, record_reply
from conductor.tokens import prompt_params, tokenizer_tokens

MAX_TIMES = 100_000
# Request fields that do not change what a model would answer.
_NOT_SAMPLING = frozenset({"model", "stream", "stream_options", "user", "metadata"})
_JSON = "application/json"


class SimLog(RequestLog):
    def reset(self) -> None:
        super().reset()
        self.by_body: Counter[str] = Counter()
        self.accepted_times: dict[str, deque[float]] = {}
        # Answers per known query id, and structured replies by kind (record,
        # repair, unparseable, invalid), so tests can tell which rows were sent.
        self.by_query: Counter[str] = Counter()
        self.by_kind: Counter[str] = Counter()
        # Tokens actually processed per model (prompt, completion), whatever the
        # reported usage says: the provider's bill, for budget checks from outside.
        self.billed_tokens: dict[str, list[int]] = {}
        # The batch API's counters: tokens billed at the batch price per model, lines
        # by outcome (HTTP status or batch_expired / batch_cancelled) and per model,
        # and batches created per input file (sha256), so a resumed client can be
        # seen to have submitted once.
        self.batch_billed_tokens: dict[str, list[int]] = {}
        self.batch_lines: Counter[str] = Counter()
        self.batch_by_model: Counter[str] = Counter()
        self.batch_submissions: Counter[str] = Counter()
        self.batches_created = 0
        self.files_uploaded = 0

    def bill(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        billed = self.billed_tokens.setdefault(model, [0, 0])
        billed[0] += prompt_tokens
        billed[1] += completion_tokens

    def bill_batch(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        billed = self.batch_billed_tokens.setdefault(model, [0, 0])
        billed[0] += prompt_tokens
        billed[1] += completion_tokens

    def request(self, body_sha: str, model: str | None) -> None:
        self.total += 1
        self.by_body[body_sha] += 1
        if model is not None:
            self.by_model[model] += 1

    def status(self, status: str, model: str | None = None, received: float | None = None) -> None:
        self.by_status[status] += 1
        if status == "200" and model is not None and received is not None:
            times = self.accepted_times.get(model)
            if times is None:
                times = self.accepted_times[model] = deque(maxlen=MAX_TIMES)
            times.append(received)

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "by_body": dict(self.by_body),
                "accepted_times": {m: list(t) for m, t in self.accepted_times.items()},
                "by_query": dict(self.by_query), "by_kind": dict(self.by_kind),
                "billed_tokens": {m: list(t) for m, t in self.billed_tokens.items()},
                "batch_billed_tokens": {m: list(t) for m, t in self.batch_billed_tokens.items()},
                "batch_lines": dict(self.batch_lines), "batch_by_model": dict(self.batch_by_model),
                "batch_submissions": dict(self.batch_submissions), "batches_created": self.batches_created,
                "files_uploaded": self.files_uploaded}


class SimServer(LocalServer):
    def __init__(self, models: dict[str, ModelSpec], index: QueryIndex, *, seed: int = 0,
                 overrides: dict[str, dict[str, float | None]] | None = None,
                 keys: dict[str, str] | None = None):
        self.models = models
        self.index = index
        self.seed = seed
        self.log = SimLog()
        self._start_overrides = {m: dict(v) for m, v in (overrides or {}).items()}
        self._overrides = {m: dict(v) for m, v in self._start_overrides.items()}
        self._faults: dict[str, Faults] = {}
        self._keys = {m: k.encode() for m, k in (keys or {}).items()}
        self._windows: dict[str, deque[float]] = {m: deque() for m in models}
        self._rng = random.Random(seed)
        self._model_list = orjson.dumps({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": FINGERPRINT} for m in models]})
        self.batch_api = BatchAPI(self)

    # -- configuration -------------------------------------------------------

    def requires_key(self, model: str) -> bool:
        return model in self._keys

    def has_key(self, request: web.Request, model: str) -> bool:
        """Whether the request may use `model`: it needs no key, or the request carries it."""
        expected = self._keys.get(model)
        return expected is None or self._authorized(request, expected)

    def faults(self, model: str) -> Faults:
        f = self._faults.get(model)
        if f is None:
            f = self._faults[model] = effective_faults(self.models[model], self._overrides)
        return f

    def set_faults(self, model: str, values: dict[str, Any]) -> None:
        if model != "*" and model not in self.models:
            raise SimConfigError(f"faults: unknown model {model!r} (served: {', '.join(self.models)}, or '*')")
        if "require_key_env" in values:
            raise SimConfigError("faults.require_key_env: the key is read at start; restart the server to change it")
        checked = check_overrides(values, "faults")
        layer = self._overrides.setdefault(model, {})
        for k, v in checked.items():
            if v is None:
                layer.pop(k, None)
            else:
                layer[k] = v
        self._faults.clear()

    def clear_faults(self) -> None:
        self._overrides = {m: dict(v) for m, v in self._start_overrides.items()}
        self._faults.clear()

    def faults_json(self) -> dict[str, Any]:
        return {"overrides": self._overrides, "effective": {m: asdict(self.faults(m)) for m in self.models}}

    # -- handlers ------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        received = time.time()
        raw = await request.read()
        log = self.log
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            log.request(hashlib.sha256(raw).hexdigest(), None)
            return self._error(400, f"We could not parse the JSON body of your request ({e}).", "invalid_request_error")
        model = body.get("model") if isinstance(body, dict) else None
        log.request(hashlib.sha256(raw).hexdigest(), model if isinstance(model, str) else None)
        checked = self.check(body, lambda m: self.has_key(request, m))
        if isinstance(checked, Rejection):
            return self._reject(checked)
        spec, structured = checked

        f = self.faults(spec.name)
        if f.fail_status is not None:
            return self._reject(failed_status(spec.name, f))
        if f.rpm is not None:
            limited = self._rpm_check(spec.name, f)
            if limited is not None:
                return limited
        # One draw splits requests into drop | error | rate limit | hang | normal;
        # rates summing past 1 leave nothing for the later ones.
        u = self._rng.random()
        if u < f.drop_rate:
            self._admit(spec.name, f)
            log.status("dropped", spec.name)
            if request.transport is not None:
                request.transport.abort()
            raise web.HTTPInternalServerError()  # never reaches the client: the connection is gone
        u -= f.drop_rate
        if u < f.error_rate:
            self._admit(spec.name, f)
            return self._reject(server_error(spec.name, self._rng.choice((500, 502, 503))))
        u -= f.error_rate
        if u < f.rate_limit_rate:
            return self._reject(rate_limited(spec.name, f))
        u -= f.rate_limit_rate
        hang = u < f.hang_rate
        self._admit(spec.name, f)

        answer = self.answer(body, spec, structured, f)
        # billed once accepted, even if the client goes away
        log.bill(spec.name, answer.prompt_tokens, answer.completion_tokens)

        delay = self._latency(f, answer.completion_tokens) + (f.hang_s if hang else 0.0)
        if delay > 0:
            await asyncio.sleep(delay)
        if request.transport is None:  # the client gave up while we were "thinking"
            log.status("499", spec.name)
            return web.Response(status=499)
        log.status("200", spec.name, received)
        self.count_answer(answer, log)
        if (request_key := request.headers.get("x-conductor-request")) is not None:
            log.by_request_key[request_key] += 1
        payload = answer.payload(spec.name, int(received), f.usage_factor)
        return web.Response(body=orjson.dumps(payload), content_type=_JSON,
                            headers={"x-conductor-simulated": "1"})

    # -- the answer, shared by online chat and batch lines --------------------

    def check(self, body: Any,
              may_use: Callable[[str], bool]) -> tuple[ModelSpec, StructuredRequest | None] | Rejection:
        """The served model and structured request a chat body asks for, or why it is
        refused; `may_use(model)` says whether the caller has the model's key."""
        if not isinstance(body, dict):
            return Rejection(400, "The request body must be a JSON object.")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return Rejection(400, "You must provide a model parameter.", param="model")
        spec = self.models.get(model)
        if spec is None:
            return Rejection(404, f"The model `{model}` does not exist or you do not have access to it.",
                             code="model_not_found", model=model)
        if not may_use(model):
            return unauthorized(model)
        problem = _check_request(body)
        structured = None
        if not problem and spec.role != "planner":
            try:
                structured = parse_request(body, [message_text(m.get("content")) for m in body["messages"]])
            except StructuredRequestError as e:
                problem = (e.args[0], e.args[1])
        if problem:
            return Rejection(400, problem[1], param=problem[0], model=model)
        return spec, structured

    def answer(self, body: dict[str, Any], spec: ModelSpec, structured: StructuredRequest | None,
               f: Faults) -> Answer:
        """What the model answers to a checked body: a pure function of the request."""
        model = spec.name
        messages = body["messages"]
        texts = [message_text(m.get("content")) for m in messages]
        request_hash = hashlib.sha256(orjson.dumps(
            {k: v for k, v in body.items() if k not in _NOT_SAMPLING}, option=orjson.OPT_SORT_KEYS)).hexdigest()
        rng = draw(self.seed, model, request_hash)
        logprobs = None
        known = None
        kinds: tuple[str, ...] = ()
        if spec.role == "planner":
            content = plan_reply(messages, texts, body, rng, spec.replan_rate, spec.cascade_rate)
            if body.get("logprobs"):
                logprobs = token_logprobs(content, rng)
        elif structured is not None:
            known = self.index.find(structured.texts)
            skill = spec.skill_for(known.task if known else None)
            content, kind, _, _ = record_reply(structured, known, skill, rng, f.malformed_json,
                                               lambda: draw(self.seed, model, request_hash + "/fault"))
            kinds = (kind, "repair") if structured.repair else (kind,)
        else:
            known = self.index.find(texts)
            content, _ = reply(known, spec.skill_for(known.task if known else None), rng, self.index)
        refused = f.refusal_rate > 0 and draw(self.seed, model, request_hash + "/refusal").random() < f.refusal_rate
        if refused:
            content, logprobs, kinds = REFUSAL, None, ()
        return Answer(content=content, logprobs=logprobs, query_id=known.query_id if known else None,
                      kinds=kinds, prompt_tokens=billed_prompt_tokens(body, texts),
                      completion_tokens=tokenizer_tokens(content), request_hash=request_hash, refused=refused)

    def count_answer(self, answer: Answer, log: SimLog | None = None) -> None:
        """Counts a delivered answer by known query and structured kind (in `log`: the log
        its request arrived under)."""
        log = log or self.log
        if answer.query_id is not None:
            log.by_query[answer.query_id] += 1
        for kind in answer.kinds:
            log.by_kind[kind] += 1

    def reset(self) -> None:
        """Starts a new request log and clears the rpm windows (not the fault overrides, files or
        batches). A request still in flight from before logs into the old log: a test's log never
        counts what an earlier test left running."""
        self.log = SimLog()
        for w in self._windows.values():
            w.clear()

    async def admin_faults(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            try:
                body = orjson.loads(await request.read() or b"{}")
                if not isinstance(body, dict):
                    raise SimConfigError("faults: the body must be a JSON object")
                if body.pop("clear", False):
                    self.clear_faults()
                model = body.pop("model", "*")
                if body:
                    self.set_faults(model, body)
            except (orjson.JSONDecodeError, SimConfigError) as e:
                return self._error(400, str(e), "invalid_request_error")
        return web.Response(body=orjson.dumps(self.faults_json()), content_type=_JSON)

    # -- helpers -------------------------------------------------------------

    def _authorized(self, request: web.Request, expected: bytes) -> bool:
        auth = request.headers.get("Authorization", "")
        scheme, _, given = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)

    def _rpm_check(self, model: str, f: Faults) -> web.Response | None:
        window = self._windows[model]
        now = time.monotonic()
        while window and window[0] <= now - f.rpm_window_s:
            window.popleft()
        if len(window) < f.rpm:  # type: ignore[operator]
            return None
        wait = max(0.001, window[0] + f.rpm_window_s - now)
        limit = f"{f.rpm:g}"
        return self._error(
            429, f"Rate limit reached for {model} on requests per min (RPM): Limit {limit}, Used {len(window)}. "
                 f"Please try again in {wait:.3f}s. (simulated)",
            "requests", code="rate_limit_exceeded", model=model,
            headers={"Retry-After": str(max(1, math.ceil(wait))), "retry-after-ms": str(math.ceil(wait * 1000)),
                     "x-ratelimit-limit-requests": limit, "x-ratelimit-remaining-requests": "0",
                     "x-ratelimit-reset-requests": f"{wait:.3f}s"})

    def _admit(self, model: str, f: Faults) -> None:
        if f.rpm is not None:
            self._windows[model].append(time.monotonic())

    def _latency(self, f: Faults, completion_tokens: int) -> float:
        mean, sd = f.latency_ms, f.latency_sd_ms
        ms = 0.0
        if mean > 0:
            if sd > 0:
                sigma2 = math.log1p((sd / mean) ** 2)
                ms = self._rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
            else:
                ms = mean
        return (ms + f.per_token_ms * completion_tokens) / 1000.0

    def _reject(self, r: Rejection) -> web.Response:
        return self._error(r.status, r.message, r.type, param=r.param, code=r.code, model=r.model,
                           headers=r.headers)

    def _error(self, status: int, message: str, type_: str, *, param: str | None = None,
               code: str | None = None, model: str | None = None,
               headers: dict[str, str] | None = None) -> web.Response:
        self.log.status(str(status), model)
        body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
        h = {"x-conductor-simulated": "1"}
        if headers:
            h.update(headers)
        return web.Response(status=status, body=orjson.dumps(body), content_type=_JSON, headers=h)


def billed_prompt_tokens(body: dict[str, Any], texts: list[str]) -> int:
    """The prompt tokens a provider bills: the messages' text and, as OpenAI does, what it writes
    into the prompt from the parameters (a response_format's JSON Schema, tools, a forced tool; of
    the list the client's estimate and bound count, conductor.tokens.PROMPT_PARAMS, so the bill
    stays within the bound budgets reserve). Without them a structured job's cost against the sim
    understated a provider's."""
    shown = dict(body)
    rf = body.get("response_format")
    if not (isinstance(rf, dict) and rf.get("type") == "json_schema"):
        shown.pop("response_format", None)  # {"type": "text"} or json_object: no schema to write
    for k in ("tool_choice", "function_call"):
        if isinstance(shown.get(k), str):
            del shown[k]  # "auto", "none": no text either
    return sum(map(tokenizer_tokens, texts)) + sum(tokenizer_tokens(p.decode()) for p in prompt_params(shown))


def _check_request(body: dict[str, Any]) -> tuple[str, str] | None:
    """(param, message) of the first problem, or None."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages", "'messages' is required and must be a non-empty array."
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"messages[{i}]", f"messages[{i}] must be an object with a string 'role'."
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            return f"messages[{i}].content", f"messages[{i}].content must be a string or an array of parts."
    if body.get("stream"):
        return "stream", "This simulated server supports only non-streaming requests ('stream': false)."
    n = body.get("n")
    if n is not None and n != 1:
        return "n", "This simulated server supports only n=1."
    return None


def build_app(server: SimServer) -> web.Application:
    app = openai_app(server, faults=True)
    server.batch_api.add_routes(app)
    return app
