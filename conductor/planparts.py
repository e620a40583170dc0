"""Plans are written in parts as planning goes, so a killed run plans again only the part
it was on. A model planner on a GPU plans tens of thousands of queries in minutes, so part
sizes follow the planner's speed: each part aims at about PART_SECONDS of planning.

Parts are named by the query range they hold (`part-<start>-<end>.parquet`). Runs begun
before that wrote fixed parts (`part-<i>.parquet`, `chunk` queries each); those are read by
their index, so such a run resumes where it stopped."""

from __future__ import annotations

import re
from pathlib import Path

PART_SECONDS = 60.0
FIRST_PART = 1_000
SMALLEST_PART = 100

_RANGE = re.compile(r"part-([0-9]+)-([0-9]+)\.parquet\Z")
_INDEX = re.compile(r"part-([0-9]+)\.parquet\Z")


def part_path(folder: Path, start: int, end: int) -> Path:
    return folder / f"part-{start:010d}-{end:010d}.parquet"


def written_parts(folder: Path, n: int, chunk: int) -> dict[int, tuple[int, Path]]:
    """The parts on disk: start -> (end, path), for a query set of n rows."""
    out: dict[int, tuple[int, Path]] = {}
    for path in sorted(folder.glob("part-*.parquet")) if folder.is_dir() else []:
        if m := _RANGE.match(path.name):
            start, end = int(m[1]), int(m[2])
        elif m := _INDEX.match(path.name):
            start = int(m[1]) * chunk
            end = min(start + chunk, n)
        else:
            continue
        if start < end <= n:
            out[start] = (end, path)
    return out


def next_size(size: int, planned: int, seconds: float, largest: int) -> int:
    """The next part's size after `planned` queries took `seconds` (the part may have been
    cut short by one already written): about PART_SECONDS of planning, at most doubling."""
    wanted = planned * PART_SECONDS / seconds if seconds > 0 else largest
    return min(largest, max(SMALLEST_PART, min(int(wanted), size * 2)))


def ranges_to_plan(written: dict[int, tuple[int, Path]], n: int) -> list[tuple[int, int]]:
    """The gaps between written parts that are left to plan, in order."""
    gaps, at = [], 0
    for start in sorted(written):
        if start > at:
            gaps.append((at, start))
        at = max(at, written[start][0])
    if at < n:
        gaps.append((at, n))
    return gaps
