"""The one function through which every provider call goes.

litellm's own retries are off (`num_retries=0`, `max_retries=0`): a retry that
happens inside the call bypasses our rate limiter and budget. Failures come
back as a `CallFailure` that says whether to retry and how long the provider
asked us to wait.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from conductor.tokens import estimate_tokens, max_prompt_tokens, tokens_from_chars  # noqa: F401  (re-exported)

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def _litellm() -> Any:
    """litellm, imported on the first call: importing it takes seconds, which every
    command (`--help`, `conductor sql`) would otherwise pay."""
    import litellm

    # litellm prints a "Give Feedback" banner to stdout on every exception unless
    # told not to; a batch job's output must stay clean. This is the library's only
    # switch for it.
    litellm.suppress_debug_info = True
    return litellm


def __getattr__(name: str) -> Any:  # `from conductor.execute.call import litellm` still works
    if name == "litellm":
        return _litellm()
    raise AttributeError(name)

# Error messages kept in traces and journals are cut to this many characters (a provider
# may answer a 400 with megabytes of body).
MAX_ERROR_CHARS = 2000
# No model writes an answer near this long (about a million tokens): a longer one is a
# broken server, failed as malformed before it is cached, journaled and paid for again.
MAX_ANSWER_CHARS = 4_000_000
MAX_ANSWER_BYTES = 64 << 20  # the whole JSON body of a 200, logprobs included

RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504, 520, 521, 522, 524, 529}


@dataclass(frozen=True)
class CallRequest:
    model: str
    messages: list[dict[str, str]]
    params: dict[str, Any] = field(default_factory=dict)
    api_base: str | None = None
    timeout_s: float = 120.0
    request_id: str | None = None  # sent as X-Conductor-Request to OpenAI-compatible endpoints, for tracing
    # the endpoint's client for the run: an openai_http.OpenAIEndpoint (sent directly), or
    # None (litellm's own)
    client: Any = None


@dataclass(frozen=True)
class CallResponse:
    text: str
    prompt_tokens: int
    completion_tokens: int
    usage_estimated: bool
    simulated: bool
    finish_reason: str | None = None
    logprob: float | None = None  # sum of the sampled tokens' log-probabilities, when the provider sent them
    cost_usd: float | None = None  # what the server says the call cost (the replay server's recorded cost)
    warning: str | None = None  # reported usage that could not be right (clamped for budgets)
    usage_reported: bool = True  # False: no valid usage in the answer (missing, negative, not a number)
    rate: Any = None  # x-ratelimit-* headers the provider sent (openai_http.RateHeaders), for the limiter


class CallFailure(Exception):
    """A failed call, classified. `message` never holds the API key: callers redact the
    provider's key, and every secret of the environment is masked here."""

    def __init__(self, kind: str, message: str, status: int | None = None,
                 retry_after: float | None = None):
        super().__init__(redact(message))
        self.kind = kind  # rate_limit | server | timeout | connection | auth | client | malformed | other
        self.status = status
        self.retry_after = retry_after
        self.rate: Any = None  # x-ratelimit-* headers sent with the failure (openai_http.RateHeaders)
        self.headers_seen = False  # True when the response's headers were read (the direct client)
        # A 200 without a usable answer (a refusal, a content filter, an answer past the limits) was
        # billed all the same: the executor charges it though nothing is kept, at the usage it
        # reported (prompt, completion), else at the request's bounds, as an answer without usage.
        self.billed = False
        self.usage: tuple[int, int] | None = None
        self.cost_usd: float | None = None  # what the server says that answer cost (x-conductor-cost-usd)
        self.charged: Any = None  # what the executor charged for it (failure.Billed), for batch lines

    def reworded(self, message: str) -> "CallFailure":
        """The same failure with another message (redacted again), keeping what it carries."""
        again = CallFailure(self.kind, message, self.status, self.retry_after)
        again.rate, again.headers_seen = self.rate, self.headers_seen
        again.billed, again.usage, again.cost_usd, again.charged = self.billed, self.usage, self.cost_usd, self.charged
        return again

    @property
    def retryable(self) -> bool:
        return self.kind in ("rate_limit", "server", "timeout", "connection")


def maybe_billed(f: CallFailure) -> bool:
    """Cut off by timeout_s with no status: the provider may still answer, and bill, the request."""
    return f.kind == "timeout" and f.status is None and not f.billed


