"""Disk space held back for the answers already paid for.

When the disk fills mid-run, the calls in flight have been paid; if their
answers cannot be written, a rerun pays for them again. A run therefore holds a
few megabytes in a file it allocates at start, and on the first storage error
deletes it: the run stops sending, and the answers it is waiting for still fit.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from conductor.envsettings import env_number

RESERVE_BYTES = 8 << 20  # default; env CONDUCTOR_RESERVE_BYTES sets another size
ENV_RESERVE_BYTES = "CONDUCTOR_RESERVE_BYTES"
MAX_RESERVE_BYTES = 1 << 30
RESERVE_FILE = "space-reserve"


def reserve_size() -> int:
    """$CONDUCTOR_RESERVE_BYTES, else 8 MB; 0 turns the reserve off."""
    return env_number(None, ENV_RESERVE_BYTES, RESERVE_BYTES,
                      f"a whole number of bytes, from 0 (the disk space reserve off) to {MAX_RESERVE_BYTES:,}",
                      lambda size: 0 <= size <= MAX_RESERVE_BYTES, int)  # past that, a typo: the disk is blamed


class NoRoomForReserve(OSError):
    """The disk has less room than the reserve itself: said as such, before any call. A bare
    "No space left on device" beside a `df` that shows the disk nearly empty explained nothing."""

    def __init__(self, folder: Path, size: int):
        try:
            free = f"{shutil.disk_usage(folder).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        super().__init__(errno.ENOSPC, f"cannot set aside the {size:,}-byte disk reserve for answers in flight in "
                                       f"{folder} ({free}); free space, or set {ENV_RESERVE_BYTES} lower (0 turns "
                                       f"the reserve off)")


class SpaceReserve:
    def __init__(self, folder: Path, size: int | None = None):
        size = reserve_size() if size is None else size
        self.path = Path(folder) / RESERVE_FILE
        if size == 0:  # off: posix_fallocate refuses a length of 0
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, size)  # really allocated, unlike a sparse file
        except OSError as e:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise NoRoomForReserve(folder, size) from None
            raise
        os.close(fd)

    def release(self) -> None:
        """Give the space back (idempotent)."""
        self.path.unlink(missing_ok=True)
