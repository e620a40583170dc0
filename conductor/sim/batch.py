"""OpenAI's Files and Batch API on the simulated server, so that batch-mode
clients (litellm's acreate_file / acreate_batch / aretrieve_batch /
afile_content with an api_base) are tested for real over HTTP.

Routes: POST|GET /v1/files, GET|DELETE /v1/files/{id}, GET /v1/files/{id}/content,
POST|GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel.

A batch moves validating -> in_progress -> finalizing -> completed by the clock
(`batch_delay_s` from its creation), worked out whenever it is read: no
background task. Its lines are done at an even pace through in_progress, each
answered when a read finds it due (so request_counts grow while it runs) by the
same check and answer as online chat: a line gets the reply its body gets
online. Their tokens are billed in the request log's `batch_billed_tokens`,
apart from online ones. Per line, the model's faults as they stand then:
`fail_status` that status, `error_rate` and `drop_rate` 500/502/503,
`rate_limit_rate` 429, `batch_line_error_rate` 500 (rpm, latency and hangs do
not apply). `batch_fail_rate` fails whole batches at validation;
`batch_expire` leaves the last part of the lines undone and ends the batch
"expired"; a cancelled batch keeps the lines done before the cancel. Undone
lines go to the error file with `error: {code: batch_expired | batch_cancelled}`.
Files and batches live in memory until the server stops; /admin/reset clears
only the counters.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from conductor.sim.answers import draw
from conductor.sim.outcome import Rejection, failed_status, rate_limited, server_error

if TYPE_CHECKING:
    from conductor.sim.server import SimServer

ENDPOINT = "/v1/chat/completions"
WINDOW = "24h"
WINDOW_S = 24 * 3600
MAX_LINES = 50_000  # OpenAI's limit per batch
CHUNK = 500  # lines answered between turns of the event loop, so polls of other batches still answer
TERMINAL = ("completed", "expired", "cancelled", "failed")
# The share of batch_delay_s spent in each state before "completed".
_IN_PROGRESS_AT, _FINALIZING_AT = 0.1, 0.9
_JSON = "application/json"
_FAILED = {"object": "list", "data": [{"code": "simulated_failure", "line": None, "param": None,
                                       "message": "The batch failed validation (simulated: batch_fail_rate)."}]}


class BatchInputError(ValueError):
    """An input file that OpenAI would refuse; the message names the line."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    created_at: int
    data: bytes
    lines: int = 0
    models: frozenset[str] = frozenset()

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": len(self.data), "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}