async def complete(req: CallRequest, api_key: str | None, sent: Callable[[], None] | None = None) -> CallResponse:
    """One attempt. A request whose `client` is a direct OpenAI-compatible client
    (openai_http.OpenAIEndpoint) goes through it, which calls `sent` once the request
    has left (for the rate limiter); any other through litellm."""
    if getattr(req.client, "direct", False):
        return await req.client.send(req, sent)
    try:
        # timeout_s bounds the whole attempt: the HTTP client's timeout is per read, so a
        # server trickling a byte at a time would hold the call for ever
        resp = await asyncio.wait_for(_litellm().acompletion(
            model=req.model,
            messages=req.messages,
            api_base=req.api_base,
            api_key=api_key,
            timeout=req.timeout_s,
            num_retries=0,
            max_retries=0,
            **({"extra_headers": {"X-Conductor-Request": req.request_id}} if req.request_id and req.api_base else {}),
            **({"client": req.client} if req.client is not None else {}),
            **req.params,
        ), req.timeout_s)
    except asyncio.TimeoutError:
        raise CallFailure("timeout", f"Timeout: no complete answer within timeout_s={req.timeout_s:g} s") from None
    except Exception as e:  # litellm maps provider errors onto many classes
        raise classify(e, api_key) from None
    try:
        return _read_response(req, resp)
    except CallFailure as f:  # a refusal's text may echo the request's headers
        raise f.reworded(_cut(redact(str(f), api_key))) from None
    except Exception as e:  # whatever else a malformed answer raises fails this call only
        raise CallFailure("malformed", _cut(redact(f"malformed response: {type(e).__name__}: {e}", api_key),
                                            200)) from None


def answer_text(content: Any, why_none: Any = None) -> str:
    """The message's content if it is text of a sane length; else a malformed answer.
    No content (a refusal, a content filter, tool calls only) is no answer to keep or
    cache; `why_none` (the refusal or finish reason) says why."""
    if content is None:
        raise CallFailure("malformed", "malformed response: no text content"
                          + (f" ({str(why_none)[:MAX_ERROR_BODY_BYTES]})" if why_none else ""))  # callers redact, then cut
    if not isinstance(content, str):
        raise CallFailure("malformed", f"malformed response: content is {type(content).__name__}, not text")
    if len(content) > MAX_ANSWER_CHARS:
        raise CallFailure("malformed", f"malformed response: an answer of {len(content):,} characters, more than "
                                       f"any model writes (the limit is {MAX_ANSWER_CHARS:,})")
    return content


@contextmanager
def billed_if_unusable(prompt_tokens: int | None, completion_tokens: int | None, cost_header: Any) -> Iterator[None]:
    """A 200 whose answer cannot be kept was billed: the CallFailure says so, with the usage it
    reported (and any server-reported cost), so the call is charged."""
    try:
        yield
    except CallFailure as f:
        f.billed = True
        if prompt_tokens is not None and completion_tokens is not None:
            f.usage = (prompt_tokens, completion_tokens)
        f.cost_usd = _usd(cost_header)
        raise


def _read_response(req: CallRequest, resp: Any) -> CallResponse:
    """The response's text and usage, after checking its shape: a provider answering
    200 with no choices, no message or non-text content is a classified failure."""
    choices = getattr(resp, "choices", None)
    if not choices:
        raise CallFailure("malformed", "malformed response: no choices")
    choice = choices[0]
    message = getattr(choice, "message", None)
    if message is None:
        raise CallFailure("malformed", "malformed response: choice 0 has no message")
    usage = getattr(resp, "usage", None)
    pt = _tokens(getattr(usage, "prompt_tokens", None)) if usage else None
    ct = _tokens(getattr(usage, "completion_tokens", None)) if usage else None
    headers = (getattr(resp, "_hidden_params", None) or {}).get("additional_headers") or {}
    with billed_if_unusable(pt, ct, headers.get("llm_provider-x-conductor-cost-usd")):
        text = answer_text(getattr(message, "content", None),
                           getattr(message, "refusal", None) or getattr(choice, "finish_reason", None))
    # A server that only estimated the usage it reports says so (the replay server does).
    estimated = pt is None or ct is None or headers.get("llm_provider-x-conductor-usage-estimated") == "1"
    reported = pt is not None and ct is not None
    if pt is None:
        pt = estimate_tokens(req.messages, req.params)
    if ct is None:
        ct = tokens_from_chars(len(text))
    simulated = (getattr(resp, "system_fingerprint", None) == "conductor-sim"
                 or headers.get("llm_provider-x-conductor-simulated") == "1")
    return CallResponse(text, int(pt), int(ct), estimated, simulated, getattr(choice, "finish_reason", None),
                        completion_logprob(choice), _usd(headers.get("llm_provider-x-conductor-cost-usd")),
                        usage_reported=reported)


