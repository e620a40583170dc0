"""Partitions: one per query-set file (the key is the file's name without
".parquet"; the inbox sensor adds keys as files arrive), and one per day for the
enrichment jobs (each day's run pays only for the rows that changed)."""

import os

from dagster import DailyPartitionsDefinition, DynamicPartitionsDefinition

from assets.resources import check_enrich_start

check_enrich_start()  # Dagster's own error ("time data 'x' does not match format") names no variable
query_sets = DynamicPartitionsDefinition(name="query_sets")
days = DailyPartitionsDefinition(start_date=os.environ.get("CONDUCTOR_ENRICH_START", "2026-01-01"),
                                 timezone="UTC")
