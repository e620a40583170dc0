"""Writes batched once per event-loop turn: the journal and the response cache queue
what each step produces and write it after the turn, so a turn that finishes many
steps pays one write instead of one each."""

from __future__ import annotations

import asyncio
from typing import Callable


class AfterTurn:
    """Schedules `flush` after the current loop turn (at once outside a loop). A failed
    scheduled flush cannot raise where it ran, so the next call raises it, and from then
    on every call flushes at once: after one storage error nothing waits in memory."""

    def __init__(self, flush: Callable[[], None], errors: tuple[type[BaseException], ...]):
        self._flush = flush
        self._errors = errors
        self._scheduled = False
        self._error: BaseException | None = None
        self._write_through = False

    def raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._write_through = True
            raise error

    def schedule(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or self._write_through:
            self._flush()
        elif not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        try:
            self._flush()
        except self._errors as e:
            self._error = e
