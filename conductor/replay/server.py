"""The replay server: an OpenAI-compatible HTTP server (aiohttp) that answers with
real recorded responses, and with a labeled error for anything not recorded.

A request is answered only when its model replays a recorded model and its
messages are exactly one user message holding a recorded question, word for word
(leading and trailing whitespace aside, which plan parsing trims): then the answer
is that model's recorded response to that question. Anything else
(a model the table does not hold, a question the model never saw, an instruction
that is not the original question, extra turns or a system message) gets HTTP 422
with an OpenAI-style error whose message starts "not recorded:". 422 is a client
error the executor records per step without marking the worker dead.

Usage is the table's recorded token counts when it has them; otherwise
characters / 4 (rounded half to even), flagged by the header
`x-conductor-usage-estimated: 1` so traces mark it as estimated. A row with a
recorded `cost_usd` sends it in the header `x-conductor-cost-usd` (a decimal
number of USD), which the executor charges instead of tokens x price.

Endpoints: POST /v1/chat/completions, GET /v1/models, GET /health, and for tests
GET /admin/log, POST /admin/reset.
"""

from __future__ import annotations

import hashlib
import time
from urllib.parse import quote
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import polars as pl
from aiohttp import web

from conductor.errors import ConductorError
from conductor.localserver import LocalServer, RequestLog, message_text, openai_app
from conductor.pool import Pool
from conductor.replay.tables import COST_COLUMN, read_table, replay_source, replay_workers, with_tokens

FINGERPRINT = "conductor-replay"
_JSON = "application/json"
_PREFIX_CHARS = 48  # enough of a question's start to recognize it with something appended
_RECENT = 50


@dataclass(frozen=True)
class Recorded:
    question_id: str
    response: str
    prompt_tokens: int
    completion_tokens: int
    estimated: bool
    cost_usd: float | None = None  # recorded dollars of this response, when the table has them


class ReplayIndex:
    """Recorded responses by (model, question text), for the models a pool replays."""

    def __init__(self, table: Path, models: set[str]):
        self.table = Path(table)
        cols = ["question_id", "question", "model", "response"]
        t = read_table(self.table, cols)
        known = set(t.get_column("model").unique().to_list())
        missing = sorted(models - known)
        if missing:
            raise ConductorError(f"replay table {self.table} has no responses of model(s) {', '.join(missing)} "
                                 f"(it holds {len(known)} models); fix the pool's workers")
        t = with_tokens(t.filter(pl.col("model").is_in(sorted(models))))
        cost = pl.col(COST_COLUMN) if COST_COLUMN in t.columns else pl.lit(None, dtype=pl.Float64)
        rows = t.select(*cols, "tokens_in", "tokens_out", "tokens_estimated", cost).iter_rows()
        self.question_ids: dict[str, str] = {}
        self.responses: dict[tuple[str, str], Recorded] = {}
        for qid, question, model, response, pt, ct, estimated, usd in rows:
            # A question asked twice under two ids: the first row in table order answers.
            self.question_ids.setdefault(question, qid)
            self.responses.setdefault((model, question),
                                      Recorded(qid, response or "", int(pt), int(ct), bool(estimated), usd))
        # Plan parsing trims instructions, and 73 MMLU-Pro questions start or end with
        # whitespace: such whitespace is the only difference from the question let through.
        self._trimmed: dict[str, str] = {}
        for q in self.question_ids:
            self._trimmed.setdefault(q.strip(), q)
        self.models = sorted(models)
        self._by_prefix: dict[str, list[str]] = {}
        for q in self.question_ids:
            self._by_prefix.setdefault(q.strip()[:_PREFIX_CHARS], []).append(q.strip())

    def question(self, text: str) -> str | None:
        """The recorded question `text` is, exactly or but for leading and trailing whitespace."""
        if text in self.question_ids:
            return text
        return self._trimmed.get(text.strip())

    def near(self, text: str) -> str | None:
        """A recorded question that `text` starts with, or that starts with `text`:
        for telling the user their instruction was altered."""
        text = text.strip()
        for q in self._by_prefix.get(text[:_PREFIX_CHARS], ()):
            if text.startswith(q) or q.startswith(text):
                return q
        return None


class ReplayLog(RequestLog):
    def reset(self) -> None:
        super().reset()
        self.by_outcome: Counter[str] = Counter()  # recorded | not_recorded:<why> | bad_request
        self.recent_errors: deque[str] = deque(maxlen=_RECENT)

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "by_outcome": dict(self.by_outcome), "recent_errors": list(self.recent_errors)}


