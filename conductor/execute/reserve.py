"""Disk space held back for the answers already paid for.

When the disk fills mid-run, the calls in flight have been paid; if their
answers cannot be written, a rerun pays for them again. A run therefore holds a
few megabytes in a file it allocates at start, and on the first storage error
deletes it: the run stops sending, and the answers it is waiting for still fit.
"""

from __future__ import annotations

import os
from pathlib import Path

RESERVE_BYTES = 8 << 20  # default; env CONDUCTOR_RESERVE_BYTES sets another size
RESERVE_FILE = "space-reserve"


class SpaceReserve:
    def __init__(self, folder: Path, size: int | None = None):
        size = size or int(os.environ.get("CONDUCTOR_RESERVE_BYTES") or RESERVE_BYTES)
        self.path = Path(folder) / RESERVE_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)  # really allocated, unlike a sparse file
        except OSError:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)

    def release(self) -> None:
        """Give the space back (idempotent)."""
        self.path.unlink(missing_ok=True)
