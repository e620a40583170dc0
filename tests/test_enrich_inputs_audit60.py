"""Job inputs and the Dagster jobs folder (audit60 F2, F7, F8, F10).

F2: a Parquet folder whose files disagree on a column's type (a daily file that brings a 2.5 to a
column of integers) and a file that is not Parquet were reported as "line 1 is not valid JSON".
F7: a `*.yml` job file got no Dagster asset and no warning. F8: a repeated CSV header name and a
CSV line with fewer fields than the header went out silently (a renamed column, nulls).
F10: `published`'s `updated_at` was `timestamp[us, tz=Etc/UTC]`, the records' `timestamp[us, tz=UTC]`."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import AssetKey, DagsterInstance, materialize

from assets.enrichment import all_job_assets
from assets.resources import StorageResource
from conductor.enrich import load_job
from conductor.enrich.run import run_job
from conductor.enrich.table import load_rows, render, row_hashes
from tests.conftest import cli, write_pool
from tests.test_enrich_dagster import DAY, N, job_sim  # noqa: F401 - job_sim is a fixture

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

JOB = """\
name: days
input: {path: in, id: id, carry: [amount]}
prompt: "Text: {{ body }} amount {{ amount }}"
pool: pool.yaml
mode: direct
worker: fast
"""


def _job(folder: Path, url: str = "http://127.0.0.1:1/v1", text: str = JOB) -> Path:
    write_pool(folder / "pool.yaml", url, names=("fast",))
    (folder / "in").mkdir(exist_ok=True)
    (folder / "job.yaml").write_text(text)
    return folder / "job.yaml"


def _day(folder: Path, name: str, **cols) -> Path:
    path = folder / "in" / name
    pl.DataFrame(cols).write_parquet(path)
    return path


def _prompts_and_hashes(path: Path) -> tuple[list[str], list[str]]:
    job = load_job(path)
    df = load_rows(job)
    return render(job, df), row_hashes(job, df, "definition")


# ---- F2: Parquet folders and files --------------------------------------------------------------

def test_a_parquet_folder_whose_new_file_brings_a_decimal_is_read_and_leaves_the_old_rows_alone(tmp_path):
    """Int64 in day1, Float64 in day2: read as decimals, but the old rows' prompts and hashes are as
    before (7, not 7.0), so a rerun would not send them again."""
    path = _job(tmp_path)
    _day(tmp_path, "day1.parquet", id=[1, 2, 3], body=["a", "b", "c"], amount=[7, 8, 9])
    before = _prompts_and_hashes(path)
    assert before[0][0] == "Text: a amount 7"
    _day(tmp_path, "day2.parquet", id=[4], body=["d"], amount=[2.5])
    r = cli("job", "check", path)
    assert r.returncode == 0 and "(4 rows" in r.stdout, r.stderr
    prompts, hashes = _prompts_and_hashes(path)
    assert (prompts[:3], hashes[:3]) == before
    assert prompts[3] == "Text: d amount 2.5"


def test_a_parquet_folder_that_grows_a_decimal_sends_only_its_new_row(fresh_sim, tmp_path):
    path = _job(tmp_path, fresh_sim.url)
    _day(tmp_path, "day1.parquet", id=[1, 2, 3], body=["a", "b", "c"], amount=[7, 8, 9])
    first = run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
    assert first["computed"] == 3 and fresh_sim.log()["total"] == 3
    _day(tmp_path, "day2.parquet", id=[4], body=["d"], amount=[2.5])
    second = run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
    assert (second["computed"], second["reused"]) == (1, 3)
    assert fresh_sim.log()["total"] == 4
    records = pq.read_table(second["records_path"])
    assert records.column("amount").to_pylist() == [7.0, 8.0, 9.0, 2.5]  # one type for the column


def test_a_parquet_folder_whose_files_give_a_column_two_kinds_of_type_is_refused_naming_both(tmp_path):
    path = _job(tmp_path)
    day1 = _day(tmp_path, "day1.parquet", id=[1], body=["a"], amount=[7])
    day2 = _day(tmp_path, "day2.parquet", id=[2], body=["b"], amount=["7 EUR"])
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert f"column 'amount' is Int64 in {day1} but String in {day2}" in r.stderr, r.stderr
    assert "JSON" not in r.stderr and "Traceback" not in r.stderr


def test_a_parquet_folder_whose_new_file_lacks_a_column_gives_its_rows_nulls(tmp_path):
    """polars refused the folder ("extra column in file outside of expected schema"), which was
    reported as a JSON line that does not parse."""
    path = _job(tmp_path, text=JOB.replace("carry: [amount]", "carry: [amount, note]"))
    _day(tmp_path, "day1.parquet", id=[1], body=["a"], amount=[7])
    _day(tmp_path, "day2.parquet", id=[2], body=["b"], amount=[8], note=["late"])
    prompts, _ = _prompts_and_hashes(path)
    assert prompts == ["Text: a amount 7", "Text: b amount 8"]
    assert load_rows(load_job(path)).get_column("note").to_list() == [None, "late"]


def test_a_file_that_is_not_parquet_is_named_as_such(tmp_path):
    path = _job(tmp_path, text=JOB.replace("path: in,", "path: x.parquet,"))
    (tmp_path / "x.parquet").write_text("not parquet at all\n")
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert f"input {tmp_path / 'x.parquet'}: not a readable Parquet file" in r.stderr, r.stderr
    assert "JSON" not in r.stderr
    # one damaged file of a folder: that file is named
    path = _job(tmp_path)
    _day(tmp_path, "day1.parquet", id=[1], body=["a"], amount=[7])
    (tmp_path / "in" / "day2.parquet").write_bytes(b"PAR1 cut off")
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert f"input {tmp_path / 'in' / 'day2.parquet'}: not a readable Parquet file" in r.stderr, r.stderr
    assert "JSON" not in r.stderr


# ---- F8: CSV structure and the formats accepted -------------------------------------------------

CSV_JOB = JOB.replace("path: in,", "path: in.csv,").replace(", carry: [amount]", "").replace(
    " amount {{ amount }}", "")


def test_a_csv_header_that_repeats_a_name_is_refused_naming_the_file_and_line(tmp_path):
    path = _job(tmp_path, text=CSV_JOB)
    (tmp_path / "in.csv").write_text("id,body,body\n1,a,b\n")
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert f"input {tmp_path / 'in.csv'}: line 1: the header repeats the column name 'body'" in r.stderr, r.stderr


def test_a_csv_line_with_fewer_fields_than_the_header_is_refused_naming_the_line(tmp_path):
    path = _job(tmp_path, text=CSV_JOB)
    (tmp_path / "in.csv").write_text("id,body\n1,a\n2\n3,c\n")
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert f"input {tmp_path / 'in.csv'}: line 3 has 1 field, the header 2" in r.stderr, r.stderr
    r = cli("job", "queries", path, "--out", tmp_path / "q.parquet")
    assert r.returncode == 2 and "line 3 has 1 field" in r.stderr and not (tmp_path / "q.parquet").exists()


def test_an_empty_last_field_and_quoted_separators_and_line_breaks_are_fields(tmp_path):
    path = _job(tmp_path, text=CSV_JOB.replace("{{ body }}", "{{ body or '(none)' }} / {{ note }}"))
    (tmp_path / "in.csv").write_text('id,body,note\n1,"a, b",\n2,"two\nlines",x\n3,c,""\n')
    r = cli("job", "check", path)
    assert r.returncode == 0, r.stderr
    prompts, _ = _prompts_and_hashes(path)
    assert prompts == ["Text: a, b /", "Text: two\nlines / x", "Text: c /"]
    # a short line after a quoted line break is named by the line it starts on
    (tmp_path / "in.csv").write_text('id,body,note\n1,"a\nb",x\n2,c\n')
    r = cli("job", "check", path)
    assert r.returncode == 2 and "line 4 has 2 fields, the header 3" in r.stderr, r.stderr


def test_an_unknown_input_format_lists_every_extension_taken(tmp_path):
    path = _job(tmp_path, text=JOB.replace("path: in,", "path: in.txt,"))
    (tmp_path / "in.txt").write_text("id,body\n1,a\n")
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert "unknown format '.txt'" in r.stderr
    assert all(ext in r.stderr for ext in (".parquet", ".pq", ".csv", ".jsonl", ".ndjson", ".json")), r.stderr


# ---- F7, F10: Dagster --------------------------------------------------------------------------

def _materialize(assets, checks, data: Path, inst):
    return materialize([*assets, *checks], partition_key=DAY, instance=inst,
                       resources={"storage": StorageResource(data_dir=str(data))})


@pytest.mark.slow
def test_a_yml_job_file_gets_its_assets_and_materializes(tmp_path, job_sim):
    job_path, sim = job_sim
    job_path.rename(job_path.with_suffix(".yml"))
    assets, checks = all_job_assets(tmp_path)
    keys = {k.to_user_string() for a in assets for k in a.keys}
    assert keys == {"enrich/revenue_facts/records", "enrich/revenue_facts/published"}
    with DagsterInstance.ephemeral() as inst:
        result = _materialize(assets, checks, tmp_path / "data", inst)
        assert result.success
        assert inst.get_latest_materialization_event(AssetKey(["enrich", "revenue_facts", "published"]))
    assert sim.log()["total"] == N


def test_a_yaml_and_a_yml_file_giving_one_job_name_are_named_in_a_warning(tmp_path, caplog):
    (tmp_path / "a.yaml").write_text("name: same_job\n")
    (tmp_path / "b.yml").write_text("name: same_job\n")
    with caplog.at_level(logging.WARNING, logger="assets.enrichment"):
        assets, _ = all_job_assets(tmp_path)
    assert {k.to_user_string() for a in assets for k in a.keys} == {"enrich/same_job/records",
                                                                    "enrich/same_job/published"}
    [warning] = caplog.records
    assert warning.getMessage() == (f"job file {tmp_path / 'b.yml'} is left out: job 'same_job' is already "
                                    f"defined by {tmp_path / 'a.yaml'}")


@pytest.mark.slow
def test_published_has_the_records_types_updated_at_in_utc(tmp_path, job_sim):
    job_path, _ = job_sim
    assets, checks = all_job_assets(tmp_path)
    with DagsterInstance.ephemeral() as inst:
        result = _materialize(assets, checks, tmp_path / "data", inst)
        assert result.success
        mats = {e.asset_key.to_user_string(): e.materialization.metadata
                for e in result.get_asset_materialization_events()}
    published = pq.read_schema(mats["enrich/revenue_facts/published"]["published_path"].value)
    records = pq.read_schema(mats["enrich/revenue_facts/records"]["records_path"].value)
    assert published.field("updated_at").type == pa.timestamp("us", tz="UTC")
    assert published.remove_metadata().equals(records.remove_metadata())
