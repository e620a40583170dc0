"""Plans are written in parts as planning goes, so a killed run plans again only the part
it was on. A model planner on a GPU plans tens of thousands of queries in minutes, so part
sizes follow the planner's speed: each part aims at about PART_SECONDS of planning.

Parts are named by the query range they hold (`part-<start>-<end>.parquet`). Runs begun
before that wrote fixed parts (`part-<i>.parquet`, `chunk` queries each); those are read by
their index, so such a run resumes where it stopped."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from conductor.errors import ConductorError

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


def sound_parts(written: dict[int, tuple[int, Path]], run_id: str, samples: int, query_ids: pa.ChunkedArray,
                say: Callable[[str], None]) -> dict[int, tuple[int, Path]]:
    """The parts that hold this run's plans of their range: one damaged, or another run's (a part
    fetched from a store, a file copied in, another --samples), is set aside and planned again."""
    out = {}
    for start, (end, path) in written.items():
        try:
            t = pq.read_table(path, columns=["run_id", "query_id", "plan_id"])
        except Exception as e:  # pyarrow raises several types for a damaged file
            why = f"cannot be read ({type(e).__name__})"
        else:
            why = None
            if t.num_rows != (end - start) * samples:
                why = f"holds {t.num_rows} plans, not {(end - start) * samples}"
            elif set(t.column("run_id").to_pylist()) != {run_id}:
                why = "belongs to another run"
            elif set(t.column("query_id").to_pylist()) != set(query_ids.slice(start, end - start).to_pylist()):
                why = "holds other queries"
            elif len(set(t.column("plan_id").to_pylist())) != t.num_rows:
                why = "repeats a plan"
        if why is None:
            out[start] = (end, path)
            continue
        aside = path.with_name(f"{path.name}.set-aside")
        os.replace(path, aside)
        say(f"plan part {path.name} {why}: moved to {aside.name}, its queries are planned again")
    return out


def tiling(written: dict[int, tuple[int, Path]], n: int, folder: Path) -> list[Path]:
    """The parts in query order, each starting where the one before ends."""
    at, out = 0, []
    for start in sorted(written):
        end, path = written[start]
        if start != at:
            raise ConductorError(f"plan parts in {folder} overlap at query {start} (after {path.name}); "
                                 f"move the folder away and rerun to plan those queries again")
        out.append(path)
        at = end
    if at != n:
        raise ConductorError(f"plan parts in {folder} end at query {at} of {n}; move the folder away and rerun")
    return out
