"""audit63 F4, F5, F6, F7, F12, F13, F15: what a run records and says when it is rerun, resumed,
interrupted or refused. Real `conductor run` processes (or the runner API, as the demo and
Dagster call it) against the simulated pool over HTTP on loopback; real signals."""

from __future__ import annotations

import csv
import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import REPO, SAMPLE, SIM_MODELS, cli, run_cli, write_pool


def free_port() -> int:
    """A loopback port free now, for a server the pool must name before it starts."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def _server_pool(path: Path) -> Path:
    path.write_text(yaml.safe_dump({"workers": [
        {"id": name, "model": f"openai/{name}", "simulate": spec} for name, spec in SIM_MODELS.items()]}))
    return path


@pytest.fixture
def fresh(fresh_sim):
    """The session's simulated server (tests/conftest.py), its log and faults cleared."""
    return fresh_sim


def _queries(tmp_path: Path, n: int, name: str = "q") -> Path:
    path = tmp_path / f"{name}{n}.parquet"
    pq.write_table(pq.read_table(SAMPLE).slice(0, n), path)
    return path


def _manifest(data: Path) -> dict:
    return orjson.loads(next(data.glob("runs/*/manifest.json")).read_bytes())


def _summary_file(data: Path) -> dict:
    return orjson.loads(next(data.glob("runs/*/summary.json")).read_bytes())


def _csv(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text)))


# ---- F4: settings that shape the outputs are recorded, and a rerun that changes one says so ----

def test_a_rerun_with_another_cost_penalty_says_so_and_the_run_records_it(tmp_path, fresh):
    """A rerun with --cost-penalty 100 rewrote rewards.parquet and mean_reward without a word,
    and nothing said which penalty the rewards were graded with."""
    pool = write_pool(tmp_path / "pool.yaml", fresh.url, names=("fast", "weak"))
    data = tmp_path / "data"
    cmd = ("run", _queries(tmp_path, 6), "--pool", pool, "--data-dir", data, "--quiet", "-k", "2")
    first = run_cli(*cmd)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "note:" not in first.stderr, first.stderr
    assert _manifest(data)["settings"]["cost_penalty"] == 0
    reward0 = _summary_file(data)["mean_reward"]

    again = run_cli(*cmd, "--cost-penalty", "100")
    assert again.returncode == 0 and "(resumed)" in again.stdout, again.stdout + again.stderr
    assert "rewards regraded with --cost-penalty 100 (was 0)" in again.stderr, again.stderr
    summary = _summary_file(data)
    assert summary["mean_reward"] < reward0  # regraded, as the note says
    assert summary["settings"]["cost_penalty"] == 100 and _manifest(data)["settings"]["cost_penalty"] == 100
    changed = _manifest(data)["settings_changed"]
    assert [(c["setting"], c["from"], c["to"]) for c in changed] == [("cost_penalty", 0, 100)]
    r = cli("sql", "SELECT summary->'settings'->>'cost_penalty' AS penalty FROM runs", "--data-dir", data,
            "--format", "csv")
    assert _csv(r.stdout)[1:] == [["100.0"]], r.stdout + r.stderr

    # The plain rerun switches back to no penalty: said too.
    back = run_cli(*cmd)
    assert back.returncode == 0, back.stdout + back.stderr
    assert "rewards regraded with --cost-penalty 0 (was 100)" in back.stderr, back.stderr
    assert _summary_file(data)["mean_reward"] == pytest.approx(reward0)