class ReplayServer(LocalServer):
    def __init__(self, index: ReplayIndex, dataset: str):
        self.index = index
        self.dataset = dataset
        self.name = index.table.name
        self.log = ReplayLog()
        self._models = set(index.models)
        self._model_list = orjson.dumps({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": FINGERPRINT} for m in index.models]})

    async def chat(self, request: web.Request) -> web.Response:
        raw = await request.read()
        log = self.log
        log.total += 1
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            return self._error(400, f"could not parse the JSON body of the request ({e})", "bad_request")
        if not isinstance(body, dict):
            return self._error(400, "the request body must be a JSON object", "bad_request")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return self._error(400, "you must provide a model parameter", "bad_request")
        log.by_model[model] += 1
        if body.get("stream"):
            return self._error(400, "the replay server answers only non-streaming requests ('stream': false)",
                               "bad_request", model)
        if body.get("n") not in (None, 1):
            return self._error(400, "the replay server answers only n=1 (one recorded response per question)",
                               "bad_request", model)
        if model not in self._models:
            return self._not_recorded(
                "unknown_model", model,
                f"model {model!r} has no recorded responses on this replay server ({self.name} replays "
                f"{len(self._models)} models; GET /v1/models lists them)")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return self._error(400, "'messages' is required and must be a non-empty array", "bad_request", model)
        roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
        if len(messages) != 1 or roles[0] != "user":
            return self._not_recorded(
                "messages", model,
                f"a recorded response answers one user message holding the original question; this request "
                f"has {len(messages)} message(s) (roles: {', '.join(map(str, roles))})")
        text = message_text(messages[0].get("content"))
        question = self.index.question(text)
        if question is None:
            return self._not_recorded("instruction", model, self._not_a_question(text))
        qid = self.index.question_ids[question]
        rec = self.index.responses.get((model, question))
        if rec is None:
            return self._not_recorded(
                "unseen_question", model,
                f"model {model!r} has no recorded response to question {qid} of {self.name}")
        log.by_outcome["recorded"] += 1
        log.by_status["200"] += 1
        if (key := request.headers.get("x-conductor-request")) is not None:
            log.by_request_key[key] += 1
        digest = hashlib.sha256(f"{model}\0{rec.question_id}".encode()).hexdigest()[:24]
        payload = {
            "id": f"chatcmpl-replay-{digest}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": rec.response},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": rec.prompt_tokens, "completion_tokens": rec.completion_tokens,
                      "total_tokens": rec.prompt_tokens + rec.completion_tokens},
        }
        # Percent-encoded when it holds characters an HTTP header cannot carry.
        qid = rec.question_id
        headers = {"x-conductor-replay-question": qid if qid.isascii() and qid.isprintable() else quote(qid, safe="")}
        if rec.estimated:
            headers["x-conductor-usage-estimated"] = "1"
        if rec.cost_usd is not None:
            headers["x-conductor-cost-usd"] = repr(float(rec.cost_usd))
        return web.Response(body=orjson.dumps(payload), content_type=_JSON, headers=headers)

    def _not_a_question(self, text: str) -> str:
        near = self.index.near(text)
        if near is not None:
            qid = self.index.question_ids[self.index.question(near)]
            t = text.strip()
            if t.startswith(near):
                change = f"question {qid} of {self.name} with {len(t) - len(near)} character(s) added"
            else:
                change = f"question {qid} of {self.name} cut short by {len(near) - len(t)} character(s)"
            return (f"the instruction is {change}; a recorded response answers exactly the original "
                    f"question text")
        shown = " ".join(text.split())
        shown = shown[:80] + ("…" if len(shown) > 80 else "")
        return (f"the instruction is not a question of {self.name} (a recorded response answers exactly "
                f"the original question text): {shown!r}")

    def _not_recorded(self, why: str, model: str, message: str) -> web.Response:
        self.log.by_outcome[f"not_recorded:{why}"] += 1
        return self._error(422, f"not recorded: {message}", None, model, code="not_recorded")

    def _error(self, status: int, message: str, outcome: str | None, model: str | None = None,
               code: str | None = None) -> web.Response:
        self.log.by_status[str(status)] += 1
        if outcome:
            self.log.by_outcome[outcome] += 1
        self.log.recent_errors.append(message)
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        return web.Response(status=status, body=orjson.dumps(body), content_type=_JSON)


def load_server(pool: Pool) -> ReplayServer:
    """The server for a replay pool: the table its `replay:` block names, its workers' models."""
    source = replay_source(pool)
    models = set(replay_workers(pool).values())
    if not models:
        raise ConductorError(f"pool file {pool.path}: no llm worker with an 'openai/<name>' model to replay")
    return ReplayServer(ReplayIndex(source.table, models), source.dataset)


def build_app(server: ReplayServer) -> web.Application:
    return openai_app(server)
