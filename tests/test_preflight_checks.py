"""Configuration no run could use is refused as configuration (exit 2), naming what is
wrong and where, instead of being found out as every plan failed (audit findings on
userinfo URLs, pools of function workers only, and prompts no step can send)."""

from __future__ import annotations

import base64
import secrets

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.plans import MAX_INSTRUCTION_CHARS, parse_plan
from conductor.pool import load_pool
from tests.conftest import cli, files_under, worker, write_pool
from tests.fakehttp import LoopbackServer, QuietHandler


def _password() -> str:
    return "pw" + secrets.token_hex(8)


def _with_userinfo(url: str, password: str) -> str:
    return url.replace("http://", f"http://user:{password}@", 1)


def _queries(path, rows: list[tuple[str, str, str | None]]):
    """A query file of (query_id, prompt, task) rows."""
    ids, prompts, tasks = zip(*rows)
    pq.write_table(pa.table({"query_id": list(ids), "prompt": list(prompts), "task": list(tasks)}), path)
    return path


def _output(r) -> str:
    return r.stdout + r.stderr


# ---- an api_base with user:password@ ----------------------------------------

class BasicOnly(QuietHandler):
    """Lists its models only to the Basic credentials user:<password>, as a proxy in front of a server does."""
    expected = ""
    seen: list[str] = []

    def do_GET(self):
        auth = self.headers.get("Authorization", "")
        type(self).seen.append(auth)
        if self.path != "/v1/models" or auth != self.expected:
            return self.send(401, {"error": {"message": "unauthorized"}})
        self.send(200, {"data": [{"id": "other"}]})


