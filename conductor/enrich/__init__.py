"""Enrichment jobs: a table of documents in, a table of typed fields out, one
record per row, joined back to the input and refreshed incrementally.

A job file (YAML) names the input, a Jinja2 prompt template over its columns,
the output fields and optional reference columns; `run_job` sends each new or
changed row through the executor (direct mode: one worker, the prompt verbatim;
planned mode: the planner's workflow) and writes records.parquet."""

from conductor.enrich.job import Job, load_job
from conductor.enrich.table import render_queries


def run_job(job, **kwargs):
    """See conductor.enrich.run.run_job (imported lazily: it pulls in the executor)."""
    from conductor.enrich.run import run_job as run

    return run(job, **kwargs)


__all__ = ["Job", "load_job", "render_queries", "run_job"]