def test_a_rerun_of_a_finished_run_with_another_depth_or_budget_says_it_changed_nothing(tmp_path, fresh):
    """--max-depth and --budget were not recorded: a rerun with other values resumed the run as if
    they applied. Every plan had run, so they change nothing, and the run keeps its own."""
    pool = write_pool(tmp_path / "pool.yaml", fresh.url, names=("fast",))
    data = tmp_path / "data"
    cmd = ("run", _queries(tmp_path, 4), "--pool", pool, "--data-dir", data, "--quiet")
    assert run_cli(*cmd).returncode == 0
    r = run_cli(*cmd, "--max-depth", "3", "--budget", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--max-depth 3 changed nothing: every plan had already run, with --max-depth 1" in r.stderr, r.stderr
    assert "--budget 2 changed nothing: every plan had already run, with no --budget" in r.stderr, r.stderr
    settings = _summary_file(data)["settings"]
    assert (settings["max_depth"], settings["budget_usd"]) == (1, None), settings


# ---- F5: every run records the exit code `conductor run` would give ---------------------------

def test_a_run_made_through_the_runner_api_is_picked_by_the_readme_filter(tmp_path, fresh):
    """The demo and Dagster call the runner without a --max-failed-share: exit_code was null, so
    the README's "pick usable runs" filter dropped even a clean run."""
    from conductor.runner import RunConfig, run_all

    pool = write_pool(tmp_path / "pool.yaml", fresh.url, names=("fast",))
    data = tmp_path / "data"
    good = run_all(RunConfig(queries=_queries(tmp_path, 4, "good"), pool=pool, data_dir=data, progress=False))
    fresh.set_faults("fast", fail_status=404)
    bad = run_all(RunConfig(queries=_queries(tmp_path, 3, "bad"), pool=pool, data_dir=data, progress=False,
                            cache=False))
    assert (good["exit_code"], bad["exit_code"]) == (0, 4)  # what `conductor run` exits with, at its default 5%
    r = cli("sql", "SELECT run_id FROM runs WHERE status = 'complete' AND (summary->>'exit_code') = '0'",
            "--data-dir", data, "--format", "csv")
    assert _csv(r.stdout)[1:] == [[good["run_id"]]], r.stdout + r.stderr


# ---- F6, F7: an interrupted run keeps what it paid and how long it ran -------------------------

def _interrupted(tmp_path: Path, sim, sig: str, n: int, after_calls: int) -> tuple[list[str], float, int]:
    """`conductor run` on n queries of a slow worker (2 calls at a time, 0.3 s each), stopped by
    `sig` once the server has seen `after_calls` calls. Returns its arguments, its time from its
    first call to its exit (less than the command's own), and its exit status."""
    pool = write_pool(tmp_path / "pool.yaml", sim.url, names=("slow",), providers={"sim": {"max_concurrency": 2}})
    args = ["run", str(_queries(tmp_path, n)), "--pool", str(pool), "--data-dir", str(tmp_path / "data"),
            "--quiet", "--no-cache"]
    p = subprocess.Popen([sys.executable, "-m", "conductor", *args], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    deadline = time.monotonic() + 60
    while sim.log()["total"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    first_call = time.monotonic()
    while sim.log()["total"] < after_calls and time.monotonic() < deadline:
        time.sleep(0.02)
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=60)
    assert "rerun the same command to resume" in err, err
    return args, time.monotonic() - first_call, p.returncode


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupted_run_keeps_what_it_paid_in_its_manifest(tmp_path, fresh, sig, code):
    """An interrupted run's manifest had no spend and a null summary: what it paid was in its
    journal alone (lost for good with work/)."""
    args, _, status = _interrupted(tmp_path, fresh, sig, 24, 8)
    assert status == code
    data = tmp_path / "data"
    m = _manifest(data)
    assert m["status"] == "interrupted" and m.get("summary") is None
    run_cap = next(c for c in m["spend"] if c["cap"] == "run")
    assert run_cap["spent_usd"] > 0, m["spend"]  # the calls it made and paid for
    assert m["lost_in_flight"]["calls"] == 0, m["lost_in_flight"]  # those in flight were awaited, not lost
    r = run_cli(*args)
    assert r.returncode == 0 and "(resumed)" in r.stdout, r.stdout + r.stderr
    assert run_cap["spent_usd"] <= _summary_file(data)["cost_usd"] + 1e-9  # part of what the whole run paid


def test_the_wall_time_of_a_resumed_run_counts_the_interrupted_command(tmp_path, fresh):
    """A run that executed for about a minute, interrupted near its end, reported the 1.3 s of the
    command that resumed it."""
    args, ran, status = _interrupted(tmp_path, fresh, "SIGINT", 24, 20)  # most of the work in this command
    assert status == 130
    data = tmp_path / "data"
    t0 = time.monotonic()
    r = run_cli(*args)
    resumed = time.monotonic() - t0
    assert r.returncode == 0 and "(resumed)" in r.stdout, r.stdout + r.stderr
    wall = _summary_file(data)["wall_time_s"]
    assert ran * 0.95 <= wall <= ran + resumed + 5, (wall, ran, resumed)  # both commands, each once
    # Counted once: the next rerun adds only its own time.
    t0 = time.monotonic()
    again = run_cli(*args)
    assert again.returncode == 0
    assert wall <= _summary_file(data)["wall_time_s"] <= wall + (time.monotonic() - t0)


# ---- F12: the --run-id rule as it is ----------------------------------------------------------

@pytest.mark.parametrize("run_id", [".hidden", "a" * 300])
def test_a_refused_run_id_is_told_the_rule_it_breaks(tmp_path, run_id):
    """'.hidden' and a 300-character id were told to use letters, digits, '-', '_' and '.' only,
    which they do."""
    pool = write_pool(tmp_path / "pool.yaml", f"http://127.0.0.1:{free_port()}/v1", names=("fast",))
    r = cli("run", _queries(tmp_path, 2), "--pool", pool, "--data-dir", tmp_path / "data", "--run-id", run_id)
    assert r.returncode == 2
    assert "use up to 128 letters, digits, '-', '_' and '.', not starting with '.'" in r.stderr, r.stderr
    assert not (tmp_path / "data" / "runs").exists() or not any((tmp_path / "data" / "runs").iterdir())


# ---- F13: the run-exists refusal names what differs -------------------------------------------

def test_the_run_exists_refusal_names_what_differs(tmp_path, fresh):
    pool = write_pool(tmp_path / "pool.yaml", fresh.url, names=("fast",))
    data = tmp_path / "data"
    queries = _queries(tmp_path, 3)
    r = run_cli("run", queries, "--pool", pool, "--data-dir", data, "--quiet", "--run-id", "myrun")
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli("run", queries, "--pool", pool, "--data-dir", data, "--quiet", "--run-id", "myrun", "-k", "2",
            "--seed", "7")
    assert r.returncode == 2 and "run myrun already exists" in r.stderr, r.stderr
    assert "samples: 1 → 2" in r.stderr and "seed: 0 → 7" in r.stderr, r.stderr
    r = cli("run", _queries(tmp_path, 4), "--pool", pool, "--data-dir", data, "--quiet", "--run-id", "myrun")
    assert r.returncode == 2 and "the queries file's content differs" in r.stderr, r.stderr
    assert "samples" not in r.stderr, r.stderr


# ---- F15: a finished run's rerun sends nothing, so it needs no endpoint ------------------------

def test_rerunning_a_complete_run_with_its_journal_needs_no_endpoint(tmp_path):
    """With work/ kept, the rerun of a complete run failed the endpoint preflight once the server
    was down (exit 2), though it had nothing to send; the same run without work/ succeeded."""
    from conductor.sim import start_sim

    data = tmp_path / "data"
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    pool = write_pool(tmp_path / "pool.yaml", url, names=("fast", "weak"))
    cmd = ("run", _queries(tmp_path, 5), "--pool", pool, "--data-dir", data, "--quiet", "-k", "2")
    with start_sim(_server_pool(tmp_path / "server.yaml"), [SAMPLE], port=port):
        r = run_cli(*cmd)
        assert r.returncode == 0, r.stdout + r.stderr
    assert next(data.glob("runs/*/work/steps.jsonl")).exists()
    before = _summary_file(data)
    r = run_cli(*cmd, "--cost-penalty", "10")  # the server is down: nothing is sent, the run is regraded
    assert r.returncode == 0 and "(resumed)" in r.stdout, r.stdout + r.stderr
    assert "cannot reach" not in r.stderr, r.stderr
    after = _summary_file(data)
    assert (after["calls"], after["cost_usd"], after["statuses"]) == (before["calls"], before["cost_usd"],
                                                                      before["statuses"])
    # A run with plans left still checks its endpoints first, before any call.
    r = run_cli("run", _queries(tmp_path, 6), "--pool", pool, "--data-dir", data, "--quiet")
    assert r.returncode == 2 and "cannot reach" in r.stderr, r.stdout + r.stderr
