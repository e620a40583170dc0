"""Planner options as `conductor run` takes them: a bad one is refused, naming it, before the run
folder is written and before any call; a key given as an option is never shown or stored; and
planning that fails after its calls were sent does not exit 2, which promises nothing was called."""

from __future__ import annotations

import re
import secrets

import orjson
import pytest

from conductor.runner import RunConfig, prepare
from tests import plannersim
from tests.conftest import cli, files_under, run_cli
from tests.plannersim import psim, queries, sim  # noqa: F401  (shared fixtures)

# slow: planner runs against the simulated server
pytestmark = pytest.mark.slow

PRICE = "price={input_per_mtok: 1, output_per_mtok: 2}"


def _key() -> str:
    return "sk-TESTxLEAK" + secrets.token_hex(12) + "XYZ"


def _pool(tmp_path, sim, **provider):
    """The simulated workers and a planner worker `conductor`; `provider`: settings of provider sim."""
    providers = {"sim": {"max_concurrency": 32, "timeout_s": 10, **provider}}
    return plannersim.pool_file(tmp_path / "pool.yaml", sim.url, planner=plannersim.planner_worker(sim.url),
                                providers=providers)


def _llm_run(tmp_path, sim, queries, *options: str, model: bool = True, pool=None):
    args = ["run", queries, "--pool", pool or _pool(tmp_path, sim), "--data-dir", tmp_path / "data", "--quiet",
            "--planner", "llm"]
    if model:
        args += ["--planner-model", "openai/sim-planner", "--planner-option", f"api_base={sim.url}"]
    for option in options:
        args += ["--planner-option", option]
    return cli(*args)


def _nothing_written_or_sent(tmp_path, sim) -> None:
    assert not (tmp_path / "data" / "runs").exists(), files_under(tmp_path / "data")
    assert sim.log()["total"] == 0


def _status(tmp_path) -> tuple[str, str]:
    (manifest,) = (tmp_path / "data" / "runs").glob("*/manifest.json")
    m = orjson.loads(manifest.read_bytes())
    return m["run_id"], m["status"]


# ---- keys -------------------------------------------------------------------

@pytest.mark.parametrize("with_model, message", [
    (True, "api_key_env: must be the NAME of an environment variable, not a key"),
    (False, "option api_key_env applies only with a model string (--planner-model)"),
], ids=["model", "worker"])
def test_a_key_given_as_api_key_env_is_refused_unshown_before_any_run_folder(sim, tmp_path, queries, with_model,
                                                                            message):
    """The run folder was written first, holding the key in its manifest; with worker= the option was
    ignored, the run completed, and the key was stored all the same."""
    key = _key()
    extra = () if with_model else ("worker=conductor",)
    r = _llm_run(tmp_path, sim, queries, f"api_key_env={key}", *extra, model=with_model)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert key[:12] not in r.stdout + r.stderr and key[-12:] not in r.stdout + r.stderr
    _nothing_written_or_sent(tmp_path, sim)


def test_a_run_folder_never_keeps_a_key_given_as_an_option(sim, tmp_path, queries):
    """Runs prepared without building the planner first (enrichment jobs, Dagster) store the options."""
    key = _key()
    cfg = RunConfig(queries=queries, pool=_pool(tmp_path, sim), data_dir=tmp_path / "data", planner="llm",
                    planner_options={"model": "openai/claude-3-5-sonnet-20241022", "api_key_env": key,
                                     "api_base": f"{sim.url}?api_key={key}"}, progress=False)
    run = prepare(cfg)
    shown = orjson.loads((run.dir.path / "manifest.json").read_bytes())["inputs"]["planner_options"]
    assert shown["model"] == "openai/claude-3-5-sonnet-20241022"  # a model name is not taken for a key
    assert shown["api_key_env"] == "(not kept: not the name of an environment variable)"
    r = cli("sql", "--data-dir", tmp_path / "data", "SELECT inputs->'planner_options' AS o FROM runs")
    assert r.returncode == 0 and "not kept" in r.stdout, r.stdout + r.stderr
    found = r.stdout + "".join(p.read_text(errors="replace") for p in (tmp_path / "data").rglob("*.json"))
    assert key[:12] not in found and key[-12:] not in found


# ---- options checked before the run folder -----------------------------------

