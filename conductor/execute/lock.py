"""One process per run: two processes on one run id would both pay for every
plan. The lock is an flock on a file in the run's work folder, released by the
kernel when the process ends however it ends; the file holds the holder's pid
for the message the second process prints."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

from conductor.errors import ConductorError

LOCK_FILE = "lock"


@contextlib.contextmanager
def run_lock(work: Path, run_id: str) -> Iterator[None]:
    work.mkdir(parents=True, exist_ok=True)
    path = work / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise ConductorError(f"run {run_id} is already running in process {holder} (lock {path}); wait for it "
                                 f"to finish or stop it, then rerun the same command") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
