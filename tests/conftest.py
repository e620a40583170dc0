"""Shared test fixtures: a simulated worker pool over real HTTP on loopback, small
query sets cut from the committed samples, and a way to run the CLI as a user does."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# Started in the background by a shell without job control (`nohup make test &`, a scheduler),
# the tests inherit SIGINT ignored, and so would every process they start: the tests that
# interrupt a run or a grader with Ctrl-C's signal would see it ignored. Python's own handler
# here is reset to the default in each child at exec, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "queries" / "sample.parquet"
REPLAY = Path(os.environ.get("CONDUCTOR_REPLAY_DIR", REPO.parent / "shared" / "replay"))

# The server side of the simulated pool: models the tests' pools point at.
SIM_MODELS = {
    "fast": {"skill": 0.9, "latency_ms": {"mean": 5, "sd": 1}},
    "weak": {"skill": 0.3, "latency_ms": {"mean": 5, "sd": 1}},
    "slow": {"skill": 0.9, "latency_ms": {"mean": 300, "sd": 0}},
    "flaky": {"skill": 0.9, "latency_ms": {"mean": 5, "sd": 1}},
}


def pytest_ignore_collect(collection_path, config):
    """`make test-fast` (-m "not slow"): a module marked slow as a whole is not even
    imported, so the fast tier does not pay for loading vLLM, Dagster or a browser."""
    if (config.getoption("markexpr", "") == "not slow" and collection_path.suffix == ".py"
            and re.search(r"^pytestmark = \[?pytest\.mark\.slow\b", collection_path.read_text(), re.M)):
        return True
    return None


@pytest.fixture(scope="session")
def sample_queries(tmp_path_factory) -> Path:
    """60 queries of every task, from the committed sample set."""
    out = tmp_path_factory.mktemp("queries") / "small.parquet"
    pq.write_table(pq.read_table(SAMPLE).slice(0, 60), out)
    return out


@pytest.fixture(scope="session")
def sim(tmp_path_factory, sample_queries):
    from conductor.sim import start_sim

    d = tmp_path_factory.mktemp("sim")
    server_pool = d / "server.yaml"
    server_pool.write_text(yaml.safe_dump({"workers": [
        {"id": name, "model": f"openai/{name}", "simulate": spec} for name, spec in SIM_MODELS.items()]}))
    with start_sim(server_pool, [SAMPLE]) as handle:
        yield handle


@pytest.fixture
def fresh_sim(sim):
    """The session's server with an empty request log and no fault overrides; the faults a test sets
    are cleared after it too, for the tests that share the server without asking for a fresh one."""
    sim.clear_faults()
    sim.reset()
    yield sim
    sim.clear_faults()


PRICE_IN, PRICE_OUT = 1.0e-6, 2.0e-6  # worker()'s prices, per token


def first_queries(tmp_path_factory, sample_queries: Path, n: int) -> Path:
    """The first n queries of the sample set, for a module's runs."""
    out = tmp_path_factory.mktemp(f"first{n}") / f"q{n}.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, n), out)
    return out


def worker(name: str, url: str, provider: str = "sim", **extra) -> dict:
    return {"id": name, "model": f"openai/{name}", "provider": provider, "api_base": url,
            "description": f"simulated {name}", "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
            "params": {"temperature": 0, "max_tokens": 256}, **extra}


def serving(folder: Path, specs: dict):
    """A simulated server (conductor.sim) answering as `specs` says (worker id -> its `simulate`
    block; a `role` makes it a planner), over the sample set: a context manager giving its handle."""
    from conductor.sim import start_sim

    server = folder / "server.yaml"
    server.write_text(yaml.safe_dump({"workers": [
        {"id": n, "kind": "planner" if s.get("role") else "llm", "model": f"openai/{n}", "simulate": s}
        for n, s in specs.items()]}))
    return start_sim(server, [SAMPLE])


def write_pool(path: Path, url: str, names=("fast", "weak"), providers: dict | None = None,
               workers: list[dict] | None = None) -> Path:
    doc = {"providers": providers or {"sim": {"max_concurrency": 32, "timeout_s": 10}},
           "workers": workers if workers is not None else [worker(n, url) for n in names]}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 300):
    """Run `python -m conductor ARGS` as a user would; returns the completed process."""
    full_env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **(env or {})}
    return subprocess.run([sys.executable, "-m", "conductor", *map(str, args)], cwd=cwd or REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def cli(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI's entry function in this process, as `run_cli` would run the command:
    for input the command refuses before any work starts, and for whole runs whose test
    asserts nothing of the process itself (a signal, what is said at interpreter exit),
    where a new interpreter (seconds of imports each) buys nothing. Exit status, stdout and
    stderr as from a process; an exception the entry function does not turn into a message
    fails the test."""
    import contextlib
    import io

    from conductor.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def line_count(path: Path) -> int:
    """Lines in a file that may not exist yet (a journal the run has not opened)."""
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def kill_when_journaled(args: list, data: Path, lines: int, journal: str = "work/steps.jsonl",
                        timeout: float = 120) -> Path | None:
    """Run `conductor ARGS --data-dir DATA` in its own process group and SIGKILL it once the
    run's journal (`journal`, relative to the run folder) holds `lines` lines. Returns the
    run folder, or None if the run ended first; the process has exited either way."""
    cmd = [sys.executable, "-m", "conductor", *map(str, args), "--data-dir", str(data)]
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline, run_dir, killed = time.monotonic() + timeout, None, False
    while proc.poll() is None and time.monotonic() < deadline:
        runs = data / "runs"
        if run_dir is None and runs.exists() and any(runs.iterdir()):
            run_dir = next(runs.iterdir())
        if run_dir is not None and line_count(run_dir / journal) >= lines:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.005)
    proc.wait(timeout=30)
    return run_dir if killed else None