@pytest.mark.parametrize("option, message", [
    ("max_tokens=-100000", "max_tokens must be a whole number of at least 1 (or unset) (got -100000)"),
    ("max_tokens=-3", "max_tokens must be a whole number of at least 1 (or unset) (got -3)"),
    ("temperature=abc", "temperature must be a number at least 0 and at most 2 (got 'abc')"),
    ("top_p=7", "top_p must be a number above 0 and at most 1 (got 7)"),
    ("seed=1.5", "seed must be a whole number (or unset) (got 1.5)"),
    ("max_in_flight=0", "max_in_flight must be a whole number of at least 1 (or unset) (got 0)"),
    ("instruction_chars=many", "instruction_chars must be a whole number of at least 1 (got 'many')"),
    ("strict=maybe", "strict must be true or false (got 'maybe')"),
    ("price=1,1", "option price must be a mapping like price={input_per_mtok: 1, output_per_mtok: 2}"),
    ("price={input_per_mtok: -1, output_per_mtok: 1}", "option price: input_per_mtok must be a number of USD, "
                                                       "at least 0 (got -1)"),
    # a mapping missing a key was told it must be a mapping (audit65 F7)
    ("price={input_per_mtok: 1}", "option price: output_per_mtok is required, like price={input_per_mtok: 1, "),
    ("price={input_per_token: 1}", "option price: output_per_token is required"),
    ("price={input_per_mtok: 1, output_per_mtoken: 2}", "option price: output_per_mtoken: unknown field (allowed: "),
    ("price={input_per_mtok: 1, output_per_token: 2}", "option price: give prices per million tokens or per token, "
                                                       "not both"),
    ("api_base=ftp://127.0.0.1/v1", "option api_base: must start with http:// or https://"),
])
def test_a_bad_llm_planner_option_is_refused_before_any_run_folder_or_call(sim, tmp_path, queries, option,
                                                                          message):
    """They went to the server as given; max_tokens=-100000 with a price showed a negative cost and
    credited the run's budget back; price=1,1 left a run folder in status `planning` and blamed
    `workers[0] (conductor-planner)`, which the user never wrote."""
    r = _llm_run(tmp_path, sim, queries, PRICE, option)
    assert r.returncode == 2 and f"LLM planner: {message}" in r.stderr, r.stderr
    assert "workers[0]" not in r.stderr and "Traceback" not in r.stderr
    _nothing_written_or_sent(tmp_path, sim)


@pytest.mark.parametrize("options, message", [
    (["worker=nosuch"], "worker 'nosuch' is not in the pool"),
    (["worker=fast"], "worker fast must be of kind planner"),
    (["worker=conductor", PRICE, "api_base=http://127.0.0.1:9/v1"],
     "options api_base, price apply only with a model string (--planner-model)"),
])
def test_a_planner_worker_the_pool_cannot_give_is_refused_before_any_run_folder(sim, tmp_path, queries, options,
                                                                              message):
    r = _llm_run(tmp_path, sim, queries, *options, model=False)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    _nothing_written_or_sent(tmp_path, sim)


def test_a_folder_without_a_model_is_refused_before_any_run_folder(sim, tmp_path, queries):
    """vLLM found it only once its engine started, after the run folder was written."""
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "notes.txt").write_text("no weights here")
    r = run_cli("run", queries, "--pool", _pool(tmp_path, sim), "--data-dir", tmp_path / "data", "--quiet",
                "--planner", "vllm", "--planner-model", folder)
    assert r.returncode == 2 and "is a folder without a model in it (no config.json" in r.stderr, r.stderr
    _nothing_written_or_sent(tmp_path, sim)


@pytest.mark.parametrize("option, message", [
    ("policy=5", "policy must be auto, none or a policy folder (got 5)"),
    ("policy=true", "policy must be auto, none or a policy folder (got True)"),
    ("policy=", "policy must be auto, none or a policy folder (got nothing)"),
    ("use=bogus", "use must be one of auto, learned, fixed (got 'bogus')"),
    ("use=5", "use must be one of auto, learned, fixed (got 5)"),
    ("seed=abc", "seed must be a whole number, at least 0 (got 'abc')"),
    ("seed=1.5", "seed must be a whole number, at least 0 (got 1.5)"),
    ("seed=[1,2]", "seed must be a whole number, at least 0 (got [1, 2])"),
    ("seed=-1", "seed must be a whole number, at least 0 (got -1)"),
    ("sweep=abc", "sweep must be true or false (got 'abc')"),
    ("templates=", "templates must name one or more of single, verify, ensemble, e.g. templates=single,ensemble "
                   "(got nothing)"),
    ("action=5", "action must be an action key, or a mapping of task to action key (got 5)"),
])
def test_a_bad_embedded_planner_option_is_refused_before_any_run_folder(sim, tmp_path, queries, option, message):
    """policy=5 was a traceback once the run folder existed; the others planned as if unset (sweep=abc as
    true; policy= as none, though unset means auto); templates= said "(got None)"."""
    r = cli("run", queries, "--pool", _pool(tmp_path, sim), "--data-dir", tmp_path / "data", "--quiet",
            "--planner-option", option)
    assert r.returncode == 2 and f"planner embedded: {message}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    _nothing_written_or_sent(tmp_path, sim)


