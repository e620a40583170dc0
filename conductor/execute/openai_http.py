"""A direct OpenAI-compatible chat client on aiohttp, for workers with an `api_base`
(the simulated pool, vLLM, any OpenAI-compatible server).

litellm costs several times the HTTP call's own CPU per call (its response object,
cost calculator and logging), which caps a batch job on a small machine; this client
posts the JSON body and reads the JSON answer, nothing else. Every other provider
still goes through litellm (`call.complete`). The contract is `complete()`'s: no
retries here (the executor retries through its limiter), `timeout_s` bounds the
whole attempt, error bodies are cut at MAX_ERROR_BODY_BYTES before they are read,
and a 200 whose shape is wrong is a `malformed` failure of that call only.
"""

from __future__ import annotations

import asyncio
import base64
import math
from typing import Any, Callable

import aiohttp
import orjson
import yarl

from conductor.execute.call import (MAX_ANSWER_BYTES, MAX_ERROR_BODY_BYTES, MAX_ERROR_CHARS, CallFailure,
                                    CallRequest, CallResponse, RETRYABLE_STATUS, _cut, _retry_after, _tokens, _usd,
                                    answer_text, billed_if_unusable, completion_logprob, estimate_tokens, redact)


def direct_model(api_base: str | None, model: str | None) -> str | None:
    """The model name this client sends for a worker, or None when the worker's calls go
    through litellm: only an `openai/` model with an api_base is sent directly."""
    if api_base and model and model.startswith("openai/"):
        return model.split("/", 1)[1]
    return None


class RateHeaders:
    """What `x-ratelimit-*-requests` headers said: requests left in the provider's
    window and seconds until it resets (None when a header is absent)."""

    __slots__ = ("remaining", "reset_s")

    def __init__(self, remaining: float | None, reset_s: float | None):
        self.remaining = remaining
        self.reset_s = reset_s


class OpenAIEndpoint:
    """One HTTP session for one endpoint and key for a run: connections are reused
    across calls. Create it inside the event loop that uses it; `await close()` at
    the end of the run."""

    direct = True  # `call.complete` sends through `send` instead of litellm

    def __init__(self, api_base: str, api_key: str | None, track_sent: bool = False):
        url = yarl.URL(api_base.rstrip("/") + "/chat/completions")
        # `user:password@` (a gateway with Basic auth): aiohttp refuses it beside an Authorization
        # header, so it goes out as that header, in place of the key, and never in the URL
        self.url = str(url.with_user(None))
        basic = None
        if url.user is not None:  # yarl gives them decoded (%40 as @)
            basic = "Basic " + base64.b64encode(f"{url.user}:{url.password or ''}".encode()).decode("ascii")
        self._headers = {"Content-Type": "application/json", "Accept": "application/json",
                         "Authorization": basic or f"Bearer {api_key or 'no-key'}"}
        self._api_key = api_key
        self._session: aiohttp.ClientSession | None = None
        self._track_sent = track_sent  # call `send`'s `sent` when a request's headers are out (costs a little)

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            # no pool limit here: the provider's limiter bounds calls in flight
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
            # no session deadline either: `timeout_s` bounds each attempt (asyncio.timeout)
            traces = []
            if self._track_sent:
                trace = aiohttp.TraceConfig()
                trace.on_request_headers_sent.append(_headers_sent)
                traces.append(trace)
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False,
                                                  timeout=aiohttp.ClientTimeout(total=None),
                                                  skip_auto_headers=("User-Agent",), trace_configs=traces)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(self, req: CallRequest, sent: Callable[[], None] | None = None) -> CallResponse:
        model = req.model.split("/", 1)[1] if req.model.startswith("openai/") else req.model
        body = {"model": model, "messages": req.messages,
                **{k: v for k, v in req.params.items() if v is not None}}
        headers = self._headers
        if req.request_id:
            headers = {**headers, "X-Conductor-Request": req.request_id}
        session = self._open()
        try:
            async with asyncio.timeout(req.timeout_s):
                async with session.post(self.url, data=orjson.dumps(body), headers=headers,
                                        trace_request_ctx=sent) as resp:  # type: ignore[arg-type]
                    if resp.status >= 400:
                        raise await self._failure(resp)
                    raw = await _read_capped(resp)
                    resp_headers = resp.headers
        except CallFailure:
            raise
        except TimeoutError:
            raise CallFailure("timeout", f"Timeout: no complete answer within timeout_s={req.timeout_s:g} s") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
            raise CallFailure("connection", _cut(redact(f"connection error: {type(e).__name__}: {e}",
                                                        self._api_key))) from None
        except aiohttp.ClientError as e:
            raise CallFailure("other", _cut(redact(f"{type(e).__name__}: {e}", self._api_key))) from None
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            # A gateway's error page may echo the request's Authorization header: redacted whole, then cut.
            page = _cut(redact(raw[:MAX_ERROR_BODY_BYTES].decode("utf-8", "replace"), self._api_key), 200)
            raise CallFailure("malformed", f"malformed response: not JSON ({e}): {page!r}") from None
        try:
            return read_answer(req, doc, resp_headers)
        except CallFailure as f:  # a refusal's text may echo the request's headers
            raise f.reworded(_cut(redact(str(f), self._api_key))) from None
        except Exception as e:  # whatever else a malformed answer raises fails this call only
            raise CallFailure("malformed", _cut(redact(f"malformed response: {type(e).__name__}: {e}",
                                                       self._api_key), 200)) from None

    async def _failure(self, resp: aiohttp.ClientResponse) -> CallFailure:
        """The error response as a classified failure; its body is read up to the cap only."""
        status = resp.status
        body = b""
        cut = False
        while len(body) <= MAX_ERROR_BODY_BYTES:
            chunk = await resp.content.read(MAX_ERROR_BODY_BYTES + 1 - len(body))
            if not chunk:
                break
            body += chunk
        if len(body) > MAX_ERROR_BODY_BYTES:
            cut = True
            body = body[:MAX_ERROR_BODY_BYTES]
        text = _error_text(body)
        if cut:  # redacted before it is cut, or a key split by the cut would stay
            text = f"(cut: the error body is larger than {MAX_ERROR_BODY_BYTES >> 10} KiB) " \
                   f"{_cut(redact(text, self._api_key), MAX_ERROR_CHARS // 2)}..."
        message = _cut(redact(f"HTTP {status}: {text}", self._api_key))
        retry_after = _retry_after(resp.headers)
        failure = CallFailure(_kind(status), message, status,
                              retry_after if status in RETRYABLE_STATUS or status >= 500 else None)
        failure.rate = rate_headers(resp.headers)
        failure.headers_seen = True
        return failure


