"""Token counts estimated from text, one rule everywhere a count is not reported:
characters / 4, rounded half to even (unbiased: the figure the shared replay data's
reference costs are computed with). The executor (rate limits, budget reservations, a
provider that reports no usage) and the replay server (a table without recorded
usage) count this way, so their figures agree. The simulated pool bills as a
provider's tokenizer would (`tokenizer_tokens`): the same for ASCII text, about a
token a character for other scripts, which is what budget tests need to see."""

from __future__ import annotations

from typing import Any, Mapping

import orjson

CHARS_PER_TOKEN = 4
MESSAGE_FRAMING_TOKENS = 4  # role and separators a chat template adds per message
MESSAGE_FRAMING_BOUND = 8  # their bound, beside a message's UTF-8 bytes (max_prompt_tokens)
# Request parameters a provider writes into the prompt it tokenizes, and bills as prompt tokens
# (OpenAI's chat API, as litellm passes it): a response_format's JSON Schema, tool and function
# definitions, a forced tool or function. Each counts as one more message: its JSON and framing.
PROMPT_PARAMS = ("response_format", "tools", "tool_choice", "functions", "function_call")


def tokens_from_chars(chars: Any) -> Any:
    """Characters / 4, rounded half to even, and at least 1 for any text: a one-letter answer
    ("B") is a token, and 0 for text is what the executor takes for lying usage. Takes an int
    or a polars expression. Budget reservations do not use it: they need a bound (max_prompt_tokens)."""
    if isinstance(chars, int):
        return max(round(chars / CHARS_PER_TOKEN), 1 if chars > 0 else 0)
    import polars as pl

    return pl.max_horizontal((chars / CHARS_PER_TOKEN).round(0).cast(int), (chars > 0).cast(int))


def prompt_params(params: Mapping[str, Any] | None) -> list[bytes]:
    """The JSON of each request parameter billed as prompt (PROMPT_PARAMS), as it is sent."""
    if not params:
        return []
    return [orjson.dumps(params[k], option=orjson.OPT_NON_STR_KEYS) for k in PROMPT_PARAMS
            if params.get(k) is not None]


def estimate_tokens(messages: list[dict[str, str]], params: Mapping[str, Any] | None = None) -> int:
    """A prompt's tokens, plus a few of framing per message: cheap, and close enough for
    rate limits, which reconcile afterwards. `params`: the request's, whose schema and tools
    are prompt too (prompt_params)."""
    return prompt_tokens(messages, params)[0]


def prompt_tokens(messages: list[dict[str, str]], params: Mapping[str, Any] | None = None) -> tuple[int, int]:
    """(estimate_tokens, max_prompt_tokens) of one request, its params serialized once: the
    executor needs both for every call."""
    extra = prompt_params(params)
    estimate = (sum(tokens_from_chars(len(m.get("content") or "")) + MESSAGE_FRAMING_TOKENS for m in messages)
                + sum(tokens_from_chars(len(p.decode())) + MESSAGE_FRAMING_TOKENS for p in extra))
    bound = (sum(len((m.get("content") or "").encode("utf-8", "surrogatepass")) + MESSAGE_FRAMING_BOUND
                 for m in messages)
             + sum(len(p) + MESSAGE_FRAMING_BOUND for p in extra))
    return estimate, bound


def tokenizer_tokens(text: str) -> int:
    """Roughly what a BPE tokenizer bills: four ASCII characters a token, and a token
    for each other character (CJK text is about one token a character)."""
    ascii_chars = len(text) if text.isascii() else len(text.encode("ascii", "ignore"))
    return tokens_from_chars(ascii_chars) + (len(text) - ascii_chars)


def max_prompt_tokens(messages: list[dict[str, str]], params: Mapping[str, Any] | None = None) -> int:
    """An upper bound on a request's prompt tokens in any script and tokenizer: the UTF-8
    bytes of its messages and of the parameters billed as prompt (`params`: the request's;
    a JSON Schema in response_format, tools), plus framing for each (a byte-level tokenizer
    never makes a token of less than one byte). The one bound of budget reservations, the
    clamp on reported usage and preflight worst cases: left without the request's params,
    each undershot a structured call's honest usage."""
    return prompt_tokens(messages, params)[1]
