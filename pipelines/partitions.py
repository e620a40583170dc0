"""One partition per query-set file: the key is the file's name without
".parquet"; the inbox sensor adds keys as files arrive."""

from dagster import DynamicPartitionsDefinition

query_sets = DynamicPartitionsDefinition(name="query_sets")