def test_a_policy_folder_with_nothing_for_the_pool_is_refused_before_any_run_folder(sim, tmp_path, queries):
    """The folder was looked in only by planning: the run folder stayed behind in `planning`."""
    for folder, says in ((tmp_path / "nothing", "there is no folder"), (tmp_path, "no policy artifact there")):
        r = cli("run", queries, "--pool", _pool(tmp_path, sim), "--data-dir", tmp_path / "data", "--quiet",
                "--planner-option", f"policy={folder}")
        assert r.returncode == 2, r.stderr
        assert f"planner option policy={folder}: {says}" in r.stderr, r.stderr
        assert "there is no folder" not in r.stderr or "no policy artifact" not in r.stderr, r.stderr  # one reason
        _nothing_written_or_sent(tmp_path, sim)


def test_a_planner_option_without_a_name_is_refused_naming_the_problem(sim, tmp_path, queries):
    r = cli("run", queries, "--pool", _pool(tmp_path, sim), "--data-dir", tmp_path / "data",
            "--planner-option", "=3")
    assert r.returncode == 2 and "--planner-option =VALUE: the option has no name before '='" in r.stderr, r.stderr
    _nothing_written_or_sent(tmp_path, sim)


def test_a_sweep_short_of_samples_says_how_many_and_that_count_runs(sim, tmp_path, queries):
    """It said "use --samples all", which `conductor run` refuses."""
    pool = _pool(tmp_path, sim)
    args = ["run", queries, "--pool", pool, "--quiet", "--planner-option", "sweep=true"]
    r = cli(*args, "--data-dir", tmp_path / "short")
    assert r.returncode == 2 and "use --samples all with `conductor policy rollouts`" in r.stderr, r.stderr
    assert not (tmp_path / "short" / "runs").exists()  # refused before the run folder, not by planning
    wanted = re.search(r"or --samples (\d+) or more with `conductor run`", r.stderr)
    assert wanted, r.stderr
    r = cli(*args, "--data-dir", tmp_path / "data", "--samples", wanted.group(1))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _status(tmp_path)[1] == "complete"


# ---- planning that fails after its calls ----------------------------------------

def test_a_planner_model_that_always_fails_exits_4_and_the_rerun_plans(sim, tmp_path, queries):
    """It exited 2 ("bad input or configuration ... nothing called") after 18 paid requests."""
    pool = _pool(tmp_path, sim, max_attempts=1)
    sim.set_faults("sim-planner", fail_status=500)
    r = _llm_run(tmp_path, sim, queries, model=False, pool=pool)
    assert r.returncode == 4 and "12 of 12 planning call(s) failed" in r.stderr, r.stderr
    assert "rerun the same command" in r.stderr and sim.log()["total"] == 12
    sim.clear_faults()
    r = _llm_run(tmp_path, sim, queries, model=False, pool=pool)
    assert r.returncode == 0 and _status(tmp_path)[1] == "complete", r.stderr


def test_a_rejected_planner_key_exits_4_and_says_how_the_run_resumes(sim, tmp_path, queries):
    """A 401 is found only by calling: the run folder is left in status `failed`, and the message
    says that the same command resumes it once the key is fixed."""
    pool = _pool(tmp_path, sim, max_attempts=1)
    sim.set_faults("sim-planner", fail_status=401)
    r = _llm_run(tmp_path, sim, queries, model=False, pool=pool)
    run_id, status = _status(tmp_path)
    assert r.returncode == 4 and "LLM planner: cannot plan:" in r.stderr, r.stderr
    assert f"Fix this, then the same command resumes the planning of run {run_id}" in r.stderr, r.stderr
    assert status == "failed" and sim.log()["total"] > 0
    sim.clear_faults()
    r = _llm_run(tmp_path, sim, queries, model=False, pool=pool)
    assert r.returncode == 0 and _status(tmp_path) == (run_id, "complete"), r.stderr
