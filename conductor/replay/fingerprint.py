"""The replay table as a pool was written from it: size, modification time and SHA-256.

A pool's skills, prices and `max_call_usd` are measured from its table when
`conductor replay pool` writes it, while the replay server and the evaluation read
the table as it is when they start. A table changed in place since (logs appended,
costs corrected) would then be served at its new costs under the old pool's
reservations, and a budget could be overrun without a word: every reader of a
pool's table (`replay_source`) refuses it instead, naming the command that rewrites
the pool.

The check is a stat when the size and modification time are as recorded; a table
whose size is the same but whose time is not (copied, touched, restored) is hashed,
and accepted when its bytes are the same. Hashing runs at about 0.7 GB/s here
(the shared MMLU-Pro table, 19 MB: 0.03 s; 1 GiB: 1.5 s), several times faster than
reading the table, which every command that checks it does anyway.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
from pathlib import Path
from typing import Any

FIELD = "fingerprint"
_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")


def fingerprint(path: Path) -> dict[str, Any]:
    """The table's size in bytes, modification time (ns) and SHA-256, for the pool's replay block."""
    stat = os.stat(path)  # before the hash: a change while hashing shows as a mismatch later, never hides
    return {"bytes": stat.st_size, "modified_ns": stat.st_mtime_ns, "sha256": _sha256(path)}


def check_shape(value: Any) -> str | None:
    """Why a pool's `fingerprint` is not one `fingerprint` wrote, else None."""
    if not isinstance(value, dict) or set(value) != {"bytes", "modified_ns", "sha256"}:
        return "must be a mapping of bytes, modified_ns and sha256"
    if any(not isinstance(value[k], int) or isinstance(value[k], bool) or value[k] < 0
           for k in ("bytes", "modified_ns")):
        return "bytes and modified_ns must be whole numbers, at least 0"
    if not isinstance(value["sha256"], str) or not _SHA256.match(value["sha256"]):
        return "sha256 must be 64 lowercase hex digits"
    return None


def changed(recorded: dict[str, Any], path: Path) -> str | None:
    """How the table differs from the recorded fingerprint ('3,200 bytes then, 3,390 now'), else
    None. The size and time as recorded: unchanged, without reading it; the same size at another
    time: unchanged when its bytes hash the same (a copy, a touch)."""
    stat = os.stat(path)
    if stat.st_size == recorded["bytes"] and stat.st_mtime_ns == recorded["modified_ns"]:
        return None
    then = f"{recorded['bytes']:,} bytes, modified {_when(recorded['modified_ns'])}"
    now = f"{stat.st_size:,} bytes, modified {_when(stat.st_mtime_ns)}"
    if stat.st_size != recorded["bytes"]:
        return f"then {then}; now {now}"
    if _sha256(path) == recorded["sha256"]:
        return None
    return f"then {then}; now {now}, other bytes (SHA-256)"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _when(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
