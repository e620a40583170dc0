"""JSON inputs that grow (audit56 F1): polars gives a JSON column one type, which a later row
can change for every earlier one: an object gains every key any row has (`'region': None`),
true becomes "true" once a string arrives, 7 becomes "7". The old rows' prompts and hashes
changed, and a daily export that gained one key re-paid the whole table."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import yaml

from conductor.enrich import load_job
from conductor.enrich.run import run_job
from conductor.enrich.table import load_rows, render, row_hashes
from tests.conftest import write_pool

JOB = """\
name: grows
input: {path: in.jsonl, id: nid}
prompt: "Company {{ nid }} in {{ meta }} ({{ flag }}, {{ count }}, {{ tags }}): {{ body }}"
pool: pool.yaml
mode: direct
worker: fast
"""

FIRST = [{"nid": 1, "body": "sales rose", "meta": {"sector": "tech"}, "flag": True, "count": 7, "tags": ["a"]},
         {"nid": 2, "body": "costs fell", "meta": {"sector": "energy"}, "flag": False, "count": 8, "tags": []}]
LATER = [{"nid": 3, "body": "new", "meta": {"region": "eu", "sector": "retail"}, "flag": "unknown", "count": "n/a",
          "tags": [{"k": 1}]}]


def _save(folder: Path, rows: list[dict]) -> None:
    (folder / "in.jsonl").write_text("".join(orjson.dumps(r).decode() + "\n" for r in rows))


def _job(folder: Path, url: str = "http://127.0.0.1:1/v1") -> Path:
    write_pool(folder / "pool.yaml", url, names=("fast",))
    (folder / "job.yaml").write_text(JOB)
    return folder / "job.yaml"


def _prompts_and_hashes(path: Path) -> tuple[list[str], list[str]]:
    job = load_job(path)
    df = load_rows(job)
    return render(job, df), row_hashes(job, df, "definition")


def test_a_row_that_widens_a_json_column_leaves_the_old_rows_prompts_and_hashes(tmp_path):
    path = _job(tmp_path)
    _save(tmp_path, FIRST)
    before = _prompts_and_hashes(path)
    assert before[0][0] == "Company 1 in {'sector': 'tech'} (True, 7, ['a']): sales rose"
    _save(tmp_path, FIRST + LATER)
    prompts, hashes = _prompts_and_hashes(path)
    assert (prompts[:2], hashes[:2]) == before  # was {'sector': 'tech', 'region': None}, true, '7'
    assert prompts[2] == "Company 3 in {'region': 'eu', 'sector': 'retail'} (unknown, n/a, [{'k': 1}]): new"


@pytest.mark.parametrize("layout", ["folder", "json array"])
def test_the_same_holds_across_the_files_of_a_folder_and_in_a_json_array(tmp_path, layout):
    path = _job(tmp_path)
    job = yaml.safe_load(path.read_text())
    if layout == "folder":
        (tmp_path / "days").mkdir()
        job["input"]["path"] = "days"
        (tmp_path / "days" / "d1.jsonl").write_text("".join(orjson.dumps(r).decode() + "\n" for r in FIRST))
    else:
        job["input"]["path"] = "in.json"
        (tmp_path / "in.json").write_text(orjson.dumps(FIRST).decode())
    path.write_text(yaml.safe_dump(job))
    before = _prompts_and_hashes(path)
    if layout == "folder":
        (tmp_path / "days" / "d2.jsonl").write_text("".join(orjson.dumps(r).decode() + "\n" for r in LATER))
    else:  # polars reads no JSON array mixing lists of text and of objects: a list of text here
        (tmp_path / "in.json").write_text(orjson.dumps(FIRST + [{**LATER[0], "tags": ["b"]}]).decode())
    prompts, hashes = _prompts_and_hashes(path)
    assert (prompts[:2], hashes[:2]) == before


def test_a_grown_json_input_sends_only_its_new_row(fresh_sim, tmp_path):
    path = _job(tmp_path, fresh_sim.url)
    _save(tmp_path, FIRST)
    first = run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
    assert first["computed"] == 2 and fresh_sim.log()["total"] == 2
    _save(tmp_path, FIRST + LATER)
    second = run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
    assert (second["computed"], second["reused"]) == (1, 2)
    assert fresh_sim.log()["total"] == 3  # the old rows were sent and paid again
