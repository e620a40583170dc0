"""An enrichment job planned by the LLM planner whose key variable is unset: `job run` refuses
before any call and before any run folder stays (exit 2), naming the variable and never a key, and an
earlier run's records are kept as they were, so the rerun with the key sends only the new row.
`job check` checks the file, not the environment: it passes, and calls nothing."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import SAMPLE, cli, files_under, run_cli

KEY = "CONDUCTOR_TEST_PLANNER_KEY_42"
SECRET = "k42-planner-secret-value"
PRICE = "{input_per_mtok: 1, output_per_mtok: 2}"
SERVED = {"fast": {"skill": 0.9, "latency_ms": {"mean": 5, "sd": 1}},
          "sim-planner": {"role": "planner", "latency_ms": {"mean": 5, "sd": 1}, "require_key_env": KEY}}


@pytest.fixture(scope="module")
def ksim(tmp_path_factory):
    """A simulated server whose planner model demands the key held in KEY (its own environment only)."""
    from conductor.sim import start_sim

    server = tmp_path_factory.mktemp("ksim") / "server.yaml"
    server.write_text(yaml.safe_dump({"workers": [
        {"id": n, "kind": "planner" if s.get("role") else "llm", "model": f"openai/{n}", "simulate": s}
        for n, s in SERVED.items()]}))
    with start_sim(server, [SAMPLE], env={KEY: SECRET}) as handle:
        yield handle


@pytest.fixture
def sim(ksim, monkeypatch):
    monkeypatch.delenv(KEY, raising=False)  # unset for this process and every command it starts
    ksim.reset()
    return ksim


def notes(folder: Path, n: int) -> None:
    pq.write_table(pa.table({"note_id": [f"n{i}" for i in range(1, n + 1)],
                             "body": ["all fine", "it broke", "so so"][:n]}), folder / "in.parquet")


def job_file(folder: Path, url: str, planner: str, planner_worker: bool) -> Path:
    """A planned job over two notes; the planner's provider holds its key in KEY."""
    notes(folder, 2)
    extra = (f'\n  - {{id: planner, kind: planner, model: openai/sim-planner, provider: plan, api_base: "{url}", '
             f"price: {PRICE}}}") if planner_worker else ""
    (folder / "pool.yaml").write_text(textwrap.dedent(f"""\
        providers:
          sim: {{max_concurrency: 4}}
          plan: {{max_concurrency: 4, api_key_env: {KEY}}}
        workers:
          - {{id: fast, model: openai/fast, provider: sim, api_base: "{url}", price: {PRICE}}}""") + extra + "\n")
    job = folder / "job.yaml"
    job.write_text(textwrap.dedent("""\
        name: notes
        input: {path: in.parquet, id: note_id}
        prompt: |
          Note: {{ body }}
        fields:
          mood: {type: enum, values: [good, bad], required: true}
        pool: pool.yaml
        mode: planned
        """) + f"planner: {planner}\n")
    return job


def snapshot(data: Path) -> dict[Path, bytes]:
    """Every file under the data folder but the job's lock (which holds the last holder's pid)."""
    return {p: p.read_bytes() for p in files_under(data) if ".locks" not in p.parts}


def assert_refused(r, sim) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"environment variable {KEY} is not set" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and SECRET not in r.stdout + r.stderr
    assert sim.log()["total"] == 0  # no planning call, no worker call


def test_a_rerun_without_the_planners_key_refuses_and_keeps_the_earlier_records(sim, tmp_path):
    job = job_file(tmp_path, sim.url, "{name: llm, worker: planner}", planner_worker=True)
    data = tmp_path / "data"
    first = run_cli("job", "run", job, "--data-dir", data, "--quiet", env={KEY: SECRET})
    assert first.returncode == 0, first.stderr
    assert sim.log()["by_model"].get("sim-planner") == 2  # the planner did plan, with the key
    assert not any(SECRET.encode() in body for body in snapshot(data).values())

    notes(tmp_path, 3)  # a new row: this run has a row to plan
    before, runs = snapshot(data), sorted(p.name for p in (data / "runs").iterdir())
    sim.reset()
    r = run_cli("job", "run", job, "--data-dir", data, "--quiet")
    assert_refused(r, sim)
    assert "(needed by planner)" in r.stderr
    assert snapshot(data) == before  # no run folder stays, nothing rewritten
    assert sorted(p.name for p in (data / "runs").iterdir()) == runs
    seen = cli("sql", "--data-dir", data, "--format", "csv", "select note_id, status from notes order by 1")
    assert seen.returncode == 0 and seen.stdout.split() == ["note_id,status", "n1,ok", "n2,ok"], seen.stderr

    again = run_cli("job", "run", job, "--data-dir", data, "--quiet", env={KEY: SECRET})
    assert again.returncode == 0, again.stderr
    assert "computed 1, reused 2" in again.stdout  # the two earlier records were kept, not asked again
    assert sim.log()["by_model"].get("sim-planner") == 1


def test_a_model_planner_without_its_key_refuses_before_the_first_run_writes_anything(sim, tmp_path):
    planner = (f'{{name: llm, model: openai/sim-planner, api_base: "{sim.url}", api_key_env: {KEY}, '
               f"price: {PRICE}}}")
    job = job_file(tmp_path, sim.url, planner, planner_worker=False)
    data = tmp_path / "data"
    r = run_cli("job", "run", job, "--data-dir", data, "--quiet")
    assert_refused(r, sim)
    assert "LLM planner" in r.stderr and "openai/sim-planner" in r.stderr
    assert snapshot(data) == {}  # no run folder, no catalog


@pytest.mark.parametrize("planner_worker", [True, False])
def test_job_check_passes_the_file_and_calls_nothing(sim, tmp_path, planner_worker):
    planner = ("{name: llm, worker: planner}" if planner_worker else
               f'{{name: llm, model: openai/sim-planner, api_base: "{sim.url}", api_key_env: {KEY}, price: {PRICE}}}')
    job = job_file(tmp_path, sim.url, planner, planner_worker=planner_worker)
    files = files_under(tmp_path)
    r = cli("job", "check", job)
    assert r.returncode == 0 and r.stdout.strip() == "job notes: ok (2 rows, 1 field(s), planned mode)", r.stderr
    assert sim.log()["total"] == 0 and files_under(tmp_path) == files
