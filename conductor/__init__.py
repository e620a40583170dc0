"""conductor: offline batch orchestration of many LLMs.

A planner writes a short workflow per query; an async executor runs the
workflows across a pool of worker LLMs; results, traces and rewards land in
Parquet and DuckDB. This package never imports Dagster: `assets/` and
`pipelines/` are thin front ends over it, as are the CLI and the benchmarks.
"""

__version__ = "0.1.0"
