"""`conductor run` refuses bad input before it leaves a run folder behind, and a run that stops
after its folder exists says so in its manifest (`failed`, the stage, the error), so the `runs`
view does not show it as still planning or executing; the same command resumes it once fixed."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import orjson
import pytest

from tests.conftest import cli, run_cli, write_pool
from tests.plannersim import math_queries, pool_file, start_keyed

KEY_ENV = "PLANNER_KEY_39"  # the variable's NAME; its values below must never be shown
RIGHT_KEY, WRONG_KEY = "sk-right-39-a1b2c3d4e5f6a7b8c9d0", "sk-wrong-39-f0e9d8c7b6a5f4e3d2c1"


def _manifest(data: Path) -> tuple[str, dict]:
    (folder,) = (data / "runs").iterdir()
    return folder.name, orjson.loads((folder / "manifest.json").read_bytes())


# ---- refused before the run folder ---------------------------------------------

def test_a_folder_at_the_cache_path_is_refused_naming_it(sim, sample_queries, tmp_path):
    """sqlite3's "unable to open database file" ended the command in a traceback."""
    pool = write_pool(tmp_path / "pool.yaml", sim.url)
    data = tmp_path / "data"
    (data / "cache.sqlite").mkdir(parents=True)
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--quiet")
    assert r.returncode == 2, r.stderr
    assert f"{data / 'cache.sqlite'} is a folder, not a response cache file" in r.stderr, r.stderr
    assert not (data / "runs").exists()


def test_a_policy_folder_that_does_not_exist_is_refused_naming_it(sim, sample_queries, tmp_path):
    """It was refused with "no policy artifact there for this pool", as if the folder were there."""
    pool = write_pool(tmp_path / "pool.yaml", sim.url)
    data, missing = tmp_path / "data", tmp_path / "policies" / "typo"
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--quiet",
            "--planner-option", f"policy={missing}")
    assert r.returncode == 2, r.stderr
    assert f"planner option policy={missing}: " in r.stderr and f"there is no folder {missing};" in r.stderr, r.stderr
    assert not data.exists() or not (data / "runs").exists()
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--quiet",
            "--planner-option", f"policy={pool}")
    assert r.returncode == 2 and f"{pool} is a file, not a policy folder" in r.stderr, r.stderr
    assert not (data / "runs").exists()


# ---- a cache damaged deep inside: found by reading it, mid-run ------------------

def _damaged_deep_inside(path: Path) -> None:
    """A cache whose first pages read (so opening it passes) and whose key index is damaged where
    every run's keys (hex digests, after '!' in order) are looked up and written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE responses (key TEXT PRIMARY KEY, model TEXT, value BLOB, created REAL)")
    db.executemany("INSERT INTO responses VALUES (?, 'm', x'7b7d', 0)", [(f"!{i:05d}",) for i in range(3000)])
    db.commit()
    (root,) = db.execute("SELECT rootpage FROM sqlite_master WHERE name LIKE 'sqlite_autoindex_responses%'").fetchone()
    (size,) = db.execute("PRAGMA page_size").fetchone()
    db.close()
    data = bytearray(path.read_bytes())
    page = data[(root - 1) * size:root * size]
    assert page[0] == 0x02  # an interior index page; its rightmost child holds the keys after '!'
    right = int.from_bytes(page[8:12], "big")
    data[(right - 1) * size:right * size] = bytes(size)
    path.write_bytes(bytes(data))


def test_a_cache_damaged_deep_inside_is_named_the_run_is_marked_failed_and_the_rerun_resumes(
        fresh_sim, sample_queries, tmp_path):
    """It stopped with exit 5 "cannot write under <run folder> ... Free space", naming neither the
    file nor what to do, and the run stayed `executing`, as if it still ran."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    data = tmp_path / "data"
    cache = data / "cache.sqlite"
    _damaged_deep_inside(cache)
    args = ("run", sample_queries, "--pool", pool, "--data-dir", data, "--quiet")
    r = run_cli(*args)
    assert r.returncode == 5, r.stderr
    assert f"the response cache {cache} is damaged" in r.stderr and f"mv '{cache}' '{cache}.bad'" in r.stderr
    assert "Free space" not in r.stderr, r.stderr
    run_id, m = _manifest(data)
    assert m["status"] == "failed" and m["failed_in"] == "executing", m
    assert f"the response cache {cache} is damaged" in m["error"]
    cache.rename(cache.with_name("cache.sqlite.bad"))
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert f"{run_id}  (resumed)" in r.stdout, r.stdout
    again, m = _manifest(data)
    assert again == run_id and m["status"] == "complete" and "error" not in m and "failed_in" not in m