async def _read_capped(resp: aiohttp.ClientResponse) -> bytes:
    """The 200's body, up to MAX_ANSWER_BYTES: a server streaming without end would
    otherwise fill memory, then the cache and the journal."""
    if (resp.content_length or 0) > MAX_ANSWER_BYTES:
        raise CallFailure("malformed", f"malformed response: a body of {resp.content_length:,} bytes, over the "
                                       f"{MAX_ANSWER_BYTES >> 20} MiB a chat answer may be")
    parts, size = [], 0
    while chunk := await resp.content.read(1 << 20):
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise CallFailure("malformed", f"malformed response: the body is over the {MAX_ANSWER_BYTES >> 20} MiB "
                                           f"a chat answer may be")
        parts.append(chunk)
    return b"".join(parts)


async def _headers_sent(session: Any, ctx: Any, params: Any) -> None:
    """aiohttp's trace hook: the request is on its connection; tell the rate limiter."""
    if ctx.trace_request_ctx is not None:
        ctx.trace_request_ctx()


def _kind(status: int) -> str:
    if status == 429:
        return "rate_limit"
    if status == 408:
        return "timeout"
    if status in (401, 403):
        return "auth"
    if status in RETRYABLE_STATUS or status >= 500:
        return "server"
    return "client"


def _error_text(body: bytes) -> str:
    """The provider's message from an OpenAI-style error body, else the body as text."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    if isinstance(err, str):
        return err
    return body.decode("utf-8", "replace")


def rate_headers(headers: Any) -> RateHeaders | None:
    """`x-ratelimit-remaining-requests` and `x-ratelimit-reset-requests` ("1s", "6m0s",
    "20ms" or seconds), when the provider sends them."""
    remaining = headers.get("x-ratelimit-remaining-requests")
    if remaining is None:
        return None
    try:
        left = float(remaining)
    except ValueError:
        return None
    return RateHeaders(left, parse_duration(headers.get("x-ratelimit-reset-requests")))


def parse_duration(text: str | None) -> float | None:
    """OpenAI's reset durations: "1s", "6m0s", "1h2m3.5s", "20ms", or plain seconds."""
    if not text:
        return None
    try:
        seconds = float(text)
        return seconds if 0 <= seconds < math.inf else None
    except ValueError:
        pass
    total, num = 0.0, ""
    i = 0
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    while i < len(text):
        c = text[i]
        if c.isdigit() or c == ".":
            num += c
            i += 1
            continue
        unit = "ms" if text.startswith("ms", i) else c
        if unit not in units or not num:
            return None
        try:
            total += float(num) * units[unit]
        except ValueError:
            return None
        num = ""
        i += len(unit)
    return total if not num else None


def read_answer(req: CallRequest, doc: Any, headers: Any) -> CallResponse:
    """The answer's text and usage after checking its shape, as `call._read_response`
    does for litellm's objects."""
    if not isinstance(doc, dict):
        raise CallFailure("malformed", f"malformed response: the body is a {type(doc).__name__}, not an object")
    choices = doc.get("choices")
    if not choices or not isinstance(choices, list):
        raise CallFailure("malformed", "malformed response: no choices")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise CallFailure("malformed", "malformed response: choice 0 has no message")
    usage = doc.get("usage")
    pt = _tokens(usage.get("prompt_tokens")) if isinstance(usage, dict) else None
    ct = _tokens(usage.get("completion_tokens")) if isinstance(usage, dict) else None
    with billed_if_unusable(pt, ct, headers.get("x-conductor-cost-usd")):
        text = answer_text(message.get("content"), message.get("refusal") or choice.get("finish_reason"))
    reported = pt is not None and ct is not None
    estimated = not reported or headers.get("x-conductor-usage-estimated") == "1"
    if pt is None:
        pt = estimate_tokens(req.messages)
    if ct is None:
        ct = math.ceil(len(text) / 4)
    simulated = doc.get("system_fingerprint") == "conductor-sim" or headers.get("x-conductor-simulated") == "1"
    return CallResponse(text, pt, ct, estimated, simulated, choice.get("finish_reason"),
                        completion_logprob(choice), _usd(headers.get("x-conductor-cost-usd")),
                        usage_reported=reported, rate=rate_headers(headers))
