"""The simulated worker pool, over real HTTP against a server in a subprocess."""

from __future__ import annotations

import asyncio
import math
import os
import re
import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.pool import parse_pool
from conductor.sim.config import SimConfigError, served_models
from conductor.sim.main import main as sim_main
from conductor.sim.process import SimStartError, start_sim

from tests.conftest import run_cli

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

KEY_ENV = "CONDUCTOR_SIM_TEST_KEY"
SECRET = "sk-simtest-" + secrets.token_hex(12)
N_PER_TASK = 400
WORDS = [f"{a}{b}" for a in ("red", "blue", "green", "amber", "violet", "gray") for b in
         ("fox", "owl", "elm", "oak", "jay", "cod", "eel", "yak", "ant", "bee")]
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

POOL = {
    "providers": {"sim": {"rpm": 100000}},
    "workers": [
        {"id": "oracle", "provider": "sim", "model": "openai/sim-oracle", "simulate": {"skill": 1.0}},
        {"id": "liar", "provider": "sim", "model": "openai/sim-liar", "simulate": {"skill": 0.0}},
        {"id": "good", "provider": "sim", "model": "openai/sim-good",
         "simulate": {"skill": {"math": 0.9, "choice": 0.75, "exact": 0.6}}},
        # no simulate.skill: the pool's skills are used, 0.5 where they say nothing
        {"id": "weak", "provider": "sim", "model": "openai/sim-weak", "skills": {"math": 0.2, "default": 0.35}},
        {"id": "plain", "provider": "sim", "model": "openai/sim-plain"},
        {"id": "faulty", "provider": "sim", "model": "openai/sim-faulty"},
        {"id": "locked", "provider": "sim", "model": "openai/sim-locked",
         "simulate": {"skill": 1.0, "require_key_env": KEY_ENV}},
        {"id": "vote", "kind": "function"},
    ],
}


def _queries() -> list[dict]:
    rows = []
    for i in range(N_PER_TASK):
        n = (i * 7919) % 100000 - 500
        ref = f"{n:,}" if i % 3 == 0 else (f"{n / 8:.2f}" if i % 3 == 1 else str(n))
        rows.append({"query_id": f"m{i}", "task": "math", "reference": ref,
                     "prompt": f"Problem {i}: a train covers {i + 3} km in {i % 9 + 1} hours. What is the result?"})
    for i in range(N_PER_TASK):
        letters = "ABCDE"[: 3 + i % 3]
        opts = "\n".join(f"({x}) choice {x.lower()} for item {i}" for x in letters)
        rows.append({"query_id": f"c{i}", "task": "choice", "reference": letters[i % len(letters)],
                     "prompt": f"Question {i}: which option fits best?\n\nOptions:\n{opts}"})
    for i in range(N_PER_TASK):
        rows.append({"query_id": f"e{i}", "task": "exact", "reference": WORDS[i % len(WORDS)],
                     "prompt": f"Item {i}: name the codeword assigned to entry number {i * 13}."})
    return rows


QUERIES = _queries()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("sim")
    (d / "pool.yaml").write_text(yaml.safe_dump(POOL))
    cols = {c: [r.get(c) for r in QUERIES] for c in ("query_id", "prompt", "task", "reference")}
    pq.write_table(pa.table(cols), d / "queries.parquet")
    return d


@pytest.fixture(scope="module")
def sim(files):
    with start_sim(files / "pool.yaml", [files], latency_ms=0, env={KEY_ENV: SECRET}) as handle:
        yield handle


@pytest.fixture(autouse=True)
def _fresh(request):
    if "sim" in request.fixturenames:
        handle = request.getfixturevalue("sim")
        handle.clear_faults()
        handle.reset()