# ---- the LLM planner's key rejected: found only by calling ---------------------

@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A simulated server whose planner model demands a key (read once, at its start): a wrong key
    is answered 401 over HTTP, as a hosted provider answers it. The session's servers demand none."""
    with start_keyed(tmp_path_factory.mktemp("keyed"), KEY_ENV, RIGHT_KEY) as handle:
        yield handle


def _planner_args(keyed, tmp_path: Path, key_env: bool = True) -> list:
    queries = math_queries(tmp_path / "math.parquet", 4)
    pool = pool_file(tmp_path / "pool.yaml", keyed.url)
    args = ["run", queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet", "--planner", "llm",
            "--planner-model", "openai/sim-planner", "--planner-option", f"api_base={keyed.url}"]
    return args + (["--planner-option", f"api_key_env={KEY_ENV}"] if key_env else [])


def test_a_rejected_planner_key_marks_the_run_failed_and_the_fixed_command_resumes(keyed, tmp_path):
    """The run stayed in status `planning` until the fixed command resumed it: in the `runs`
    view it looked like a run still planning."""
    args = _planner_args(keyed, tmp_path)
    r = run_cli(*args, env={KEY_ENV: WRONG_KEY})
    assert r.returncode == 4, r.stderr
    assert "openai/sim-planner" in r.stderr and f"environment variable {KEY_ENV}" in r.stderr, r.stderr
    assert "HTTP 401" in r.stderr and "its status is `failed` until then" in r.stderr, r.stderr
    run_id, m = _manifest(tmp_path / "data")
    assert m["status"] == "failed" and m["failed_in"] == "planning", m
    assert KEY_ENV in m["error"] and "openai/sim-planner" in m["error"]
    assert m["spend"] and m["interrupted_wall_time_s"] > 0  # what it paid, and this command's time
    raw = (tmp_path / "data" / "runs" / run_id / "manifest.json").read_text() + r.stdout + r.stderr
    assert WRONG_KEY not in raw and RIGHT_KEY not in raw
    shown = cli("sql", "SELECT run_id, status, failed_in, error FROM runs", "--data-dir", tmp_path / "data",
                "--format", "json")
    assert shown.returncode == 0, shown.stderr
    [row] = [orjson.loads(line) for line in shown.stdout.splitlines()]
    assert row["status"] == "failed" and row["failed_in"] == "planning", row
    assert row["error"] == m["error"] and WRONG_KEY not in shown.stdout  # why it failed, without the key

    r = run_cli(*args, env={KEY_ENV: RIGHT_KEY})
    assert r.returncode == 0, r.stderr
    assert f"{run_id}  (resumed)" in r.stdout, r.stdout
    again, m = _manifest(tmp_path / "data")
    assert again == run_id and m["status"] == "complete", m
    assert not {"error", "failed_in", "failed_at", "interrupted_wall_time_s"} & set(m), m


def test_a_planner_model_without_a_key_variable_is_told_the_planner_option_that_names_one(keyed, tmp_path):
    """The advice was "set api_key_env for provider openai in the pool file", a provider the pool
    file does not have: --planner-model's key variable is a planner option."""
    r = run_cli(*_planner_args(keyed, tmp_path, key_env=False), env={"OPENAI_API_KEY": ""})
    assert r.returncode == 4, r.stderr
    assert "--planner-option api_key_env=NAME" in r.stderr and "in the pool file" not in r.stderr, r.stderr
    assert _manifest(tmp_path / "data")[1]["status"] == "failed"
