"""What the simulated server makes of one chat request, apart from HTTP: an
answer or a refusal. Online chat and batch lines share these, so a batch line
gets exactly the answer (or error) the same body gets online."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from conductor.sim.config import Faults

FINGERPRINT = "conductor-sim"
REFUSAL = "I'm sorry, but I can't help with that request. (simulated)"


@dataclass(frozen=True)
class Rejection:
    """An error reply in OpenAI's shape: status and {"error": {...}}."""

    status: int
    message: str
    type: str = ""
    param: str | None = None
    code: str | None = None
    model: str | None = None
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if not self.type:
            object.__setattr__(self, "type", "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Answer:
    content: str
    logprobs: dict[str, Any] | None
    query_id: str | None
    kinds: tuple[str, ...]
    prompt_tokens: int
    completion_tokens: int
    request_hash: str
    refused: bool = False  # content null, the refusal in `content`'s place (still billed)

    def payload(self, model: str, created: int, usage_factor: float) -> dict[str, Any]:
        """The chat completion body; usage as reported (billed tokens x usage_factor)."""
        reported = [int(n * usage_factor) for n in (self.prompt_tokens, self.completion_tokens)]
        message = ({"role": "assistant", "content": None, "refusal": self.content} if self.refused
                   else {"role": "assistant", "content": self.content})
        return {
            "id": f"chatcmpl-sim-{self.request_hash[:24]}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "message": message, "logprobs": self.logprobs, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": reported[0], "completion_tokens": reported[1],
                      "total_tokens": sum(reported)},
        }


def unauthorized(model: str) -> Rejection:
    return Rejection(401, "Incorrect API key provided", code="invalid_api_key", model=model)


def failed_status(model: str, f: Faults) -> Rejection:
    status = int(f.fail_status)  # type: ignore[arg-type]
    return Rejection(status, f"Simulated failure with status {status}.", model=model)


def server_error(model: str, status: int) -> Rejection:
    return Rejection(status, "The server had an error while processing your request. (simulated)", model=model)


def rate_limited(model: str, f: Faults) -> Rejection:
    wait_ms = f.retry_after_ms
    return Rejection(429, f"Rate limit reached for {model}. Please try again in {wait_ms / 1000:g}s. (simulated)",
                     "requests", code="rate_limit_exceeded", model=model,
                     headers={"Retry-After": str(max(1, math.ceil(wait_ms / 1000))),
                              "retry-after-ms": str(int(wait_ms))})
