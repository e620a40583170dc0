"""fix43g (audit81): a replay pool refuses a table changed since the pool was written from it
(F2); `replay queries` and `replay convert` never write Parquet over a `.yaml` name (F3);
`convert` says which rows --task-map left without a task, and --replay-dir's help says where the
default folder is (F5). Made-up tables: no shared data needed."""

from __future__ import annotations

import os
import subprocess
import sys

import polars as pl
import pytest
import yaml

from conductor.cli import main as cli_main
from conductor.errors import ConductorError
from conductor.pool import load_pool
from conductor.replay.tables import replay_source

N = 12


def _table(scale: float = 1.0) -> pl.DataFrame:
    """A math table of two models with recorded costs (`scale` times them)."""
    rows = []
    for i in range(N):
        ref = str(i + 7)
        for model, usd in (("cheap-model", 1e-5), ("dear-model", 4e-4)):
            rows.append({"question_id": f"q{i:02d}", "question": f"Question {i}: what is {i} + 7?",
                         "reference": ref, "model": model, "response": f"The answer is {ref}.",
                         "correct": True, "task": "math", "cost_usd": usd * scale})
    return pl.DataFrame(rows)


@pytest.fixture
def written(tmp_path, monkeypatch):
    """A table, its query set and a pool written from it by `conductor replay pool`."""
    monkeypatch.setenv("CONDUCTOR_REPLAY_DIR", str(tmp_path / "no-shared"))  # no prices.csv: costs price it
    table, pool, queries = tmp_path / "logs.parquet", tmp_path / "pool.yaml", tmp_path / "q.parquet"
    _table().write_parquet(table)
    assert cli_main(["replay", "pool", "--table", str(table), "--out", str(pool)]) == 0
    assert cli_main(["replay", "queries", "--table", str(table), "--out", str(queries)]) == 0
    return {"table": table, "pool": pool, "queries": queries, "dir": tmp_path}


def _change(table) -> None:
    """The user's logs corrected in place: every cost ten times, as in audit81's reproduction."""
    _table(10.0).write_parquet(table)


# ---------------------------------------------------------------- F2: the table changed since


def test_the_pool_records_its_tables_fingerprint(written):
    import hashlib

    fp = yaml.safe_load(written["pool"].read_text())["replay"]["fingerprint"]
    stat = os.stat(written["table"])
    assert fp == {"bytes": stat.st_size, "modified_ns": stat.st_mtime_ns,
                  "sha256": hashlib.sha256(written["table"].read_bytes()).hexdigest()}
    assert "# fingerprint: the table's size" in written["pool"].read_text()  # the header says what it is
    replay_source(load_pool(written["pool"]))  # as written: accepted


def test_a_table_changed_after_the_pool_is_refused_naming_the_files_and_the_command(written):
    """audit81 F2: the server charged the new costs while budgets reserved the old max_call_usd."""
    _change(written["table"])
    with pytest.raises(ConductorError) as e:
        replay_source(load_pool(written["pool"]))
    msg = str(e.value)
    assert f"replay table {written['table']} changed since the pool {written['pool']} was written" in msg
    assert "max_call_usd" in msg and "bytes" in msg
    assert f"conductor replay pool --table {written['table']} --out {written['pool']}" in msg