def post(sim, body, headers=None, raw: bytes | None = None, timeout=10):
    data = raw if raw is not None else orjson.dumps(body)
    req = urllib.request.Request(sim.url + "/chat/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, r.headers, orjson.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, orjson.loads(e.read())


def ask(model, content, **params):
    return {"model": model, "messages": [{"role": "user", "content": content}], **params}


def final_answer(text: str) -> str:
    return re.findall(r"^Answer: (.*)$", text, re.M)[-1].strip()


def is_correct(q: dict, answer: str) -> bool:
    if q["task"] == "math":
        return float(answer.replace(",", "")) == float(q["reference"].replace(",", ""))
    return answer == q["reference"]


async def _ask_all(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    sem = asyncio.Semaphore(64)
    async with aiohttp.ClientSession() as s:
        async def one(b):
            async with sem, s.post(url + "/chat/completions", data=orjson.dumps(b),
                                   headers={"Content-Type": "application/json"}) as r:
                return r.status, orjson.loads(await r.read())
        return await asyncio.gather(*(one(b) for b in bodies))


# -- answers ---------------------------------------------------------------

def test_correct_rate_follows_skill_per_task(sim):
    expected = {"sim-good": {"math": 0.9, "choice": 0.75, "exact": 0.6},
                "sim-weak": {"math": 0.2, "choice": 0.35, "exact": 0.35},
                "sim-plain": {"math": 0.5, "choice": 0.5, "exact": 0.5}}
    bodies = [ask(m, q["prompt"]) for m in expected for q in QUERIES]
    results = asyncio.run(_ask_all(sim.url, bodies))
    refs_exact = {q["reference"] for q in QUERIES if q["task"] == "exact"}
    hits: dict[tuple[str, str], list[bool]] = {}
    for i, (body, (status, resp)) in enumerate(zip(bodies, results)):
        assert status == 200
        q = QUERIES[i % len(QUERIES)]
        answer = final_answer(resp["choices"][0]["message"]["content"])
        ok = is_correct(q, answer)
        hits.setdefault((body["model"], q["task"]), []).append(ok)
        if not ok:  # wrong answers are plausible: same kind of answer, just not the reference
            if q["task"] == "math":
                float(answer.replace(",", ""))
                assert ("," in answer) == ("," in q["reference"]) or abs(float(answer.replace(",", ""))) < 1000
                assert ("." in answer) == ("." in q["reference"])
            elif q["task"] == "choice":
                assert answer in re.findall(r"^\(([A-Z])\)", q["prompt"], re.M)
            else:
                assert answer in refs_exact
    for model, tasks in expected.items():
        for task, p in tasks.items():
            got = hits[(model, task)]
            rate = sum(got) / len(got)
            assert abs(rate - p) < 0.07, f"{model} {task}: correct rate {rate:.3f}, skill {p}"


def test_prompt_is_found_inside_a_longer_conversation(sim):
    for q in QUERIES[::97]:
        messages = [{"role": "system", "content": "You are careful."},
                    {"role": "user", "content": "Earlier note: " + "context words here. " * 150},
                    {"role": "assistant", "content": "Noted.\nAnswer: pending"},
                    {"role": "user", "content": f"Question:\n{q['prompt']}\n\nSolve it. End with 'Answer: <x>'."}]
        for model, want in (("sim-oracle", True), ("sim-liar", False)):
            status, _, resp = post(sim, {"model": model, "messages": messages})
            assert status == 200
            answer = final_answer(resp["choices"][0]["message"]["content"])
            assert answer != "unknown"
            assert is_correct(q, answer) is want, (model, q["query_id"], answer)


def test_unknown_question_answers_unknown(sim):
    status, headers, resp = post(sim, ask("sim-oracle", "What is the airspeed of an unladen swallow?"))
    assert status == 200
    assert final_answer(resp["choices"][0]["message"]["content"]) == "unknown"
    assert headers["x-conductor-simulated"] == "1"


def test_response_shape_and_usage(sim):
    q = QUERIES[5]
    status, headers, resp = post(sim, ask("sim-oracle", q["prompt"], temperature=0, max_tokens=64,
                                          response_format={"type": "text"}, n=1, stream=False))
    assert status == 200 and headers["x-conductor-simulated"] == "1"
    assert resp["object"] == "chat.completion" and resp["model"] == "sim-oracle"
    assert resp["system_fingerprint"] == "conductor-sim"
    choice = resp["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "stop"
    content = choice["message"]["content"]
    assert content.splitlines()[-1] == f"Answer: {q['reference']}"
    usage = resp["usage"]
    assert usage["prompt_tokens"] == math.ceil(len(q["prompt"]) / 4)
    assert usage["completion_tokens"] == math.ceil(len(content) / 4)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_identical_request_gets_identical_response_even_after_restart(sim, files):
    bodies = [ask("sim-plain", q["prompt"], temperature=0.7, seed=3) for q in QUERIES[::40]]
    first = [post(sim, b)[2] for b in bodies]
    again = [post(sim, b)[2] for b in bodies]
    with start_sim(files / "pool.yaml", files / "queries.parquet", latency_ms=0, env={KEY_ENV: SECRET}) as other:
        restarted = [post(other, b)[2] for b in bodies]
    for a, b, c in zip(first, again, restarted):
        assert a["choices"] == b["choices"] == c["choices"]
        assert a["usage"] == b["usage"] == c["usage"] and a["id"] == b["id"] == c["id"]
    # A change in sampling parameters is a different request: a fresh draw.
    changed = [post(sim, {**b, "seed": 4})[2] for b in bodies]
    differ = sum(x["choices"][0]["message"]["content"] != y["choices"][0]["message"]["content"]
                 for x, y in zip(first, changed))
    assert differ >= len(bodies) // 4


def test_a_server_stops_when_the_process_that_started_it_is_killed(files, tmp_path):
    """A parent killed by a signal runs no exit handler; its server must not outlive it and
    hold its port against the next run."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from conductor.sim.process import start_sim\n"
        f"h = start_sim({str(files / 'pool.yaml')!r}, [{str(files)!r}], latency_ms=0, env={{{KEY_ENV!r}: 'k'}})\n"
        "print(h.pid, h.port, flush=True)\n"
        "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    server_pid = None
    try:
        server_pid, port = map(int, parent.stdout.readline().split())
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
        parent.send_signal(signal.SIGTERM)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid), "the server outlived the process that started it"
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        parent.kill()
        if server_pid is not None and _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; only its parent's wait is missing
        return f.read().split(") ")[-1][0] != "Z"


# -- faults ----------------------------------------------------------------

def test_rpm_gives_429_with_retry_after(sim):
    sim.set_faults("sim-faulty", rpm=3)
    statuses, limited = [], []
    for q in QUERIES[:5]:
        status, headers, resp = post(sim, ask("sim-faulty", q["prompt"]))
        statuses.append(status)
        if status == 429:
            limited.append((headers, resp))
    assert statuses == [200, 200, 200, 429, 429]
    for headers, resp in limited:
        assert 58 <= int(headers["Retry-After"]) <= 60
        assert 57_000 <= int(headers["retry-after-ms"]) <= 60_000
        assert resp["error"]["code"] == "rate_limit_exceeded"
    # other models are not limited by sim-faulty's window
    assert post(sim, ask("sim-plain", "hi"))[0] == 200


def test_rpm_window_slides_and_counts_only_accepted_requests(sim):
    sim.set_faults("sim-faulty", rpm=3, rpm_window_s=2)
    body = ask("sim-faulty", "hello")
    assert [post(sim, body)[0] for _ in range(3)] == [200, 200, 200]
    first = sorted(sim.log()["accepted_times"]["sim-faulty"])  # the server's clock (time.time())
    rejected = [post(sim, body) for _ in range(2)]
    assert [r[0] for r in rejected] == [429, 429]
    assert all(0 < int(r[1]["retry-after-ms"]) <= 2000 for r in rejected)  # until the oldest leaves
    # Waits are measured from the server's acceptance times, so a slow machine cannot shift them.
    time.sleep(max(0.0, first[-1] + 2.15 - time.time()))
    # The first three left the window; the rejected ones were never in it.
    assert [post(sim, body)[0] for _ in range(4)] == [200, 200, 200, 429]
    times = sim.log()["accepted_times"]["sim-faulty"]
    assert len(times) == 6
    assert all(sum(1 for t in times if s <= t < s + 2) <= 3 for s in times)


def test_error_rate(sim):
    sim.set_faults("sim-faulty", error_rate=1.0)
    for q in QUERIES[:5]:
        status, _, resp = post(sim, ask("sim-faulty", q["prompt"]))
        assert status in (500, 502, 503)
        assert resp["error"]["type"] == "server_error" and resp["error"]["message"]
    sim.set_faults("sim-faulty", error_rate=0.3)
    results = asyncio.run(_ask_all(sim.url, [ask("sim-faulty", q["prompt"]) for q in QUERIES[:400]]))
    codes = [s for s, _ in results]
    failed = [c for c in codes if c != 200]
    assert abs(len(failed) / len(codes) - 0.3) < 0.07
    assert set(failed) == {500, 502, 503}
    assert post(sim, ask("sim-plain", "x"))[0] == 200  # only sim-faulty was changed


def test_rate_limit_rate(sim):
    sim.set_faults("*", rate_limit_rate=1.0)
    status, headers, resp = post(sim, ask("sim-plain", "x"))
    assert status == 429
    assert headers["Retry-After"] == "1" and headers["retry-after-ms"] == "1000"
    assert resp["error"]["code"] == "rate_limit_exceeded"


def test_hang_makes_the_client_time_out_without_blocking_others(sim):
    sim.set_faults("sim-faulty", hang_rate=1.0, hang_s=4.0)

    async def go():
        async with aiohttp.ClientSession() as s:
            async def call(model, timeout):
                async with s.post(sim.url + "/chat/completions", data=orjson.dumps(ask(model, "hi")),
                                  timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    return r.status
            hung = asyncio.ensure_future(call("sim-faulty", 2.0))
            assert await call("sim-plain", 5) == 200
            assert not hung.done()  # answered while the other still hangs (an ordering, not a timing)
            with pytest.raises(asyncio.TimeoutError):
                await hung

    asyncio.run(go())
    deadline = time.monotonic() + 15  # a bound on waiting, not a timing
    while sim.log()["by_status"].get("499") != 1:
        assert time.monotonic() < deadline, sim.log()["by_status"]
        time.sleep(0.1)


def test_drop_closes_the_connection_without_a_response(sim):
    sim.set_faults("sim-faulty", drop_rate=1.0)

    async def go():
        async with aiohttp.ClientSession() as s:
            with pytest.raises((aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)):
                async with s.post(sim.url + "/chat/completions", data=orjson.dumps(ask("sim-faulty", "x"))) as r:
                    await r.read()

    asyncio.run(go())
    assert sim.log()["by_status"] == {"dropped": 1}
    assert post(sim, ask("sim-plain", "x"))[0] == 200  # the server lives on, quietly
    assert "Traceback" not in sim.stderr() and "Error" not in sim.stderr()


def test_latency_setting_delays_answers(sim):
    sim.set_faults("sim-faulty", latency_ms=300, latency_sd_ms=0)
    t = time.monotonic()
    assert post(sim, ask("sim-faulty", "x"))[0] == 200
    slow = time.monotonic() - t
    assert slow >= 0.3
    t = time.monotonic()
    assert post(sim, ask("sim-plain", "x"))[0] == 200
    assert time.monotonic() - t < slow  # only the model with the setting waits (relative: load delays both)


def test_admin_faults_rejects_bad_values(sim):
    req = urllib.request.Request(sim.root + "/admin/faults", method="POST",
                                 data=orjson.dumps({"model": "sim-faulty", "error_rate": 1.5}))
    with pytest.raises(urllib.error.HTTPError) as e:
        _OPENER.open(req)
    assert e.value.code == 400 and "error_rate" in e.value.read().decode()
    with pytest.raises(Exception, match="unknown model 'nope'"):
        sim.set_faults("nope", error_rate=0.1)


# -- auth, errors, log -----------------------------------------------------

def test_require_key_env(sim):
    q = QUERIES[0]
    want = {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                      "param": None, "code": "invalid_api_key"}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": SECRET}):
        status, _, resp = post(sim, ask("sim-locked", q["prompt"]), headers)
        assert (status, resp) == (401, want)
    status, _, resp = post(sim, ask("sim-locked", q["prompt"]), {"Authorization": f"Bearer {SECRET}"})
    assert status == 200 and final_answer(resp["choices"][0]["message"]["content"]) == q["reference"]
    assert post(sim, ask("sim-plain", "x"))[0] == 200  # other models need no key
    assert sim.log()["by_status"] == {"401": 3, "200": 2}
    leaks = {"stdout": sim.stdout(), "stderr": sim.stderr(), "log": orjson.dumps(sim.log()).decode(),
             "faults": orjson.dumps(sim.faults()).decode()}
    assert "[key required]" in leaks["stdout"]
    assert [where for where, text in leaks.items() if SECRET in text] == []


def test_unknown_model_404(sim):
    status, _, resp = post(sim, ask("nope", "x"))
    assert status == 404
    assert resp["error"]["message"].startswith("The model `nope` does not exist")
    assert resp["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("raw, param, words", [
    (b"{not json", None, "parse"),
    (b'{"model": "sim-plain"}', "messages", "messages"),
    (b'{"model": "sim-plain", "messages": []}', "messages", "messages"),
    (b'{"model": "sim-plain", "messages": ["hi"]}', "messages[0]", "role"),
    (b'{"model": "sim-plain", "messages": [{"role": "user", "content": "x"}], "stream": true}', "stream", "stream"),
    (b'{"model": "sim-plain", "messages": [{"role": "user", "content": "x"}], "n": 2}', "n", "n=1"),
])
def test_malformed_requests_get_400(sim, raw, param, words):
    status, _, resp = post(sim, None, raw=raw)
    assert status == 400
    assert resp["error"]["type"] == "invalid_request_error" and resp["error"]["param"] == param
    assert words in resp["error"]["message"]


def test_request_log_counts_and_reset(sim):
    import hashlib
    same = orjson.dumps(ask("sim-plain", QUERIES[1]["prompt"]))
    post(sim, None, raw=same)
    post(sim, None, raw=same)
    post(sim, ask("sim-good", "y"))
    post(sim, ask("nope", "z"))
    post(sim, None, raw=b"{bad")
    before = time.time()
    log = sim.log()
    assert log["total"] == 5
    assert log["by_model"] == {"sim-plain": 2, "sim-good": 1, "nope": 1}
    assert log["by_status"] == {"200": 3, "404": 1, "400": 1}
    assert log["by_body"][hashlib.sha256(same).hexdigest()] == 2 and len(log["by_body"]) == 4
    assert len(log["accepted_times"]["sim-plain"]) == 2
    assert all(before - 10 < t <= before for t in log["accepted_times"]["sim-plain"])
    assert log["by_query"] == {QUERIES[1]["query_id"]: 2} and log["by_kind"] == {}
    assert sorted(log["billed_tokens"]) == ["sim-good", "sim-plain"]  # answered requests are billed
    assert log["billed_tokens"]["sim-plain"][0] == 2 * math.ceil(len(QUERIES[1]["prompt"]) / 4)
    sim.reset()
    assert sim.log() == {"total": 0, "by_model": {}, "by_status": {}, "by_body": {}, "by_request_key": {},
                         "accepted_times": {}, "by_query": {}, "by_kind": {}, "billed_tokens": {},
                         "batch_billed_tokens": {}, "batch_lines": {}, "batch_by_model": {},
                         "batch_submissions": {}, "batches_created": 0, "files_uploaded": 0}


def test_models_and_health(sim):
    with _OPENER.open(sim.url + "/models") as r:
        ids = [m["id"] for m in orjson.loads(r.read())["data"]]
    assert ids == ["sim-oracle", "sim-liar", "sim-good", "sim-weak", "sim-plain", "sim-faulty", "sim-locked"]
    with _OPENER.open(sim.root + "/health") as r:
        assert orjson.loads(r.read()) == {"ok": True}


# -- litellm ---------------------------------------------------------------

def test_litellm_openai_compatible_path(sim):
    import litellm

    q = QUERIES[2]

    async def go():
        ok = await litellm.acompletion(model="openai/sim-oracle", api_base=sim.url, api_key="x",
                                       messages=[{"role": "user", "content": q["prompt"]}],
                                       temperature=0, max_tokens=64, num_retries=0, max_retries=0)
        sim.set_faults("sim-faulty", rate_limit_rate=1.0)
        with pytest.raises(litellm.RateLimitError):
            await litellm.acompletion(model="openai/sim-faulty", api_base=sim.url, api_key="x",
                                      messages=[{"role": "user", "content": "x"}], num_retries=0, max_retries=0)
        return ok

    resp = asyncio.run(go())
    assert final_answer(resp.choices[0].message.content) == q["reference"]
    assert resp.usage.prompt_tokens == math.ceil(len(q["prompt"]) / 4)
    assert resp.usage.completion_tokens == math.ceil(len(resp.choices[0].message.content) / 4)
    assert resp.system_fingerprint == "conductor-sim"


# -- configuration ---------------------------------------------------------

@pytest.mark.parametrize("simulate, words", [
    ({"skil": 0.5}, "worker w: simulate.skil: unknown field"),
    ({"skill": {"math": 1.5}}, "worker w: simulate.skill.math: must be a probability"),
    ({"skill": {"poetry": 0.5}}, "worker w: simulate.skill.poetry: unknown task"),
    ({"error_rate": 2}, "worker w: simulate.error_rate: must be a fraction"),
    ({"rpm": 0}, "worker w: simulate.rpm: must be greater than 0"),
    ({"latency_ms": {"mean": 5, "jitter": 1}}, "worker w: simulate.latency_ms.jitter: unknown field"),
    ({"require_key_env": "sk-123 456"}, "worker w: simulate.require_key_env: must be the NAME"),
])
def test_bad_simulate_blocks_are_named(simulate, words):
    pool = parse_pool({"workers": [{"id": "w", "model": "openai/m", "simulate": simulate}]})
    with pytest.raises(SimConfigError) as e:
        served_models(pool)
    assert words in str(e.value)


def test_start_sim_reports_why_the_server_did_not_start(files, tmp_path):
    bad = tmp_path / "pool.yaml"
    bad.write_text(yaml.safe_dump({"workers": [{"id": "w", "model": "openai/m", "simulate": {"rpm": -1}}]}))
    with pytest.raises(SimStartError, match=r"worker w: simulate\.rpm: must be greater than 0"):
        start_sim(bad, files / "queries.parquet")
    missing = tmp_path / "locked.yaml"
    missing.write_text(yaml.safe_dump({"workers": [
        {"id": "w", "model": "openai/m", "simulate": {"require_key_env": "CONDUCTOR_SIM_UNSET_VAR"}}]}))
    with pytest.raises(SimStartError, match="CONDUCTOR_SIM_UNSET_VAR, which is not set"):
        start_sim(missing, files / "queries.parquet")


def test_cli_refuses_a_non_loopback_host(files, capsys):
    code = sim_main(["--pool", str(files / "pool.yaml"), "--queries", str(files), "--host", "0.0.0.0"])
    assert code == 2
    assert "--allow-remote" in capsys.readouterr().err


def test_demo_pool_loads_and_is_served():
    from conductor.pool import load_pool

    pool = load_pool(os.path.join(os.path.dirname(__file__), "..", "data", "pools", "sim.yaml"))
    models = served_models(pool)
    assert len(models) >= 5
    for w in pool.workers:
        assert w.description and w.skills and w.price and w.params == {"temperature": 0, "max_tokens": 512}


def test_fail_status_answers_every_request_with_that_status(tmp_path):
    """Clients' handling of 400/403 etc. is tested against this fault."""
    import httpx

    pool = tmp_path / "pool.yaml"
    pool.write_text("workers:\n  - {id: w, model: openai/w}\n")
    queries = tmp_path / "q.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"query_id": ["a"], "prompt": ["What is two plus two, in digits?"]}), queries)
    from conductor.sim import start_sim

    with start_sim(pool, [queries], fail_status=403) as sim:
        r = httpx.post(sim.url + "/chat/completions", json={"model": "w", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 403
        sim.set_faults(fail_status=None)
        r = httpx.post(sim.url + "/chat/completions", json={"model": "w", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200


def test_a_fail_status_that_is_no_error_is_named_as_given(tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text("workers:\n  - {id: w, model: openai/w}\n")
    pq.write_table(pa.table({"query_id": ["a"], "prompt": ["What is two plus two?"]}), tmp_path / "q.parquet")
    r = run_cli("sim", "--pool", pool, "--queries", tmp_path / "q.parquet", "--port", "0", "--fail-status", "200")
    assert r.returncode == 2 and "--fail-status: must be an HTTP error status from 400 to 599 (got 200)" in r.stderr, \
        r.stderr  # was "(got 200.0)"
