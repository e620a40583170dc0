"""The SQL of the catalog's views, shared by the local catalog (conductor.store) and the
store's (conductor.execute.shared.objects): DuckDB types of Parquet columns, carried-over
columns whose types clash between runs read as text, and the runs view over manifests. Kept
apart from both so the executor's package does not import the store's (and back)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from conductor import schemas


def column_clash(column: str, table: str, one: tuple[str, str, Any], other: tuple[str, str, Any]) -> str:
    """A column of `table` whose type differs between two runs' files: each (type, run id, file)."""
    (a, run_a, file_a), (b, run_b, file_b) = one, other
    return f"column {column} of {table} is {a} in run {run_a} ({file_a}) and {b} in run {run_b} ({file_b})"


_INTS = {8: "TINYINT", 16: "SMALLINT", 32: "INTEGER", 64: "BIGINT"}


def sql_type(t: pa.DataType) -> str:
    """The DuckDB type a Parquet column of Arrow type `t` is read as (NULL: a column of nulls only)."""
    if pa.types.is_dictionary(t):
        return sql_type(t.value_type)
    if pa.types.is_null(t):
        return "NULL"
    if pa.types.is_boolean(t):
        return "BOOLEAN"
    if pa.types.is_integer(t):
        return ("U" if pa.types.is_unsigned_integer(t) else "") + _INTS[t.bit_width]
    if pa.types.is_floating(t):
        return "DOUBLE" if t.bit_width == 64 else "FLOAT"
    if pa.types.is_decimal(t):
        return f"DECIMAL({t.precision},{t.scale})"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "VARCHAR"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) \
            or pa.types.is_binary_view(t):
        return "BLOB"
    if pa.types.is_date(t):
        return "DATE"
    if pa.types.is_timestamp(t):
        return "TIMESTAMP WITH TIME ZONE" if t.tz else ("TIMESTAMP_NS" if t.unit == "ns" else "TIMESTAMP")
    if pa.types.is_time(t):
        return "TIME"
    if pa.types.is_duration(t):  # Parquet has no duration: pyarrow writes its count
        return "BIGINT"
    if pa.types.is_map(t):
        return f"MAP({sql_type(t.key_type)}, {sql_type(t.item_type)})"
    if isinstance(t, (pa.ListType, pa.LargeListType, pa.FixedSizeListType)) or pa.types.is_list_view(t) \
            or pa.types.is_large_list_view(t):
        return sql_type(t.value_type) + "[]"
    if pa.types.is_struct(t):
        return "STRUCT(" + ", ".join(f"{ident(t.field(i).name)} {sql_type(t.field(i).type)}"
                                     for i in range(t.num_fields)) + ")"
    return str(t).upper()


_NUMBERS = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT",
            "FLOAT", "DOUBLE"}


def _one_type(types: set[str]) -> bool:
    """Whether DuckDB reads a column of these types (nulls-only columns aside) as one type without
    loss: the same type, or numbers (it widens them: BIGINT, DOUBLE)."""
    types = types - {"NULL"}
    return len(types) <= 1 or all(t in _NUMBERS or t.startswith("DECIMAL(") for t in types)


# The manifest's fields the runs view reads, with their types (a field a manifest lacks is NULL)
MANIFEST_FIELDS = {"run_id": "VARCHAR", "status": "VARCHAR", "created_at": "TIMESTAMPTZ", "updated_at": "TIMESTAMPTZ",
                   "inputs": "JSON", "summary": "JSON", "spend": "JSON", "lost_in_flight": "JSON",
                   "interrupted_wall_time_s": "DOUBLE", "failed_in": "VARCHAR", "error": "VARCHAR",
                   "settings": "JSON"}


def runs_view(source: str) -> str:
    """The runs view's query over `source`, a relation of MANIFEST_FIELDS (the local catalog's
    read_json, the store's manifests). An interrupted run has no summary: `spent_usd` is what
    the run cap of its manifest's `spend` counted, kept on Ctrl-C or SIGTERM, else (a run from
    before `spend` was kept) the summary's `cost_usd`, so a sum over the view sees every run's
    money. The six first columns are those the view always had; later ones are added at the end.
    `settings` is the manifest's (the report stage adds max_failed_share), else the summary's: a
    rerun that changed a setting and stopped before its summary has the new one."""
    run_cap = "list_filter(json_extract(spend, '$[*]'), lambda c: c->>'cap' = 'run')[1]->>'spent_usd'"
    return f"""SELECT run_id, status, created_at, updated_at, inputs, summary,
        coalesce(TRY_CAST({run_cap} AS DOUBLE), TRY_CAST(summary->>'cost_usd' AS DOUBLE)) AS spent_usd,
        spend, lost_in_flight, interrupted_wall_time_s, failed_in, error,
        coalesce(settings, summary->'settings') AS settings
        FROM {source}"""


def text_groups(name: str, schema_of: dict[Any, pa.Schema]) -> list[tuple[list[Any], dict[str, str]]] | None:
    """The files of a table (keys of `schema_of`, in order) in groups, each with the columns it
    reads as text and their type in its files; None when the files read as one. Shared by the
    local catalog and the store's (conductor.execute.shared.objects.catalog).

    A column carried over from the query sets (not in schemas.py) whose type differs between runs
    (BIGINT in one, BIGINT[] or VARCHAR in another) is VARCHAR in the view: a value as its text, a
    list, struct or map as its JSON. Read as one, DuckDB failed on every query touching the column,
    for every run. The runs are then read in groups, one per set of types of such columns, joined
    by name. Numbers of different widths stay numbers (DuckDB widens them), and the schema's own
    columns keep their types."""
    names = set(schemas.TABLES.get(name, pa.schema([])).names)
    declared = {c.lower() for c in names}
    types: dict[str, tuple[str, set[str]]] = {}  # a carried column (lower-cased, as DuckDB matches) -> name, types
    of_file: dict[Any, dict[str, str]] = {}
    for f, cols in schema_of.items():
        schema = of_file[f] = {}
        if names.issuperset(cols.names):  # no carried column: most runs
            continue
        for i, col in enumerate(cols.names):
            if (key := col.lower()) not in declared:
                schema[key] = t = sql_type(cols.field(i).type)
                types.setdefault(key, (col, set()))[1].add(t)
    mixed = [key for key, (_, ts) in types.items() if not _one_type(ts)]
    if not mixed:
        return None
    groups: dict[tuple[str | None, ...], list[Any]] = {}
    for f in schema_of:
        groups.setdefault(tuple(of_file[f].get(key) for key in mixed), []).append(f)
    return [(fs, {types[key][0]: t for key, t in zip(mixed, kinds) if t is not None}) for kinds, fs in groups.items()]


def union_by_name(parts: list[tuple[str, dict[str, str]]]) -> str:
    """SELECT * of each (source, {column read as text: its type there}), joined by column name."""
    selects = []
    for source, texts in parts:
        replace = ", ".join(f"{_as_text(ident(col), t)} AS {ident(col)}" for col, t in texts.items())
        selects.append(f"SELECT *{' REPLACE (' + replace + ')' if replace else ''} FROM {source}")
    return "\nUNION ALL BY NAME\n".join(selects)


def _as_text(column: str, sql: str) -> str:
    nested = sql.endswith("]") or sql.startswith(("STRUCT(", "MAP("))
    return f"CAST(to_json({column}) AS VARCHAR)" if nested else f"CAST({column} AS VARCHAR)"


def ident(name: str) -> str:
    """A name quoted as a DuckDB identifier."""
    return '"' + name.replace('"', '""') + '"'