def test_replay_serve_refuses_a_changed_table(written):
    """`conductor replay serve` (port 0): refused at once instead of serving the new costs."""
    _change(written["table"])
    cmd = [sys.executable, "-m", "conductor", "replay", "serve", "--pool", str(written["pool"]), "--port", "0"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    except subprocess.TimeoutExpired:  # it served: the old code
        pytest.fail("replay serve served a table changed since its pool was written")
    assert done.returncode == 2 and "changed since the pool" in done.stderr, done.stderr


def test_eval_and_rollouts_refuse_a_changed_table_before_any_work(written, capsys):
    from conductor.evaluation import EvalConfig, evaluate

    _change(written["table"])
    out = written["dir"] / "ev"
    with pytest.raises(ConductorError, match="changed since the pool"):
        evaluate(EvalConfig(pool=written["pool"], queries=written["queries"], out=out, planner=False))
    assert not out.exists()
    data = written["dir"] / "data"
    assert cli_main(["policy", "rollouts", str(written["queries"]), "--pool", str(written["pool"]), "-k", "2",
                     "--data-dir", str(data), "--policy", "none", "--quiet"]) == 2
    assert "changed since the pool" in capsys.readouterr().err and not data.exists()


def test_rollouts_serve_refuses_a_changed_table_before_starting_the_server(written, capsys):
    import socket

    with socket.socket() as s:  # an address the OS chose, for the pool's workers to call
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = written["dir"] / "served.yaml"
    assert cli_main(["replay", "pool", "--table", str(written["table"]), "--out", str(pool),
                     "--api-base", f"http://127.0.0.1:{port}/v1"]) == 0
    _change(written["table"])
    capsys.readouterr()
    assert cli_main(["policy", "rollouts", str(written["queries"]), "--pool", str(pool), "-k", "2", "--serve",
                     "--data-dir", str(written["dir"] / "data"), "--policy", "none", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "changed since the pool" in err and f"--api-base http://127.0.0.1:{port}/v1" in err


def test_a_touched_or_copied_table_with_the_same_bytes_is_accepted(written):
    before = os.stat(written["table"])
    os.utime(written["table"], ns=(before.st_atime_ns, before.st_mtime_ns + 5_000_000_000))
    replay_source(load_pool(written["pool"]))  # same bytes: hashed, accepted
    # Same size, other bytes (a cost changed digit for digit): refused; only the hash tells
    data = bytearray(written["table"].read_bytes())
    data[len(data) // 2] ^= 0xFF
    written["table"].write_bytes(bytes(data))
    assert os.stat(written["table"]).st_size == before.st_size
    with pytest.raises(ConductorError, match="other bytes"):
        replay_source(load_pool(written["pool"]))


def test_a_pool_written_again_after_a_touch_keeps_its_run_identity(written):
    """The fingerprint guards the table; it is no part of what a run's answers depend on, so a
    pool written again (a new modification time recorded) resumes the runs made with it."""
    before = load_pool(written["pool"]).identity_hash()
    st = os.stat(written["table"])
    os.utime(written["table"], ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert cli_main(["replay", "pool", "--table", str(written["table"]), "--out", str(written["pool"])]) == 0
    again = load_pool(written["pool"])
    assert again.replay["fingerprint"]["modified_ns"] != st.st_mtime_ns
    assert again.identity_hash() == before


def test_a_pool_written_before_fingerprints_is_still_accepted(written):
    doc = yaml.safe_load(written["pool"].read_text())
    del doc["replay"]["fingerprint"]
    old = written["dir"] / "old.yaml"
    old.write_text(yaml.safe_dump(doc, sort_keys=False))
    _change(written["table"])
    assert replay_source(load_pool(old)).table == written["table"].resolve()


def test_a_mangled_fingerprint_is_refused_by_name(written):
    doc = yaml.safe_load(written["pool"].read_text())
    doc["replay"]["fingerprint"]["sha256"] = "nope"
    written["pool"].write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(ConductorError, match=r"replay\.fingerprint: sha256 must be 64"):
        replay_source(load_pool(written["pool"]))


# ---------------------------------------------------------------- F3: Parquet over a .yaml name


@pytest.mark.parametrize("suffix", [".yaml", ".YML"])
def test_replay_queries_never_writes_parquet_over_a_pool_file(written, capsys, suffix):
    target = written["pool"].with_suffix(suffix)
    if suffix != ".yaml":
        target.write_bytes(written["pool"].read_bytes())
    before = target.read_bytes()
    assert cli_main(["replay", "queries", "--table", str(written["table"]), "--out", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"--out {target}: a query set is Parquet" in err and ".parquet name" in err
    assert target.read_bytes() == before


def test_replay_convert_never_writes_parquet_over_a_yaml_name(tmp_path, capsys):
    wide = tmp_path / "wide.csv"
    pl.DataFrame({"sample_id": ["a"], "prompt": ["1+1?"], "m": [1.0], "m|model_response": ["2"],
                  "m|total_cost": [0.001]}).write_csv(wide)
    out = tmp_path / "long.yaml"
    out.write_text("version: 1\n")
    assert cli_main(["replay", "convert", "--wide", str(wide), "--out", str(out), "--category-column", "",
                     "--task", "math"]) == 2
    assert f"--out {out}: a replay table is Parquet" in capsys.readouterr().err
    assert out.read_text() == "version: 1\n"


# ---------------------------------------------------------------- F5: convert and --help


def test_convert_says_which_rows_task_map_left_without_a_task(tmp_path, capsys):
    wide = tmp_path / "wide.csv"
    pl.DataFrame({"sample_id": ["a", "b", "c"], "prompt": ["1+1?", "2+2?", "Pick A or B"],
                  "eval_name": ["grade-school-math", "grade-school-math", "arc-challenge"],
                  "m": [1.0, 0.0, 1.0], "m|model_response": ["2", "5", "A"],
                  "m|total_cost": [0.001, 0.001, 0.001]}).write_csv(wide)
    out = tmp_path / "long.parquet"
    assert cli_main(["replay", "convert", "--wide", str(wide), "--out", str(out),
                     "--task-map", "grade-school-math=math"]) == 0
    said = capsys.readouterr().out
    assert "1 of 3 row(s) matched no --task-map prefix and have no task (categories 'arc-challenge')" in said
    assert "--task" in said
    assert cli_main(["replay", "convert", "--wide", str(wide), "--out", str(out),
                     "--task-map", "grade-school-math=math", "--task", "choice"]) == 0
    assert "no task" not in capsys.readouterr().out


@pytest.mark.parametrize("command", [["replay", "queries"], ["replay", "pool"], ["graders", "check"]])
def test_replay_dir_help_says_the_default_is_beside_the_repository(command, capsys):
    with pytest.raises(SystemExit):
        cli_main([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "the folder that holds the repository" in text and "whatever the working directory" in text