@dataclass
class Batch:
    id: str
    input_file_id: str
    lines: list[bytes]  # the input's lines, kept (even if its file is deleted) until the batch ends
    total: int
    created: float
    delay_s: float
    expire: float  # fraction of lines left undone
    fails: bool  # fails validation
    authorized: frozenset[str]  # key-locked models the submitter had the key for
    metadata: dict[str, str] | None
    status: str = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    completed: int = 0
    failed: int = 0
    out: list[bytes] = field(default_factory=list, repr=False)  # output file lines so far
    err: list[bytes] = field(default_factory=list, repr=False)  # error file lines so far
    cancelling_at: float | None = None
    ended_at: float | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def done(self) -> int:
        return self.completed + self.failed

    def at(self, share: float) -> float:
        return self.created + share * self.delay_s

    def clock_status(self, now: float) -> str:
        """Where the clock puts an unfinished batch (validating when just created)."""
        if now <= self.created or now < self.at(_IN_PROGRESS_AT):
            return "validating"
        if now < self.at(_FINALIZING_AT):
            return "in_progress"
        if now < self.at(1.0):
            return "finalizing"
        return "done"

    def target(self, t: float) -> int:
        """How many lines are done by time t: none while validating, then at an even
        pace through in_progress, all that will ever be done from finalizing on."""
        doable = self.total - round(self.total * self.expire)
        if t <= self.created or t < self.at(_IN_PROGRESS_AT):
            return 0
        if t >= self.at(_FINALIZING_AT):
            return doable
        return int(doable * (t - self.at(_IN_PROGRESS_AT)) / (self.at(_FINALIZING_AT) - self.at(_IN_PROGRESS_AT)))

    def to_json(self, now: float) -> dict[str, Any]:
        status = self.status if self.status in TERMINAL or self.status == "cancelling" else self.clock_status(now)
        if status == "done":  # due to end, but not yet ended by a read (see BatchAPI._current)
            status = "finalizing"
        reached = self.ended_at if self.ended_at is not None else now

        def stamp(share: float) -> int | None:
            t = self.at(share)
            return int(t) if t <= reached and status not in ("validating", "failed") else None

        return {
            "id": self.id, "object": "batch", "endpoint": ENDPOINT, "errors": _FAILED if status == "failed" else None,
            "input_file_id": self.input_file_id, "completion_window": WINDOW, "status": status,
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "created_at": int(self.created),
            "in_progress_at": stamp(_IN_PROGRESS_AT),
            "expires_at": int(self.created) + WINDOW_S,
            "finalizing_at": stamp(_FINALIZING_AT) if self.cancelling_at is None else None,
            "completed_at": _int(self.ended_at) if status == "completed" else None,
            "failed_at": _int(self.ended_at) if status == "failed" else None,
            "expired_at": _int(self.ended_at) if status == "expired" else None,
            "cancelling_at": _int(self.cancelling_at),
            "cancelled_at": _int(self.ended_at) if status == "cancelled" else None,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
        }


