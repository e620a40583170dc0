"""A simulated server that also serves planner models, for the LLM planner and
re-planning tests, and the pools and query sets those tests share."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import SAMPLE, worker, write_pool

SERVED = {
    "fast": {"skill": 0.9, "latency_ms": {"mean": 5, "sd": 1}},
    "weak": {"skill": 0.3, "latency_ms": {"mean": 5, "sd": 1}},
    # Plans with no re-planning step, and plans where every step after the first re-plans.
    "sim-planner": {"role": "planner", "latency_ms": {"mean": 5, "sd": 1}},
    "sim-replanner": {"role": "planner", "replan_rate": 1.0, "latency_ms": {"mean": 5, "sd": 1}},
}
PLANNER_PRICE = {"input_per_mtok": 3.0, "output_per_mtok": 6.0}


def start(directory: Path, served: dict | None = None, env: dict | None = None):
    from conductor.sim import start_sim

    server_pool = directory / "server.yaml"
    server_pool.write_text(yaml.safe_dump({"workers": [
        {"id": name, "kind": "planner" if spec.get("role") == "planner" else "llm", "model": f"openai/{name}",
         "simulate": spec} for name, spec in (SERVED if served is None else served).items()]}))
    return start_sim(server_pool, [SAMPLE], env=env)


def start_keyed(directory: Path, key_env: str, right_key: str):
    """A server whose planner model demands the key in `key_env` (a wrong one is answered 401 over
    HTTP, as a hosted provider answers it); no re-planner."""
    served = {name: spec for name, spec in SERVED.items() if name != "sim-replanner"}
    served["sim-planner"] = {**SERVED["sim-planner"], "require_key_env": key_env}
    return start(directory, served, env={key_env: right_key})


def planner_worker(url: str, model: str = "sim-planner", wid: str = "conductor", provider: str = "sim",
                   **extra) -> dict:
    return {"id": wid, "kind": "planner", "model": f"openai/{model}", "provider": provider, "api_base": url,
            "description": "the conductor itself: plans and runs a sub-workflow for its instruction",
            "price": PLANNER_PRICE, **extra}


def pool_file(path: Path, url: str, *, planner: dict | None = None, providers: dict | None = None,
              vote: bool = True, price: dict | None = None) -> Path:
    extra = {"price": price} if price else {}
    workers = [worker("fast", url, **extra), worker("weak", url, **extra)]
    if vote:
        workers.append({"id": "vote", "kind": "function", "function": "vote"})
    if planner is not None:
        workers.append(planner)
    return write_pool(path, url, workers=workers, providers=providers)


def math_queries(path: Path, n: int) -> Path:
    """n one-line math questions: a plan's instruction can quote them verbatim
    under the planner schema (no quotes, backslashes or newlines), so the
    simulated workers recognize them."""
    t = pq.read_table(SAMPLE)
    keep = [i for i, (task, prompt) in enumerate(zip(t.column("task").to_pylist(), t.column("prompt").to_pylist()))
            if task == "math" and not re.search(r'["\\\n]', prompt) and len(prompt) < 300
            and prompt.isascii()][:n]
    assert len(keep) == n, f"the sample set has only {len(keep)} such questions"
    pq.write_table(t.take(keep), path)
    return path


# Fixtures the LLM-planner and re-planning tests share (imported by name there).
@pytest.fixture(scope="module")
def psim(tmp_path_factory):
    with start(tmp_path_factory.mktemp("psim")) as handle:
        yield handle


@pytest.fixture
def sim(psim):
    psim.clear_faults()
    psim.reset()
    return psim


@pytest.fixture(scope="module")
def queries(tmp_path_factory):
    return math_queries(tmp_path_factory.mktemp("q") / "math.parquet", 12)


def slow_planning(sim, tmp_path: Path, queries: Path, *extra: str):
    """`conductor run ... --planner llm` on a planner that takes 1.5 s a call (4 at a time),
    started as a user would, once its planning journal holds 4 answers: for the tests that stop
    planning mid-way. Returns the process, its arguments (to rerun) and its data folder."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO, line_count

    sim.reset()
    sim.set_faults("sim-planner", latency_ms=1500, latency_sd_ms=0)
    pool = pool_file(tmp_path / "pool.yaml", sim.url, planner=planner_worker(sim.url),
                     providers={"sim": {"max_concurrency": 4}})
    data = tmp_path / "data"
    args = ["run", str(queries), "--pool", str(pool), "--planner", "llm", "--samples", "3",
            "--planner-option", "worker=conductor", "--no-cache", "--data-dir", str(data), *extra]
    p = subprocess.Popen([sys.executable, "-m", "conductor", *args], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not any(line_count(j) >= 4 for j in data.glob("runs/*/work/planner/steps.jsonl")):
        if p.poll() is not None or time.monotonic() > deadline:  # a broken planner, said as such
            p.kill()
            raise AssertionError(f"planning did not get under way: {p.communicate()[1]}")
        time.sleep(0.02)
    return p, args, data