def _tokens(value: Any) -> int | None:
    """A reported token count: an integer >= 0, else None (then estimated)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return int(value)


def _usd(value: Any) -> float | None:
    """A server-reported cost (header `x-conductor-cost-usd`): a finite number >= 0, else None."""
    try:
        usd = float(value)
    except (TypeError, ValueError):
        return None
    return usd if math.isfinite(usd) and usd >= 0 else None


def completion_logprob(choice: Any) -> float | None:
    """Sum of the per-token log-probabilities in an OpenAI-style choice; None without them."""
    lp = getattr(choice, "logprobs", None)
    if lp is None and isinstance(choice, dict):
        lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else getattr(lp, "content", None)
    if not content:
        return None
    total = 0.0
    for tok in content:
        v = tok.get("logprob") if isinstance(tok, dict) else getattr(tok, "logprob", None)
        if not isinstance(v, (int, float)):
            return None
        total += float(v)
    return total


# litellm reports a 200 whose body it cannot read as a 500 InternalServerError with one of these.
_MALFORMED_MARKERS = ("Invalid response object", "Expecting value: line", "provider returned 'choices'",
                      "JSONDecodeError")


def classify(e: Exception, api_key: str | None) -> CallFailure:
    status = getattr(e, "status_code", None)
    if not isinstance(status, int):
        status = None
    message = _cut(redact(f"{type(e).__name__}: {e}", api_key))
    retry_after = _retry_after(getattr(e, "litellm_response_headers", None))
    name = type(e).__name__
    if any(m in message for m in _MALFORMED_MARKERS):
        return CallFailure("malformed", "malformed response: " + message.split(" Traceback ", 1)[0].strip())
    if status == 429 or name == "RateLimitError":
        return CallFailure("rate_limit", message, 429, retry_after)
    if name in ("Timeout", "APITimeoutError") or status == 408:
        return CallFailure("timeout", message, status, retry_after)
    # litellm reports a dropped or refused connection as a 500 "Connection error."
    if name == "APIConnectionError" or isinstance(e, (ConnectionError, OSError)) or "Connection error" in str(e):
        return CallFailure("connection", message, status, retry_after)
    if status in (401, 403) or name in ("AuthenticationError", "PermissionDeniedError"):
        return CallFailure("auth", message, status)
    if status is not None and status in RETRYABLE_STATUS:
        return CallFailure("server", message, status, retry_after)
    if status is not None and 500 <= status < 600:
        return CallFailure("server", message, status, retry_after)
    if status is not None and 400 <= status < 500:
        return CallFailure("client", message, status)
    if name in ("InternalServerError", "ServiceUnavailableError", "BadGatewayError"):
        return CallFailure("server", message, status, retry_after)
    return CallFailure("other", message, status)


# Error bodies are read up to this many bytes (the direct client); a longer one is cut.
MAX_ERROR_BODY_BYTES = 64 << 10


def _cut(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """The first `limit` characters. Redact before cutting: a key cut in two is not found."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"... (cut: {len(text):,} characters)"


def _retry_after(headers: Any) -> float | None:
    """Seconds to wait, from `retry-after-ms` or `Retry-After` (seconds or an HTTP date)."""
    if not headers:
        return None
    get = headers.get
    ms = get("retry-after-ms") or get("Retry-After-Ms")
    if ms:
        try:
            if 0 <= (wait := float(ms) / 1000.0) < math.inf:  # not NaN, -5 or inf: backoff instead
                return wait
        except ValueError:
            pass
    ra = get("retry-after") or get("Retry-After")
    if ra:
        try:
            wait = float(ra)
            return wait if 0 <= wait < math.inf else None
        except ValueError:
            from email.utils import parsedate_to_datetime
            try:
                return max(0.0, parsedate_to_datetime(ra).timestamp() - time.time())
            except (TypeError, ValueError):
                return None
    return None


def redact(text: str, *secrets: str | None) -> str:
    """`text` without the given keys nor any secret of the environment (conductor.masking)."""
    from conductor.masking import mask

    return mask(text, *secrets)
