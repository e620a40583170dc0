"""The machine's processes as tests that kill things check them: what each one is, who started it, and
what it was started with."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    sid: int
    state: str  # "Z": exited, not yet reaped
    cmdline: bytes  # arguments joined by NUL


def processes() -> Iterator[Proc]:
    """Every process readable now (those that exit while read are left out)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError):
            continue
        yield Proc(int(name), int(fields[1]), int(fields[3]), fields[0], cmd)


def environ(pid: int) -> list[bytes]:
    """The process's environment as it was started, or [] if it is gone or not readable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []
