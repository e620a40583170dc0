"""audit65: what `conductor run` with a model planner checks before planning is paid for (F1),
an unpriced or misspelled planner provider (F2, F3), whether a fix keeps the run (F4), the
vLLM engine's root cause (F6), and planner seeds (F10)."""

from __future__ import annotations

import json

import pytest
import yaml

from conductor.errors import ConductorError
from conductor.planners import make_planner
from tests import plannersim
from tests.conftest import cli, worker
from tests.plannersim import psim, queries, sim  # noqa: F401  (shared fixtures)

LLM = ["--planner", "llm", "--planner-option", "worker=conductor", "--quiet"]


def pool_with(tmp_path, url, *, large: dict | None = None, key_env: str | None = None, name="pool.yaml"):
    """fast on sim, `large` on its own provider (with `key_env` as its key variable), and the planner."""
    providers = {"sim": {"max_concurrency": 32, "timeout_s": 10},
                 "big": {"max_concurrency": 8, "timeout_s": 10, **({"api_key_env": key_env} if key_env else {})}}
    workers = [worker("fast", url), {**worker("weak", url, provider="big"), "id": "large", **(large or {})},
               plannersim.planner_worker(url)]
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"providers": providers, "workers": workers}, sort_keys=False))
    return path


def runs_in(data):
    return sorted(p.name for p in (data / "runs").iterdir()) if (data / "runs").exists() else []


# ---- F1: the workers are checked before any planning call ---------------------------------

@pytest.mark.parametrize("large, key_env, says", [
    (None, "AUDIT65_UNSET_KEY", "environment variable AUDIT65_UNSET_KEY is not set (needed by large)"),
    ({"api_base": "http://127.0.0.1:1/v1"}, None, "large: cannot reach http://127.0.0.1:1/v1"),
    ({"model": "openai/weka"}, None, "does not serve model 'weka'"),
])
def test_llm_planner_refuses_a_broken_worker_before_any_planning_call(sim, tmp_path, queries, monkeypatch,
                                                                      large, key_env, says):
    monkeypatch.delenv("AUDIT65_UNSET_KEY", raising=False)
    pool = pool_with(tmp_path, sim.url, large=large, key_env=key_env)
    r = cli("run", queries, "--pool", pool, "--data-dir", tmp_path / "data", *LLM)
    assert r.returncode == 2, r.stderr
    assert "cannot start planning (nothing was written or called)" in r.stderr and says in r.stderr
    assert sim.log()["total"] == 0  # not one planning call paid
    assert runs_in(tmp_path / "data") == []


def test_vllm_planner_refuses_a_broken_worker_before_the_engine_starts(sim, tmp_path, queries, monkeypatch):
    monkeypatch.delenv("AUDIT65_UNSET_KEY", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # never read: the refusal comes first
    pool = pool_with(tmp_path, sim.url, key_env="AUDIT65_UNSET_KEY")
    r = cli("run", queries, "--pool", pool, "--data-dir", tmp_path / "data", "--planner", "vllm",
            "--planner-model", model, "--quiet")
    assert r.returncode == 2 and "cannot start planning (nothing was written or called)" in r.stderr, r.stderr
    assert "AUDIT65_UNSET_KEY is not set" in r.stderr and runs_in(tmp_path / "data") == []
    assert f"(pool file {pool})" in r.stderr, r.stderr  # which file to fix (audit65 F11)


def test_a_resumed_run_not_yet_planned_is_checked_and_resumes_once_the_key_is_set(sim, tmp_path, queries,
                                                                                  monkeypatch):
    from conductor.pool import load_pool
    from conductor.runner import RunConfig, prepare

    monkeypatch.delenv("AUDIT65_UNSET_KEY", raising=False)
    pool = pool_with(tmp_path, sim.url, key_env="AUDIT65_UNSET_KEY")
    data = tmp_path / "data"
    cfg = RunConfig(queries=queries, pool=pool, data_dir=data, planner="llm",
                    planner_options={"worker": "conductor"}, progress=False)
    run_id = prepare(cfg, load_pool(pool)).dir.run_id  # a run whose folder exists, with no plans yet
    r = cli("run", queries, "--pool", pool, "--data-dir", data, *LLM)
    assert r.returncode == 2 and "cannot start planning (no call was made)" in r.stderr, r.stderr
    assert f"Fixed by setting the variable, the same command resumes its planning (run {run_id})" in r.stderr
    assert sim.log()["total"] == 0

    monkeypatch.setenv("AUDIT65_UNSET_KEY", "anything")  # the simulated server asks for no key
    r = cli("run", queries, "--pool", pool, "--data-dir", data, *LLM)
    assert r.returncode == 0, r.stderr
    assert runs_in(data) == [run_id]


def test_a_complete_runs_rerun_is_not_checked(sim, tmp_path, queries, monkeypatch):
    monkeypatch.setenv("AUDIT65_KEY", "anything")
    pool = pool_with(tmp_path, sim.url, key_env="AUDIT65_KEY")
    args = ["run", queries, "--pool", pool, "--data-dir", tmp_path / "data", *LLM]
    assert cli(*args).returncode == 0
    monkeypatch.delenv("AUDIT65_KEY")
    sim.reset()
    r = cli(*args)  # nothing is left to call: nothing is checked, the summary comes from the run
    assert r.returncode == 0 and "(resumed)" in r.stdout + r.stderr, r.stderr
    assert sim.log()["total"] == 0



@pytest.mark.slow  # a real Dagster materialization
def test_the_dagster_plans_asset_refuses_a_broken_worker_before_any_planning_call(sim, tmp_path, queries,
                                                                                  monkeypatch):
    """The check was `conductor run`'s alone: the `plans` asset (and `job run`, planned) paid for
    every planning call, then failed in `executions` on the unset key."""
    from dagster import DagsterInstance, materialize

    from assets import resources
    from assets.pipeline import plans, query_set
    from tests.test_dagster import add_partition, conductor_env

    monkeypatch.delenv("AUDIT65_UNSET_KEY", raising=False)
    pool = pool_with(tmp_path, sim.url, key_env="AUDIT65_UNSET_KEY")
    res = resources.from_env(conductor_env(tmp_path, pool, CONDUCTOR_PLANNER="llm",
                                           CONDUCTOR_PLANNER_OPTIONS=json.dumps({"worker": "conductor"})))
    with DagsterInstance.ephemeral() as inst:
        add_partition(inst, res, "math", queries)
        result = materialize([query_set, plans], partition_key="math", instance=inst, resources=res,
                             raise_on_error=False)
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failure.step_key == "plans"
    message = failure.event_specific_data.error.to_string()  # with its cause, conductor's message
    assert "cannot start planning (no call was made)" in message and "AUDIT65_UNSET_KEY is not set" in message
    assert sim.log()["total"] == 0  # not one planning call paid
    [run_id] = runs_in(tmp_path / "data")
    assert not (tmp_path / "data" / "runs" / run_id / "plans.parquet").exists()


# ---- F4: whether the fix keeps the run ------------------------------------------------------

def test_check_ready_says_which_fix_resumes_the_run_and_which_starts_a_new_one(sim, tmp_path, queries,
                                                                               monkeypatch):
    monkeypatch.delenv("AUDIT65_UNSET_KEY", raising=False)
    data = tmp_path / "data"
    pool = pool_with(tmp_path, sim.url, key_env="AUDIT65_UNSET_KEY")
    r = cli("run", queries, "--pool", pool, "--data-dir", data, "--quiet")  # embedded: plans first
    assert r.returncode == 2 and "cannot start executing (plans are saved; no worker was called)" in r.stderr
    [run_id] = runs_in(data)
    assert f"Fixed by setting the variable, the same command resumes it with these plans (run {run_id})" in r.stderr
    assert "starts a new run" not in r.stderr
    monkeypatch.setenv("AUDIT65_UNSET_KEY", "anything")
    assert cli("run", queries, "--pool", pool, "--data-dir", data, "--quiet").returncode == 0
    assert runs_in(data) == [run_id]  # the same run, resumed

    typo = pool_with(tmp_path, sim.url, large={"model": "openai/wekaa"}, name="typo.yaml")
    r = cli("run", queries, "--pool", typo, "--data-dir", tmp_path / "other", "--quiet")
    assert r.returncode == 2 and "does not serve model 'wekaa'" in r.stderr, r.stderr
    assert "; a corrected model in the pool file starts a new run" in r.stderr  # after a ";", lower case
    assert "serving that model at that api_base, the same command resumes it" in r.stderr


# ---- F2, F3: the planner's price and provider, before the run folder -------------------------

def test_an_unpriced_planner_model_under_a_budget_is_refused_before_the_run_folder(sim, tmp_path, queries,
                                                                                    monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url)
    r = cli("run", queries, "--pool", pool, "--data-dir", tmp_path / "data", "--planner", "llm",
            "--planner-model", "openai/sim-planner", "--planner-option", f"api_base={sim.url}",
            "--budget", "1", "--quiet")
    assert r.returncode == 2 and "no known price for model openai/sim-planner" in r.stderr, r.stderr
    assert runs_in(tmp_path / "data") == [] and sim.log()["total"] == 0


@pytest.mark.parametrize("provider, says", [
    ("smi", "option provider: 'smi' is not under providers: in the pool file (did you mean 'sim'?)"),
    ("nope", "option provider: 'nope' is not under providers: in the pool file (sim)"),
])
def test_a_planner_provider_not_in_the_pool_is_refused(sim, tmp_path, queries, monkeypatch, provider, says):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    pool = plannersim.pool_file(tmp_path / "pool.yaml", sim.url)
    r = cli("run", queries, "--pool", pool, "--data-dir", tmp_path / "data", "--planner", "llm",
            "--planner-model", "openai/sim-planner", "--planner-option", f"api_base={sim.url}",
            "--planner-option", f"provider={provider}", "--quiet")
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert runs_in(tmp_path / "data") == [] and sim.log()["total"] == 0


# ---- F10: seeds as `--seed` takes them ---------------------------------------------------------

def test_a_negative_planner_seed_is_refused_as_run_seed_is(tmp_path):
    with pytest.raises(ConductorError, match=r"LLM planner: seed must be 0 or more, as --seed \(got -3\)"):
        make_planner("llm", worker="conductor", seed=-3)
    with pytest.raises(ConductorError, match=r"vLLM planner: seed must be 0 or more, as --seed \(got -1\)"):
        make_planner("vllm", model=str(tmp_path), seed=-1)
    assert make_planner("llm", worker="conductor", seed=0).config.seed == 0


# ---- F6: the engine's root cause, from its log -------------------------------------------------

ENGINE_LOG = """\
(VllmWorker-0 pid=23031) ERROR 11-29 12:06:37 [multiproc_executor.py:953] Traceback (most recent call last):
(VllmWorker-0 pid=23031) ERROR 11-29 12:06:37 [multiproc_executor.py:953]     raise ValueError(
(VllmWorker-0 pid=23031) ERROR 11-29 12:06:37 [multiproc_executor.py:953] ValueError: Available memory on node 0 \
(14.27/20.46 GiB) on startup is less than desired CPU memory utilization (0.9, 18.42 GiB). On the CPU backend, the \
`--gpu-memory-utilization` flag controls the fraction of CPU memory reserved (despite its name).
(EngineCore pid=22551) ERROR 11-29 12:06:42 [core.py:1510] Exception: WorkerProc initialization failed due to an \
exception in a background process. See stack trace for root cause.
Traceback (most recent call last):
Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""


def test_the_engines_root_cause_and_the_cpu_memory_settings_are_in_the_message():
    from conductor.planners.vllm import root_cause, start_advice

    assert root_cause(ENGINE_LOG).startswith("ValueError: Available memory on node 0 (14.27/20.46 GiB)")
    advice = start_advice(ENGINE_LOG)
    assert "Root cause: ValueError: Available memory" in advice
    assert "--planner-option gpu_memory_utilization=0.2" in advice and "VLLM_CPU_KVCACHE_SPACE=1" in advice
    other = "(EngineCore pid=1) ERROR 11-29 12:06:42 [core.py:1] OSError: no such model: x/y\n"
    assert start_advice(other) == ". Root cause: OSError: no such model: x/y"
    assert start_advice("RuntimeError: Engine core initialization failed. See root cause above.\n") == ""


def test_the_engines_log_is_passed_on_and_kept(capfd):
    import os
    import subprocess
    import sys

    from conductor.planners.vllm import StderrTail, root_cause

    tail = StderrTail()
    with pytest.raises(RuntimeError):
        with tail:  # a child process, as vLLM's engine is, writes to the inherited stderr
            subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('ValueError: out of memory\\n')"],
                           check=True)
            os.write(2, b"parent line\n")
            raise RuntimeError("Engine core initialization failed. See root cause above.")
    assert "ValueError: out of memory" in tail.text() and "parent line" in tail.text()
    assert "ValueError: out of memory" in capfd.readouterr().err  # still shown to the user
    assert json.dumps(root_cause(tail.text())) == json.dumps("ValueError: out of memory")