class BatchAPI:
    """The files and batches one simulated server holds, and their routes."""

    def __init__(self, server: SimServer):
        self.server = server
        self.files: dict[str, StoredFile] = {}
        self.batches: dict[str, Batch] = {}

    def add_routes(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/files", self.create_file)
        r.add_get("/v1/files", self.list_files)
        r.add_get("/v1/files/{id}", self.get_file)
        r.add_delete("/v1/files/{id}", self.delete_file)
        r.add_get("/v1/files/{id}/content", self.file_content)
        r.add_post("/v1/batches", self.create_batch)
        r.add_get("/v1/batches", self.list_batches)
        r.add_get("/v1/batches/{id}", self.get_batch)
        r.add_post("/v1/batches/{id}/cancel", self.cancel_batch)

    # -- files ---------------------------------------------------------------

    async def create_file(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            return _reply(Rejection(400, "Upload a file as multipart/form-data with fields 'purpose' and 'file'."))
        form = await request.post()
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            return _reply(Rejection(400, f"purpose must be 'batch' (the only purpose this simulated server "
                                         f"stores); got {purpose!r}.", param="purpose"))
        if not isinstance(upload, web.FileField):
            return _reply(Rejection(400, "The 'file' field must be a file upload.", param="file"))
        data = upload.file.read()
        try:
            lines, models = check_input(data)
        except BatchInputError as e:
            return _reply(Rejection(400, f"{upload.filename}: {e}", param="file", code=e.code))
        f = StoredFile(id="file-" + secrets.token_hex(12), filename=upload.filename or "upload.jsonl",
                       purpose="batch", created_at=int(time.time()), data=data, lines=lines, models=models)
        self.files[f.id] = f
        self.server.log.files_uploaded += 1
        return _ok(f.to_json())

    async def list_files(self, request: web.Request) -> web.Response:
        purpose = request.query.get("purpose")
        data = [f.to_json() for f in reversed(self.files.values()) if purpose in (None, f.purpose)]
        return _ok({"object": "list", "data": data, "has_more": False})

    async def get_file(self, request: web.Request) -> web.Response:
        f = self._file(request)
        return f if isinstance(f, web.Response) else _ok(f.to_json())

    async def delete_file(self, request: web.Request) -> web.Response:
        f = self._file(request)
        if isinstance(f, web.Response):
            return f
        del self.files[f.id]
        return _ok({"id": f.id, "object": "file", "deleted": True})

    async def file_content(self, request: web.Request) -> web.Response:
        f = self._file(request)
        if isinstance(f, web.Response):
            return f
        return web.Response(body=f.data, content_type="application/octet-stream")

    def _file(self, request: web.Request) -> StoredFile | web.Response:
        file_id = request.match_info["id"]
        f = self.files.get(file_id)
        return f if f is not None else _reply(Rejection(404, f"No such File object: {file_id}", param="id"))

    # -- batches -------------------------------------------------------------

    async def create_batch(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            return _reply(Rejection(400, f"We could not parse the JSON body of your request ({e})."))
        problem = _check_batch_request(body, self.files)
        if problem is not None:
            return _reply(problem)
        f = self.files[body["input_file_id"]]
        models = [m for m in f.models if m in self.server.models] or list(self.server.models)
        faults = [self.server.faults(m) for m in models]
        batch = Batch(id="batch_" + secrets.token_hex(12), input_file_id=f.id, lines=_lines(f.data), total=f.lines,
                      created=time.time(), delay_s=max(x.batch_delay_s for x in faults),
                      expire=max(x.batch_expire for x in faults),
                      fails=_draw_fails(max(x.batch_fail_rate for x in faults)),
                      authorized=frozenset(m for m in models if self.server.has_key(request, m)),
                      metadata=body.get("metadata"))
        self.batches[batch.id] = batch
        log = self.server.log
        log.batches_created += 1
        log.batch_submissions[hashlib.sha256(f.data).hexdigest()] += 1
        return _ok(batch.to_json(batch.created))

    async def list_batches(self, request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            return _reply(Rejection(400, "limit must be an integer from 1 to 100.", param="limit"))
        if not 1 <= limit <= 100:
            return _reply(Rejection(400, "limit must be an integer from 1 to 100.", param="limit"))
        ids = list(reversed(self.batches))  # newest first
        after = request.query.get("after")
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in self.batches else []
        page = ids[:limit]
        data = []
        for batch_id in page:
            data.append(await self._current(self.batches[batch_id]))
        return _ok({"object": "list", "data": data, "first_id": page[0] if page else None,
                    "last_id": page[-1] if page else None, "has_more": len(ids) > limit})

    async def get_batch(self, request: web.Request) -> web.Response:
        batch = self._batch(request)
        return batch if isinstance(batch, web.Response) else _ok(await self._current(batch))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        batch = self._batch(request)
        if isinstance(batch, web.Response):
            return batch
        await self._current(batch)
        if batch.status in TERMINAL or batch.cancelling_at is not None:
            return _reply(Rejection(409, f"Cannot cancel a batch with status '{batch.status}'.", param="batch_id"))
        batch.cancelling_at = time.time()
        batch.status = "cancelling"
        return _ok(batch.to_json(batch.cancelling_at))

    def _batch(self, request: web.Request) -> Batch | web.Response:
        batch_id = request.match_info["id"]
        batch = self.batches.get(batch_id)
        return batch if batch is not None else _reply(Rejection(404, f"No batch found with id '{batch_id}'.",
                                                                param="batch_id"))

    async def _current(self, batch: Batch) -> dict[str, Any]:
        """The batch as of now: the lines due by now answered, and ended if its time has come."""
        now = time.time()
        if batch.status not in TERMINAL:
            async with batch.lock:  # one poll answers the lines; others wait for it
                if batch.status not in TERMINAL:
                    await self._advance(batch, now)
        return batch.to_json(now)

    async def _advance(self, batch: Batch, now: float) -> None:
        if batch.cancelling_at is not None:
            until, end, code, ended = batch.cancelling_at, "cancelled", "batch_cancelled", batch.cancelling_at
        elif batch.fails:
            if batch.clock_status(now) != "validating":
                batch.lines = []
                batch.ended_at, batch.status = batch.at(_IN_PROGRESS_AT), "failed"
            return
        elif batch.clock_status(now) == "done":
            until, ended = now, batch.at(1.0)
            end, code = ("expired", "batch_expired") if batch.expire > 0 else ("completed", "")
        else:
            until, end = now, None
        target = batch.target(until)
        log = self.server.log
        while batch.done < target:
            i = batch.done
            line = orjson.loads(batch.lines[i])
            ok, record = self._run_line(batch, line["custom_id"], line["body"], int(now))
            if ok:
                batch.out.append(orjson.dumps(record))
                batch.completed += 1
            else:
                batch.err.append(orjson.dumps(record))
                batch.failed += 1
            log.batch_lines[str(record["response"]["status_code"])] += 1
            if i % CHUNK == CHUNK - 1:
                await asyncio.sleep(0)
        if end is None:
            return
        for raw in batch.lines[batch.done:]:
            batch.err.append(orjson.dumps(_undone(batch, orjson.loads(raw)["custom_id"], code)))
            log.batch_lines[code] += 1
            batch.failed += 1
        batch.output_file_id = self._result_file(batch, batch.out, "output")
        batch.error_file_id = self._result_file(batch, batch.err, "error")
        batch.lines, batch.out, batch.err = [], [], []  # all in the files now
        batch.ended_at, batch.status = max(ended, batch.created), end

    def _run_line(self, batch: Batch, custom_id: str, body: Any, created: int) -> tuple[bool, dict[str, Any]]:
        """One line, as the same body would be answered online (less the HTTP-level faults)."""
        server, log = self.server, self.server.log
        checked = server.check(body, lambda m: not server.requires_key(m) or m in batch.authorized)
        if isinstance(checked, Rejection):
            if checked.model in server.models:
                log.batch_by_model[checked.model] += 1
            return False, _failed_line(batch, custom_id, checked)
        spec, structured = checked
        model = spec.name
        log.batch_by_model[model] += 1
        f = server.faults(model)
        if f.fail_status is not None:
            return False, _failed_line(batch, custom_id, failed_status(model, f))
        rng = draw(server.seed, model, f"batch/{batch.id}/{custom_id}")
        u = rng.random()
        if u < f.batch_line_error_rate:
            return False, _failed_line(batch, custom_id, server_error(model, 500))
        u -= f.batch_line_error_rate
        if u < f.error_rate + f.drop_rate:
            return False, _failed_line(batch, custom_id, server_error(model, rng.choice((500, 502, 503))))
        u -= f.error_rate + f.drop_rate
        if u < f.rate_limit_rate:
            return False, _failed_line(batch, custom_id, rate_limited(model, f))
        answer = server.answer(body, spec, structured, f)
        log.bill_batch(model, answer.prompt_tokens, answer.completion_tokens)
        server.count_answer(answer)
        return True, {"id": _line_id(batch, custom_id), "custom_id": custom_id,
                      "response": {"status_code": 200, "request_id": _request_id(batch, custom_id),
                                   "body": answer.payload(model, created, f.usage_factor)},
                      "error": None}

    def _result_file(self, batch: Batch, records: list[bytes], kind: str) -> str | None:
        if not records:
            return None
        f = StoredFile(id="file-" + secrets.token_hex(12), filename=f"{batch.id}_{kind}.jsonl",
                       purpose="batch_output", created_at=int(time.time()), data=b"\n".join(records) + b"\n",
                       lines=len(records))
        self.files[f.id] = f
        return f.id


def check_input(data: bytes) -> tuple[int, frozenset[str]]:
    """(number of requests, models named) of a batch input file, or BatchInputError naming the line."""
    seen: dict[str, int] = {}
    models: set[str] = set()
    n = 0
    for n, raw in enumerate(_lines(data), 1):
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise BatchInputError(f"line {n}: not valid JSON ({e})", "invalid_json_line") from None
        if not isinstance(line, dict):
            raise BatchInputError(f"line {n}: must be a JSON object", "invalid_json_line")
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchInputError(f"line {n}: 'custom_id' is required and must be a non-empty string",
                                  "missing_required_parameter")
        if custom_id in seen:
            raise BatchInputError(f"line {n}: custom_id {custom_id!r} is already used on line {seen[custom_id]}; "
                                  "custom_ids must be unique in a batch", "duplicate_custom_id")
        seen[custom_id] = n
        if line.get("method") != "POST":
            raise BatchInputError(f"line {n}: 'method' must be 'POST' (got {line.get('method')!r})", "invalid_method")
        if line.get("url") != ENDPOINT:
            raise BatchInputError(f"line {n}: 'url' must be {ENDPOINT!r}, the batch endpoint this simulated server "
                                  f"serves (got {line.get('url')!r})", "invalid_url")
        body = line.get("body")
        if not isinstance(body, dict):
            raise BatchInputError(f"line {n}: 'body' is required and must be a JSON object",
                                  "missing_required_parameter")
        if isinstance(body.get("model"), str):
            models.add(body["model"])
        if n > MAX_LINES:
            raise BatchInputError(f"more than {MAX_LINES:,} requests; split the batch", "too_many_requests")
    if n == 0:
        raise BatchInputError("the file holds no requests", "empty_file")
    return n, frozenset(models)


def _check_batch_request(body: Any, files: dict[str, StoredFile]) -> Rejection | None:
    if not isinstance(body, dict):
        return Rejection(400, "The request body must be a JSON object.")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        return Rejection(400, "input_file_id is required.", param="input_file_id")
    f = files.get(file_id)
    if f is None:
        return Rejection(400, f"No such File object: {file_id}", param="input_file_id")
    if f.purpose != "batch":
        return Rejection(400, f"File {file_id} has purpose {f.purpose!r}; a batch needs a purpose='batch' file.",
                         param="input_file_id")
    if body.get("endpoint") != ENDPOINT:
        return Rejection(400, f"endpoint must be {ENDPOINT!r}, the one this simulated server batches "
                              f"(got {body.get('endpoint')!r}).", param="endpoint")
    if body.get("completion_window") != WINDOW:
        return Rejection(400, f"completion_window must be {WINDOW!r} (got {body.get('completion_window')!r}).",
                         param="completion_window")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or len(meta) > 16
                             or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        return Rejection(400, "metadata must be an object of at most 16 string keys and string values.",
                         param="metadata")
    return None


def _draw_fails(rate: float) -> bool:
    return secrets.randbelow(1_000_000) < rate * 1_000_000


def _lines(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def _failed_line(batch: Batch, custom_id: str, r: Rejection) -> dict[str, Any]:
    return {"id": _line_id(batch, custom_id), "custom_id": custom_id,
            "response": {"status_code": r.status, "request_id": _request_id(batch, custom_id), "body": r.body()},
            "error": None}


def _undone(batch: Batch, custom_id: str, code: str) -> dict[str, Any]:
    why = ("the batch was cancelled" if code == "batch_cancelled"
           else "the batch's completion window expired")
    return {"id": _line_id(batch, custom_id), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": f"This request was not executed: {why}."}}


def _line_id(batch: Batch, custom_id: str) -> str:
    return "batch_req_" + hashlib.sha256(f"{batch.id}\x00{custom_id}".encode()).hexdigest()[:24]


def _request_id(batch: Batch, custom_id: str) -> str:
    return "req_" + hashlib.sha256(f"req\x00{batch.id}\x00{custom_id}".encode()).hexdigest()[:24]


def _int(t: float | None) -> int | None:
    return None if t is None else int(t)


def _ok(body: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type=_JSON, headers={"x-conductor-simulated": "1"})


def _reply(r: Rejection) -> web.Response:
    return web.Response(status=r.status, body=orjson.dumps(r.body()), content_type=_JSON,
                        headers={"x-conductor-simulated": "1"})
