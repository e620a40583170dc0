"""What every asset shows in the UI: row count, column schema and a Markdown
preview, under Dagster's standard keys where one exists (the UI renders
`dagster/row_count` and `dagster/column_schema` in the asset's overview)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from dagster import MetadataValue, TableColumn, TableSchema

from conductor.report import markdown_table, preview


def column_schema(schema: pa.Schema) -> TableSchema:
    return TableSchema(columns=[TableColumn(name=f.name, type=str(f.type)) for f in schema])


def table_metadata(path: Path, columns: Sequence[str]) -> dict:
    """Metadata of a Parquet output: read from the footer and the first rows only. The path is
    made absolute, so that the UI shows where the file is whatever the code location's directory."""
    path = Path(path).absolute()
    f = pq.ParquetFile(path)
    return {
        "dagster/row_count": f.metadata.num_rows,
        "dagster/column_schema": column_schema(f.schema_arrow),
        "preview": MetadataValue.md(preview(path, columns)),
        "path": MetadataValue.path(str(path)),
        "parquet_path": MetadataValue.path(str(path)),  # the IO manager replaces "path" with its own file
    }


def rows_metadata(rows: list[dict], schema: pa.Schema) -> dict:
    """The same metadata for a small table held in memory."""
    return {
        "dagster/row_count": len(rows),
        "dagster/column_schema": column_schema(schema),
        "preview": MetadataValue.md(markdown_table(rows, schema.names)),
    }


def png_markdown(path: Path, alt: str) -> MetadataValue:
    """A PNG inlined in Markdown, so the chart shows in the UI without a file server."""
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return MetadataValue.md(f"![{alt}](data:image/png;base64,{data})")
