"""The files of the batch path: the batch journal (`batches.jsonl` in the work folder)
and the JSONL lines of batch input and output files, in OpenAI's Batch API shapes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from conductor.execute.call import CallFailure, CallRequest, CallResponse, _cut, redact
from conductor.execute.journal import _open_append, _read, _write
from conductor.execute.openai_http import _kind, read_answer
from conductor.pool import Worker

BATCHES_FILE = "batches.jsonl"
ENDPOINT = "/v1/chat/completions"
MAX_FILE_BYTES = 190_000_000  # OpenAI takes input files up to 200 MB


@dataclass
class Waiter:
    """A step waiting for its line of a batch."""

    worker: Worker
    messages: list[dict[str, str]]
    params: dict[str, Any]
    future: asyncio.Future
    worst: float = 0.0  # worst-case cost at the batch price
    left_out: int = 0  # batches of its worker that went without it for want of budget room
    sent: bool = False  # its line is in a batch the provider accepted (else the request never left)


class BatchJournal:
    """`batches.jsonl`: one line per submitted batch, one when its answers are stored."""

    def __init__(self, folder: Path):
        path = Path(folder) / BATCHES_FILE
        self.open: dict[str, dict[str, Any]] = {}  # batch id -> its submission line, not yet done
        # input file id -> its upload line, for a batch whose creation was never journaled
        # (killed between creating it and writing its line): found again by its input file
        self.uploaded: dict[str, dict[str, Any]] = {}
        for row in _read(path):
            event = row.get("event")
            if event == "uploaded":
                self.uploaded[row["input_file_id"]] = row
            elif event == "submitted":
                self.open[row["batch_id"]] = row
                self.uploaded.pop(row["input_file_id"], None)
            elif event == "done":
                self.open.pop(row["batch_id"], None)
            elif event == "not_created":
                self.uploaded.pop(row["input_file_id"], None)
        self._path = path
        self._file: Any = None

    def _line(self, row: dict[str, Any]) -> None:
        if self._file is None:
            self._file = _open_append(self._path)
        _write(self._file, row)

    def uploaded_file(self, record: dict[str, Any]) -> None:
        """Before the batch is created: its input file and keys."""
        self._line({"event": "uploaded", **{k: v for k, v in record.items() if k != "batch_id"}})

    def submitted(self, record: dict[str, Any]) -> None:
        self._line({"event": "submitted", **record})

    def not_created(self, file_id: str) -> None:
        """An upload whose batch the provider does not have: its keys are free to go in a new one."""
        self._line({"event": "not_created", "input_file_id": file_id})

    def adopt(self, line: dict[str, Any], run_id: str) -> None:
        """A batch (or upload) an abandoned run never collected, as if this run had made it."""
        row = {k: v for k, v in line.items() if k not in ("_seq",)}
        self._line({**row, "adopted_from": run_id})

    def done(self, batch_id: str, status: str) -> None:
        self._line({"event": "done", "batch_id": batch_id, "status": status})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def encode_line(model: str, key: str, w: Waiter) -> bytes:
    """The request's line of a batch input file."""
    body = {"model": model, "messages": w.messages, **{k: v for k, v in w.params.items() if v is not None}}
    return orjson.dumps({"custom_id": key, "method": "POST", "url": ENDPOINT, "body": body}) + b"\n"


def split_by_size(lines: list[tuple[str, Waiter, bytes]], cap: int) -> list[list[tuple[str, Waiter, bytes]]]:
    """Consecutive parts of at most `cap` bytes each (a line larger than cap goes alone)."""
    parts: list[list[tuple[str, Waiter, bytes]]] = []
    size = cap + 1
    for line in lines:
        if size + len(line[2]) > cap:
            parts.append([])
            size = 0
        parts[-1].append(line)
        size += len(line[2])
    return parts


def unanswered(why: str, status: str | None) -> CallFailure:
    """A request with no line in the batch's files: the batch ended before answering it
    (retried like a timeout when it expired or was cancelled: the provider did not get to it)."""
    return CallFailure("timeout" if status in ("expired", "cancelled") else "server", why)


def line_result(row: dict, waiter: Waiter | None, api_key: str | None = None) -> CallResponse | CallFailure:
    """A batch line's answer, or why it has none: the error line's status and message
    (without `api_key`, which a provider's message may echo)."""
    response = row.get("response")
    response = response if isinstance(response, dict) else {}
    code = response.get("status_code")
    error = row.get("error")
    if code == 200 and not error:
        req = CallRequest(waiter.worker.model if waiter else "", waiter.messages if waiter else [],
                          waiter.params if waiter else {})
        try:
            return read_answer(req, response.get("body"), {})
        except CallFailure as f:
            return f.reworded(_cut(redact(str(f), api_key)))
        except Exception as e:  # whatever else a malformed line raises fails this line only
            return CallFailure("malformed", _cut(redact(f"malformed response: {type(e).__name__}: {e}", api_key), 200))
    if isinstance(code, int):
        body = response.get("body")
        err = body.get("error") if isinstance(body, dict) else None
        text = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else body
        return CallFailure(_kind(code), _cut(redact(f"HTTP {code} (in a batch): {text}", api_key)), code)
    if isinstance(error, dict):
        code_name = error.get("code") or "error"
        kind = "timeout" if code_name in ("batch_expired", "batch_cancelled") else "server"
        return CallFailure(kind, _cut(redact(f"{code_name} (in a batch): {error.get('message') or ''}".strip(),
                                             api_key)))
    return CallFailure("malformed", _cut(redact(f"malformed batch line: {row}", api_key), 200))


def batch_error(info: Any) -> str | None:
    """A failed batch's own errors (validation), for the lines' message."""
    errors = getattr(info, "errors", None)
    data = getattr(errors, "data", None) if errors is not None else None
    if isinstance(errors, dict):
        data = errors.get("data")
    if not data:
        return None
    first = data[0]
    message = first.get("message") if isinstance(first, dict) else getattr(first, "message", None)
    return f"batch {info.id} failed: {message}" + (f" (and {len(data) - 1} more errors)" if len(data) > 1 else "")
