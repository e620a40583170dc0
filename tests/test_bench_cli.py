"""The benchmark scripts (bench/*.py) on bad input, run as a user runs them: a bad value is
argparse's own message naming the flag (exit 2), not a traceback after minutes of work;
a peer that cannot run is reported, not the end of the run; nothing is left in /tmp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
UNUSED_URL = "http://127.0.0.1:9400/v1"  # never contacted: the run stops before any request


def bench(*args, env: dict | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env or ENV, capture_output=True,
                          text=True, timeout=timeout)


def refused(r: subprocess.CompletedProcess, *words: str) -> None:
    """argparse's refusal: exit 2, a usage line, every word in the message, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "usage:" in r.stderr, r.stderr
    for word in words:
        assert word in r.stderr, (word, r.stderr)


NOWHERE = "/nonexistent/conductor-bench-test"  # the other flags keep a run short, were the value let through


@pytest.mark.parametrize("script, args, flag", [
    ("executor", ["--concurrency", "0", "--only", "cache"], "--concurrency"),
    ("executor", ["--cache-calls", "0", "--only", "cache"], "--cache-calls"),  # printed a ratio of 0 calls
    ("executor", ["--rpm", "nan", "--only", "rpm"], "--rpm"),
    ("enrich", ["--rows", "0"], "--rows"),
    ("batch", ["--expire", "1.5", "--steps", "2", "--delay-s", "0"], "--expire"),
    ("ceiling", ["--cheap", "-1", "--work", NOWHERE], "--cheap"),
    ("peers", ["litellm", "--url", UNUSED_URL, "--calls", "0", "--retries", "0"], "--calls"),
    ("planner", ["--samples", "0", "--model", NOWHERE], "--samples"),
    ("policy", ["--samples", "0", "--replay-dir", NOWHERE], "--samples"),
    ("policy", ["--explore", "nan", "--replay-dir", NOWHERE], "--explore"),
    ("resplit", ["--folds", "0", "--replay-dir", NOWHERE], "--folds"),
    ("scale", ["--workers", "0", "--only", "shared"], "--workers"),
    ("scale", ["--budget", "0", "--only", "budget", "--budget-calls", "4", "--workers", "1"], "--budget"),
    ("startup", ["--repeat", "0"], "--repeat"),
])
def test_a_bad_number_is_named_by_argparse(script, args, flag):
    refused(bench(f"bench/{script}.py", *args), f"argument {flag}:")


def test_policy_names_a_missing_table_before_any_work(tmp_path):
    r = bench("bench/policy.py", "--tables", tmp_path / "missing.parquet", "--lambdas", "0", "--work", tmp_path / "w")
    refused(r, "--tables", "missing.parquet")
    assert not (tmp_path / "w").exists()


def test_ceiling_names_a_missing_table(tmp_path):
    refused(bench("bench/ceiling.py", "--work", tmp_path, "--table", tmp_path / "nope.parquet"),
            "--table", "nope.parquet")


def test_policy_names_the_replay_folder_flag_and_variable(tmp_path):
    """The flag is --replay-dir, the variable the code reads CONDUCTOR_REPLAY_DIR."""
    r = bench("bench/policy.py", "--datasets", "gsm8k", "--replay-dir", tmp_path / "none", "--work", tmp_path / "w")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "--replay-dir" in r.stderr and "$CONDUCTOR_REPLAY_DIR" in r.stderr, r.stderr


def test_disk_full_answers_help_without_running():
    r = bench("bench/disk_full.py", "--help", timeout=60)
    assert r.returncode == 0 and "usage:" in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert "run 1" not in r.stdout and "needs root" not in r.stdout


def test_a_peer_that_cannot_be_installed_is_reported_and_the_run_goes_on(tmp_path):
    """A file where the peers' folder should be: Curator's venv cannot be made (as with no
    network), yet conductor's figure is printed and the table says Curator was not measured."""
    blocker = tmp_path / "peers"
    blocker.write_text("a file in the way")
    r = bench("bench/executor.py", "--only", "throughput", "--calls", "50", "--concurrency", "8",
              "--peers", "curator", "--peers-dir", blocker, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("1. throughput"))
    assert "conductor " in line and "curator not measured: " in line, r.stdout
    assert "conductor / Curator" in r.stdout and "curator not measured: could not create" in r.stdout, r.stdout


def test_curator_peer_removes_its_temporary_folder(tmp_path):
    """Curator itself replaced by a stub (no install, no network): its cache folder under
    the temp dir is gone after the run."""
    stub = tmp_path / "stub" / "bespokelabs"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "curator.py").write_text(
        "class LLM:\n"
        "    def __init__(self, **kwargs):\n"
        "        pass\n\n"
        "    def __call__(self, rows):\n"
        "        return [{'response': self.parse(r, self.prompt(r))['response']} for r in rows]\n")
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**ENV, "TMPDIR": str(temp), "PYTHONPATH": str(stub.parent)}
    r = bench("bench/peers.py", "curator", "--url", UNUSED_URL, "--calls", "3", env=env)
    assert r.returncode == 0 and '"completed": 3' in r.stdout, r.stderr[-3000:]
    assert not list(temp.glob("curator-bench-*"))


def test_schemas_module_answers_help_and_refuses_unknown_arguments():
    r = bench("-m", "conductor.schemas", "--help", timeout=60)
    assert r.returncode == 0 and "usage:" in r.stdout and "schema" in r.stdout, r
    assert "|---" not in r.stdout  # not the tables themselves
    refused(bench("-m", "conductor.schemas", "--bogus", timeout=60), "unrecognized arguments: --bogus")
    assert "|---" in bench("-m", "conductor.schemas", timeout=60).stdout


def test_a_rate_limit_run_within_one_window_is_not_reported_met():
    """--quick's 20 s run at the 60 s window's rate cannot draw a 429: "met" would claim that untested."""
    from argparse import Namespace

    from bench.executor import table

    row = {"rpm": 3000, "calls": 1000, "seconds": 20.4, "ideal_s": 20.0, "wall_ideal": 1.02, "429s": 0, "lost": 0}
    text = table({"rpm": {**row, "window_s": 60.0}, "rpm1s": {**row, "window_s": 1.0}}, Namespace(concurrency=64))
    window60, window1 = [line for line in text.splitlines() if "rpm (" in line]
    assert "429s not tested (run within one window); True" in window60  # its pace and losses still count
    assert "True" in window1 and "not tested" not in window1
    slow = {**row, "window_s": 60.0, "wall_ideal": 1.2}
    assert "not tested (run within one window); False" in table({"rpm": slow}, Namespace(concurrency=64))


def test_a_failing_section_is_named_and_the_next_one_still_runs(monkeypatch, capsys):
    """One broken measurement used to end the benchmark with a traceback and no table at all."""
    import bench.executor as executor

    def broken(*args, **kwargs):
        raise RuntimeError("the cache went away")

    monkeypatch.setattr(executor, "cache_rerun", broken)
    monkeypatch.setattr(sys, "argv", ["executor.py", "--only", "cache", "memory", "--memory-steps", "20"])
    with pytest.raises(SystemExit) as exit_:
        executor.main()
    printed = capsys.readouterr().out
    assert "1 section(s) failed: cache" in str(exit_.value)
    assert "cache: FAILED, not measured: the cache went away" in printed
    assert "memory" in printed.split("measurement")[1]  # the memory row is in the table
