"""A live one-line progress display for long runs, on stderr.

On a terminal the line redraws in place a few times a second; in a log (a
Dagster run, CI) a plain line is printed every `log_every_s` seconds instead.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Counters:
    plans_total: int = 0
    plans_done: int = 0
    plans_resumed: int = 0  # done before this process started: not in its rate
    calls: int = 0
    requests: int = 0  # requests sent (batch lines included), answered or not
    cache_hits: int = 0
    errors: int = 0
    retries: int = 0
    usd: float = 0.0
    usd_resumed: float = 0.0  # spent before this process started: usd - usd_resumed is this process's
    waiting: dict[str, str] = field(default_factory=dict)  # what the run waits on (a batch id -> its state)
    started: float = field(default_factory=time.monotonic)


MIN_PLANS_FOR_ETA = 20


class Progress:
    def __init__(self, label: str = "execute", stream: TextIO | None = None, enabled: bool = True,
                 log_every_s: float = 10.0):
        self.c = Counters()
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = 0.25 if self.tty else log_every_s
        self._last = 0.0

    def tick(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.every:
            return
        self._last = now
        line = self.line(now)
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def say(self, text: str) -> None:
        """One line for a stage that has no counter (reading, writing), so a long one is not silent."""
        if self.enabled:
            self.stream.write(("\r\x1b[2K" if self.tty else "") + f"[{self.label}] {text}\n")
            self.stream.flush()

    def line(self, now: float | None = None) -> str:
        c = self.c
        elapsed = max((now or time.monotonic()) - c.started, 1e-9)
        here = c.plans_done - c.plans_resumed
        rate = here / elapsed
        # too few plans or seconds for a rate: the first line said "left 7h31m" for five minutes
        left = (c.plans_total - c.plans_done) / rate if here >= MIN_PLANS_FOR_ETA and elapsed >= 2 \
            and c.plans_total else None
        eta = _fmt_s(left) if left is not None else "?"
        return (f"[{self.label}] plans {c.plans_done}/{c.plans_total}  calls {c.calls}  "
                f"cache hits {c.cache_hits}  errors {c.errors}  retries {c.retries}  "
                f"${c.usd:.4f}  {c.calls / elapsed:.1f} calls/s  left {eta}"
                + "".join(f"  [{w}]" for w in c.waiting.values()))

    def close(self) -> None:
        if self.enabled:
            self.tick(force=True)
            if self.tty:
                self.stream.write("\n")
                self.stream.flush()


def _fmt_s(s: float) -> str:
    s = int(s)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"