def test_an_endpoint_behind_a_password_is_reached_with_it_and_the_password_is_never_shown(tmp_path):
    """urllib took `user:pw@127.0.0.1` for a host name: "cannot reach ... Name or service not known"
    for a server that was up. The model list is now asked with the credentials as Basic auth."""
    password = _password()
    BasicOnly.expected = "Basic " + base64.b64encode(f"user:{password}".encode()).decode()
    BasicOnly.seen = []
    with LoopbackServer(BasicOnly) as server:
        url = _with_userinfo(f"{server.root}/v1", password)
        pool = write_pool(tmp_path / "pool.yaml", url, workers=[worker("m", url)])
        r = cli("run", _queries(tmp_path / "q.parquet", [("q1", "What is 2+2?", "math")]), "--pool", pool,
                "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 2, _output(r)
    assert "cannot reach" not in r.stderr and "Name or service" not in r.stderr, r.stderr
    assert "does not serve model 'm'" in r.stderr and "it serves: other" in r.stderr, r.stderr
    assert BasicOnly.seen == [BasicOnly.expected]
    assert password not in _output(r) and "user:***@" in r.stderr


@pytest.mark.parametrize("prefix", ["openai", "hosted_vllm"], ids=["direct client", "litellm"])
def test_a_password_url_is_sent_as_basic_auth_or_refused_before_any_call(tmp_path, fresh_sim, sample_queries,
                                                                         prefix):
    """Past the model list, every call failed with aiohttp's "Cannot combine AUTHORIZATION header
    with ... credentials encoded in URL". The direct client sends them as Basic auth; a worker
    called through litellm, which cannot, is refused up front. The password is masked everywhere."""
    password = _password()
    url = _with_userinfo(fresh_sim.url, password)
    pool = write_pool(tmp_path / "pool.yaml", url, workers=[worker("fast", url, model=f"{prefix}/fast")])
    data = tmp_path / "data"
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--quiet")
    if prefix == "openai":
        assert r.returncode == 0 and fresh_sim.log()["total"] == 60, _output(r)
    else:
        assert r.returncode == 2, _output(r)
        assert "worker fast: api_base http://user:***@" in r.stderr and "holds user:password@" in r.stderr, r.stderr
        assert "cannot reach" not in r.stderr
        assert fresh_sim.log()["total"] == 0
    written = "".join(str(pq.read_table(p).to_pylist()) if p.suffix == ".parquet" else
                      p.read_bytes().decode("utf-8", "replace") for p in files_under(data))
    assert password not in _output(r) + written


# ---- a pool with no llm worker ----------------------------------------------

def _function_only(path):
    path.write_text(yaml.safe_dump({"workers": [{"id": "vote", "kind": "function"}]}))
    return path


def test_a_pool_of_function_workers_is_found_unplannable_naming_the_file(tmp_path, fresh_sim):
    """Every plan of such a pool was invalid ("the pool has no llm workers to plan with"):
    accuracy 0.000 and exit 4, where the configuration was at fault."""
    from conductor.preflight import plannable

    pool = _function_only(tmp_path / "fnonly.yaml")
    why = plannable(load_pool(pool))
    assert why and f"pool file {pool}" in why and "at least one worker of kind llm" in why and "vote" in why
    assert plannable(load_pool(write_pool(tmp_path / "ok.yaml", fresh_sim.url))) is None


def test_a_run_with_a_pool_of_function_workers_is_refused_before_its_folder_is_written(tmp_path, sample_queries):
    pool = _function_only(tmp_path / "fnonly.yaml")
    data = tmp_path / "data"
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", data, "--quiet")
    assert r.returncode == 2, _output(r)
    assert f"pool file {pool}" in r.stderr and "at least one worker of kind llm" in r.stderr, r.stderr
    assert not (data / "runs").exists()


# ---- prompts longer than a step can send ------------------------------------

def test_a_prompt_no_step_can_send_is_refused_at_load_naming_its_id(tmp_path, fresh_sim):
    """A 2,000,000-character prompt became an invalid plan naming "step 0: instruction", not the
    query, after the run was written (exit 4)."""
    queries = _queries(tmp_path / "q.parquet", [("small", "What is 2+2?", "math"),
                                                ("huge", "x" * 2_000_000, "math")])
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    data = tmp_path / "data"
    r = cli("run", queries, "--pool", pool, "--data-dir", data, "--quiet")
    assert r.returncode == 2, _output(r)
    assert f"query set {queries}" in r.stderr and "'huge' (2,000,000 characters, limit 99,800)" in r.stderr, r.stderr
    assert "'small'" not in r.stderr
    assert not (data / "runs").exists() and fresh_sim.log()["total"] == 0


@pytest.mark.parametrize("task", ["math", "choice", "exact", "literal", "code"])
def test_the_longest_prompt_accepted_still_makes_a_valid_plan(tmp_path, fresh_sim, task):
    """The limit leaves room for the answer line the embedded planner adds to a graded prompt;
    one character more is refused at load, not as an invalid plan."""
    from conductor.errors import InputError
    from conductor.planners import make_planner
    from conductor.planners.base import Query
    from conductor.queries import MAX_PROMPT_CHARS, load_queries

    prompt = "y" * MAX_PROMPT_CHARS
    table = load_queries(_queries(tmp_path / "q.parquet", [("edge", prompt, task)]))
    pool = load_pool(write_pool(tmp_path / "pool.yaml", fresh_sim.url))
    [[draft]] = make_planner("embedded").plan([Query("edge", table["prompt"][0].as_py(), task, None, None, 0)],
                                              pool, 1)
    assert parse_plan(draft.text, pool, 5).steps
    with pytest.raises(InputError, match=f"'over' \\({MAX_PROMPT_CHARS + 1:,} characters"):
        load_queries(_queries(tmp_path / "q2.parquet", [("over", prompt + "y", task)]))


def test_an_ungraded_prompt_may_fill_a_whole_step(tmp_path):
    """An enrichment job sends its rendered prompt as it is (checked at MAX_INSTRUCTION_CHARS when
    the job loads): an ungraded query takes the step's whole length. A `record` row is the job's
    own (a judge's prompt fails alone when too long), so only the ungraded row over it is named."""
    from conductor.errors import InputError
    from conductor.queries import load_queries

    full = "z" * MAX_INSTRUCTION_CHARS
    assert load_queries(_queries(tmp_path / "q.parquet", [("full", full, None), ("rec", full, "record")])).num_rows
    rows = [("over", full + "z", None), ("judged", full + "z", "record")]
    with pytest.raises(InputError, match=f"'over' \\({MAX_INSTRUCTION_CHARS + 1:,} characters, limit "
                                         f"{MAX_INSTRUCTION_CHARS:,}\\):") as e:
        load_queries(_queries(tmp_path / "q2.parquet", rows))
    assert "'judged'" not in str(e.value)
