"""Small renderings of outputs for humans: Markdown tables, previews and summaries,
shown as Dagster metadata (the CLI's own summaries are in conductor/cli/render.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pyarrow.parquet as pq


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
                   width: int = 60) -> str:
    if not rows:
        return "_no rows_"
    columns = list(columns or rows[0].keys())

    def cell(v: Any) -> str:
        s = "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
        s = s.replace("\n", " ").replace("|", "\\|")
        return s if len(s) <= width else s[: width - 1] + "…"

    head = "| " + " | ".join(columns) + " |\n| " + " | ".join("---" for _ in columns) + " |\n"
    return head + "\n".join("| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows)


def preview(path: Path, columns: Sequence[str], n: int = 5) -> str:
    """The first `n` rows of a Parquet file, without reading the rest."""
    f = pq.ParquetFile(path)
    batch = next(f.iter_batches(batch_size=n, columns=list(columns)), None)
    return markdown_table(batch.to_pylist() if batch is not None else [], columns)


def summary_markdown(s: dict[str, Any]) -> str:
    """The summary's scalars, and its flat counts (statuses) on one line each: a run the budget
    stopped must say so where the report is read. Nested groups have tables of their own."""
    def flat(v: Any) -> bool:
        return isinstance(v, dict) and not any(isinstance(x, (dict, list)) for x in v.values())

    rows = [{"metric": k, "value": ", ".join(f"{n} {c}" for n, c in v.items()) if flat(v) else v}
            for k, v in s.items() if flat(v) or not isinstance(v, (dict, list))]
    return markdown_table(rows, ["metric", "value"], width=120)
