"""The simulated server's OpenAI Files and Batch API, over real HTTP against a
server in a subprocess: through aiohttp and through litellm's own batch and
file functions, as a batch-mode client would call them."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import aiohttp
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.pool import parse_pool
from conductor.sim.config import served_models
from conductor.sim.process import start_sim
from tests.test_sim import KEY_ENV, POOL, QUERIES, SECRET, final_answer

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

ENDPOINT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    d = tmp_path_factory.mktemp("simbatch")
    (d / "pool.yaml").write_text(yaml.safe_dump(POOL))
    cols = {c: [r.get(c) for r in QUERIES] for c in ("query_id", "prompt", "task", "reference")}
    pq.write_table(pa.table(cols), d / "queries.parquet")
    with start_sim(d / "pool.yaml", [d], latency_ms=0, env={KEY_ENV: SECRET}) as handle:
        yield handle


@pytest.fixture(autouse=True)
def _fresh(sim):
    sim.clear_faults()
    sim.reset()


def body(model: str, i: int, **params) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": QUERIES[i % len(QUERIES)]["prompt"]}], **params}


def line(custom_id: str, b: dict, url: str = ENDPOINT) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": b}


def jsonl(lines: list) -> bytes:
    return b"".join(orjson.dumps(x) + b"\n" for x in lines)


class Client:
    """Plain HTTP calls to the sim, as OpenAI documents them."""

    def __init__(self, sim, session: aiohttp.ClientSession, key: str | None = None):
        self.url = sim.url
        self.s = session
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def call(self, method: str, path: str, payload: dict | None = None) -> tuple[int, dict]:
        async with self.s.request(method, self.url + path, headers=self.headers,
                                  data=orjson.dumps(payload) if payload is not None else None) as r:
            return r.status, orjson.loads(await r.read())

    async def upload(self, data: bytes, purpose: str = "batch", filename: str = "in.jsonl") -> tuple[int, dict]:
        form = aiohttp.FormData()
        form.add_field("purpose", purpose)
        form.add_field("file", data, filename=filename, content_type="application/jsonl")
        async with self.s.post(self.url + "/files", data=form, headers=self.headers) as r:
            return r.status, orjson.loads(await r.read())

    async def content(self, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        async with self.s.get(f"{self.url}/files/{file_id}/content", headers=self.headers) as r:
            assert r.status == 200
            return [orjson.loads(x) for x in (await r.read()).splitlines()]

    async def submit(self, lines: list[dict], **create) -> dict:
        status, f = await self.upload(jsonl(lines))
        assert status == 200, f
        status, b = await self.call("POST", "/batches", {"input_file_id": f["id"], "endpoint": ENDPOINT,
                                                         "completion_window": "24h", **create})
        assert status == 200, b
        return b

    async def wait(self, batch_id: str, seen: list[str] | None = None, poll_s: float = 0.05) -> dict:
        while True:
            status, b = await self.call("GET", f"/batches/{batch_id}")
            assert status == 200, b
            if seen is not None and (not seen or seen[-1] != b["status"]):
                seen.append(b["status"])
            if b["status"] in ("completed", "expired", "cancelled", "failed"):
                return b
            await asyncio.sleep(poll_s)

    async def run(self, lines: list[dict], **create) -> tuple[dict, dict[str, dict], dict[str, dict]]:
        """Submit, wait, download: (batch, output by custom_id, errors by custom_id)."""
        b = await self.wait((await self.submit(lines, **create))["id"])
        out = {r["custom_id"]: r for r in await self.content(b["output_file_id"])}
        err = {r["custom_id"]: r for r in await self.content(b["error_file_id"])}
        return b, out, err


def using(sim, fn, key: str | None = None):
    async def go():
        async with aiohttp.ClientSession() as s:
            return await fn(Client(sim, s, key))
    return asyncio.run(go())


# -- answers and billing ------------------------------------------------------

def test_batch_answers_equal_online_answers_and_bill_apart(sim):
    models = ("sim-oracle", "sim-good", "sim-plain")  # mixed models in one batch are allowed
    bodies = {f"q{i}": body(models[i % 3], i * 7, temperature=0) for i in range(120)}

    async def go(c: Client):
        batch = await c.run([line(k, b) for k, b in bodies.items()])
        batch_log = sim.log()
        online = {}
        for k, b in bodies.items():
            status, online[k] = await c.call("POST", "/chat/completions", b)
            assert status == 200
        return batch, batch_log, online

    (b, out, err), batch_log, online = using(sim, go)
    assert b["status"] == "completed" and b["request_counts"] == {"total": 120, "completed": 120, "failed": 0}
    assert err == {} and b["error_file_id"] is None
    assert set(out) == set(bodies)
    for k, rec in out.items():
        resp = rec["response"]
        assert resp["status_code"] == 200 and rec["error"] is None and resp["request_id"]
        assert resp["body"]["choices"] == online[k]["choices"]
        assert resp["body"]["usage"] == online[k]["usage"]
        assert resp["body"]["model"] == bodies[k]["model"]
    # The oracle is right on every known question, in batch as online.
    for i in range(0, 120, 3):
        q = QUERIES[(i * 7) % len(QUERIES)]
        got = final_answer(out[f"q{i}"]["response"]["body"]["choices"][0]["message"]["content"])
        assert got.replace(",", "") == str(q["reference"]).replace(",", "")

    # Batch tokens are billed apart from online ones, and equal what the lines report.
    usage: dict[str, list[int]] = {}
    for k, rec in out.items():
        u = rec["response"]["body"]["usage"]
        t = usage.setdefault(bodies[k]["model"], [0, 0])
        t[0] += u["prompt_tokens"]
        t[1] += u["completion_tokens"]
    assert batch_log["batch_billed_tokens"] == usage
    assert batch_log["billed_tokens"] == {} and batch_log["total"] == 0  # no online request yet
    assert batch_log["batch_lines"] == {"200": 120}
    assert batch_log["batch_by_model"] == {m: 40 for m in models}
    log = sim.log()
    assert log["billed_tokens"] == usage  # the same bodies online cost the same tokens, at the online price
    assert log["batch_billed_tokens"] == usage


def test_litellm_batch_and_file_functions_work_against_the_sim(sim):
    import litellm

    bodies = {f"l{i}": body("sim-oracle", i, max_tokens=64) for i in range(20)}
    data = jsonl([line(k, b) for k, b in bodies.items()])
    kw = {"custom_llm_provider": "openai", "api_base": sim.url, "api_key": "sk-anything"}

    async def go():
        f = await litellm.acreate_file(file=("steps.jsonl", data), purpose="batch", **kw)
        created = await litellm.acreate_batch(input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h",
                                              metadata={"run": "t1"}, **kw)
        while True:
            b = await litellm.aretrieve_batch(batch_id=created.id, **kw)
            if b.status in ("completed", "failed", "expired", "cancelled"):
                break
            await asyncio.sleep(0.05)
        content = await litellm.afile_content(file_id=b.output_file_id, **kw)
        listed = await litellm.alist_batches(limit=5, **kw)
        return f, created, b, content.content, listed

    f, created, b, content, listed = asyncio.run(go())
    assert f.purpose == "batch" and f.bytes == len(data) and f.id.startswith("file-")
    assert created.status == "validating" and created.input_file_id == f.id and created.metadata == {"run": "t1"}
    assert b.status == "completed" and b.request_counts.completed == 20 and b.request_counts.failed == 0
    assert b.completed_at is not None and b.completed_at >= b.created_at
    assert created.id in [x.id for x in listed.data]
    records = [orjson.loads(x) for x in content.splitlines()]
    assert sorted(r["custom_id"] for r in records) == sorted(bodies)
    by_id = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in records}
    for i in range(20):
        assert final_answer(by_id[f"l{i}"]).replace(",", "") == QUERIES[i]["reference"].replace(",", "")
    assert sim.log()["batch_submissions"] == {hashlib.sha256(data).hexdigest(): 1}


def test_litellm_cancel_retrieve_and_delete(sim):
    import litellm

    sim.set_faults(batch_delay_s=60)
    data = jsonl([line(f"k{i}", body("sim-good", i)) for i in range(5)])
    kw = {"custom_llm_provider": "openai", "api_base": sim.url, "api_key": "sk-anything"}

    async def go():
        f = await litellm.acreate_file(file=("steps.jsonl", data), purpose="batch", **kw)
        got = await litellm.afile_retrieve(file_id=f.id, **kw)
        b = await litellm.acreate_batch(input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h", **kw)
        cancelling = await litellm.acancel_batch(batch_id=b.id, **kw)
        cancelled = await litellm.aretrieve_batch(batch_id=b.id, **kw)
        errors = await litellm.afile_content(file_id=cancelled.error_file_id, **kw)
        deleted = await litellm.afile_delete(file_id=f.id, **kw)
        return f, got, cancelling, cancelled, errors.content, deleted

    f, got, cancelling, cancelled, errors, deleted = asyncio.run(go())
    assert got.id == f.id and got.bytes == len(data)
    assert cancelling.status == "cancelling" and cancelled.status == "cancelled"
    assert cancelled.request_counts.failed == 5 and cancelled.output_file_id is None
    assert [orjson.loads(x)["error"]["code"] for x in errors.splitlines()] == ["batch_cancelled"] * 5
    assert deleted.deleted is True


def test_status_and_counts_move_by_the_clock(sim):
    sim.set_faults(batch_delay_s=1.5)
    seen: list[str] = []
    counts: list[int] = []

    async def go(c: Client):
        b = await c.submit([line(f"s{i}", body("sim-good", i)) for i in range(50)])
        seen.append(b["status"])
        while b["status"] not in ("completed", "expired", "cancelled", "failed"):
            await asyncio.sleep(0.02)
            b = (await c.call("GET", f"/batches/{b['id']}"))[1]
            counts.append(b["request_counts"]["completed"])
            if seen[-1] != b["status"]:
                seen.append(b["status"])
        return b

    b = using(sim, go)
    order = ["validating", "in_progress", "finalizing", "completed"]
    assert seen[0] == "validating" and seen[-1] == "completed"
    assert seen == sorted(seen, key=order.index) and "in_progress" in seen
    assert b["created_at"] <= b["in_progress_at"] <= b["finalizing_at"] <= b["completed_at"]
    assert counts == sorted(counts) and counts[-1] == 50
    assert any(0 < n < 50 for n in counts)  # lines are done while the batch is in progress


def test_the_delay_is_counted_from_submission_not_from_polls(sim):
    sim.set_faults(batch_delay_s=0.5)

    async def go(c: Client):
        b = await c.submit([line("x", body("sim-good", 1))])
        await asyncio.sleep(0.6)  # no poll meanwhile: the batch is done when first read
        return (await c.call("GET", f"/batches/{b['id']}"))[1]

    assert using(sim, go)["status"] == "completed"


# -- expiry, line errors, cancel ---------------------------------------------------

def test_expired_batch_keeps_done_lines_and_lists_the_rest_as_batch_expired(sim):
    sim.set_faults(batch_expire=0.25)
    lines = [line(f"e{i}", body("sim-good", i)) for i in range(40)]
    b, out, err = using(sim, lambda c: c.run(lines))
    assert b["status"] == "expired" and b["expired_at"] is not None and b["completed_at"] is None
    assert b["request_counts"] == {"total": 40, "completed": 30, "failed": 10}
    assert set(out) == {f"e{i}" for i in range(30)}
    assert set(err) == {f"e{i}" for i in range(30, 40)}
    for rec in err.values():
        assert rec["response"] is None and rec["error"]["code"] == "batch_expired"
    log = sim.log()
    assert log["batch_lines"] == {"200": 30, "batch_expired": 10}
    assert sum(t[1] for t in log["batch_billed_tokens"].values()) == sum(
        r["response"]["body"]["usage"]["completion_tokens"] for r in out.values())


def test_fully_expired_batch_has_no_output_file(sim):
    sim.set_faults("sim-good", batch_expire=1.0)
    b, out, err = using(sim, lambda c: c.run([line(f"e{i}", body("sim-good", i)) for i in range(5)]))
    assert b["status"] == "expired" and b["output_file_id"] is None and out == {}
    assert len(err) == 5 and sim.log()["batch_billed_tokens"] == {}


def test_a_batch_can_fail_validation(sim):
    sim.set_faults(batch_fail_rate=1.0)
    b, out, err = using(sim, lambda c: c.run([line(f"f{i}", body("sim-good", i)) for i in range(5)]))
    assert b["status"] == "failed" and b["failed_at"] is not None and b["completed_at"] is None
    assert b["in_progress_at"] is None and b["finalizing_at"] is None
    assert b["errors"]["data"][0]["code"] == "simulated_failure"
    assert b["output_file_id"] is None and b["error_file_id"] is None and out == err == {}
    assert b["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
    assert sim.log()["batch_billed_tokens"] == {} and sim.log()["batch_lines"] == {}


def test_line_errors_go_to_the_error_file_and_a_new_batch_redraws_them(sim):
    sim.set_faults(batch_line_error_rate=0.3)
    bodies = {f"r{i}": body("sim-good", i) for i in range(400)}
    b, out, err = using(sim, lambda c: c.run([line(k, v) for k, v in bodies.items()]))
    assert b["status"] == "completed"
    assert set(out) | set(err) == set(bodies) and not set(out) & set(err)
    assert 0.2 * 400 < len(err) < 0.4 * 400
    assert b["request_counts"] == {"total": 400, "completed": len(out), "failed": len(err)}
    for rec in err.values():
        assert rec["response"]["status_code"] == 500 and rec["error"] is None
        assert rec["response"]["body"]["error"]["type"] == "server_error"
    assert sim.log()["batch_lines"] == {"200": len(out), "500": len(err)}

    # the same lines in a new batch draw again: most now pass, at the same rate
    again, out1, err1 = using(sim, lambda c: c.run([line(k, bodies[k]) for k in err]))
    assert set(out1) | set(err1) == set(err) and 0.5 * len(err) < len(out1) < len(err)
    sim.clear_faults()
    retry, out2, err2 = using(sim, lambda c: c.run([line(k, bodies[k]) for k in err]))
    assert retry["status"] == "completed" and err2 == {} and set(out2) == set(err)
    # a retried line gets the answer its body gets anywhere
    online = using(sim, lambda c: c.call("POST", "/chat/completions", bodies[next(iter(err))]))[1]
    assert out2[next(iter(err))]["response"]["body"]["choices"] == online["choices"]


def test_per_model_faults_apply_per_line(sim):
    sim.set_faults("sim-faulty", rate_limit_rate=1.0)
    sim.set_faults("sim-weak", fail_status=503)
    lines = [line("ok", body("sim-good", 1)), line("limited", body("sim-faulty", 2)),
             line("down", body("sim-weak", 3)), line("nomodel", body("gpt-nothing", 4)),
             line("locked", body("sim-locked", 5)), line("bad", {"model": "sim-good", "messages": []}),
             line("locked-bad", {"model": "sim-locked", "messages": []})]  # the key is checked first
    b, out, err = using(sim, lambda c: c.run(lines))
    assert set(out) == {"ok"}
    status = {k: r["response"]["status_code"] for k, r in err.items()}
    assert status == {"limited": 429, "down": 503, "nomodel": 404, "locked": 401, "bad": 400, "locked-bad": 401}
    assert err["nomodel"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert "messages" in err["bad"]["response"]["body"]["error"]["message"]
    # the key-locked model answers when the batch was created with its key
    b, out, err = using(sim, lambda c: c.run([line("locked", body("sim-locked", 5))]), key=SECRET)
    assert set(out) == {"locked"} and err == {}


def test_cancel(sim):
    sim.set_faults(batch_delay_s=60)

    async def go(c: Client):
        b = await c.submit([line(f"c{i}", body("sim-good", i)) for i in range(8)])
        status, cancelling = await c.call("POST", f"/batches/{b['id']}/cancel")
        assert status == 200
        done = await c.wait(b["id"])
        again = await c.call("POST", f"/batches/{b['id']}/cancel")
        err = await c.content(done["error_file_id"])
        missing = await c.call("POST", "/batches/batch_nope/cancel")
        return cancelling, done, again, err, missing

    cancelling, done, (again_status, again), err, (missing_status, missing) = using(sim, go)
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"] is not None
    assert done["status"] == "cancelled" and done["cancelled_at"] is not None
    assert done["output_file_id"] is None  # cancelled while validating: nothing was done
    assert sorted(r["custom_id"] for r in err) == sorted(f"c{i}" for i in range(8))
    assert {r["error"]["code"] for r in err} == {"batch_cancelled"}
    assert again_status == 409 and "cancelled" in again["error"]["message"]
    assert missing_status == 404 and "batch_nope" in missing["error"]["message"]
    assert sim.log()["batch_billed_tokens"] == {}


def test_cancel_in_progress_keeps_the_lines_done_so_far(sim):
    sim.set_faults(batch_delay_s=2)

    async def go(c: Client):
        b = await c.submit([line(f"p{i:02d}", body("sim-good", i)) for i in range(40)])
        while b["request_counts"]["completed"] == 0:
            await asyncio.sleep(0.05)
            b = (await c.call("GET", f"/batches/{b['id']}"))[1]
        await c.call("POST", f"/batches/{b['id']}/cancel")
        done = await c.wait(b["id"])
        return done, await c.content(done["output_file_id"]), await c.content(done["error_file_id"])

    done, out, err = using(sim, go)
    assert done["status"] == "cancelled" and 0 < len(out) < 40 and len(out) + len(err) == 40
    assert [r["custom_id"] for r in out] == [f"p{i:02d}" for i in range(len(out))]  # in file order
    assert {r["error"]["code"] for r in err} == {"batch_cancelled"}
    assert done["request_counts"] == {"total": 40, "completed": len(out), "failed": len(err)}
    assert sum(t[1] for t in sim.log()["batch_billed_tokens"].values()) == sum(
        r["response"]["body"]["usage"]["completion_tokens"] for r in out)


def test_a_finished_batch_cannot_be_cancelled(sim):
    async def go(c: Client):
        b = await c.submit([line("a", body("sim-good", 1))])
        return await c.call("POST", f"/batches/{b['id']}/cancel"), await c.call("GET", f"/batches/{b['id']}")

    (status, r), (_, b) = using(sim, go)
    assert status == 409 and "completed" in r["error"]["message"] and b["status"] == "completed"


# -- submissions, files, lists ------------------------------------------------------

def test_submissions_are_counted_per_input_file_and_batches_survive_a_log_reset(sim):
    data = jsonl([line("a", body("sim-good", 1)), line("b", body("sim-good", 2))])

    async def go(c: Client):
        _, f = await c.upload(data)
        made = []
        for _ in range(2):
            made.append((await c.call("POST", "/batches", {"input_file_id": f["id"], "endpoint": ENDPOINT,
                                                          "completion_window": "24h"}))[1])
        first = dict(sim.log())
        sim.reset()
        later = await c.wait(made[0]["id"])
        return first, later

    first, later = using(sim, go)
    assert first["batch_submissions"] == {hashlib.sha256(data).hexdigest(): 2}
    assert first["batches_created"] == 2 and first["files_uploaded"] == 1
    assert later["status"] == "completed"  # files and batches outlive /admin/reset
    assert sim.log()["batch_submissions"] == {}


def test_files_can_be_read_listed_and_deleted(sim):
    data = jsonl([line("a", body("sim-good", 1))])

    async def go(c: Client):
        _, f = await c.upload(data, filename="steps.jsonl")
        got = await c.call("GET", f"/files/{f['id']}")
        async with c.s.get(f"{c.url}/files/{f['id']}/content") as r:
            raw = await r.read()
        listed = await c.call("GET", "/files?purpose=batch")
        deleted = await c.call("DELETE", f"/files/{f['id']}")
        gone = await c.call("GET", f"/files/{f['id']}")
        return f, got, raw, listed, deleted, gone

    f, (s1, got), raw, (s2, listed), (s3, deleted), (s4, gone) = using(sim, go)
    assert f["object"] == "file" and f["purpose"] == "batch" and f["filename"] == "steps.jsonl"
    assert f["bytes"] == len(data) and isinstance(f["created_at"], int)
    assert s1 == 200 and got == f and raw == data
    assert s2 == 200 and f["id"] in [x["id"] for x in listed["data"]]
    assert s3 == 200 and deleted == {"id": f["id"], "object": "file", "deleted": True}
    assert s4 == 404 and f["id"] in gone["error"]["message"]


def test_a_batch_runs_even_if_its_input_file_was_deleted(sim):
    async def go(c: Client):
        sim.set_faults(batch_delay_s=0.3)
        b = await c.submit([line("a", body("sim-good", 1))])
        await c.call("DELETE", f"/files/{b['input_file_id']}")
        return await c.wait(b["id"])

    assert using(sim, go)["request_counts"]["completed"] == 1


def test_batches_list_newest_first_with_paging(sim):
    async def go(c: Client):
        ids = [(await c.submit([line("a", body("sim-good", i))]))["id"] for i in range(3)]
        _, page1 = await c.call("GET", "/batches?limit=2")
        _, page2 = await c.call("GET", f"/batches?limit=2&after={page1['last_id']}")
        bad = await c.call("GET", "/batches?limit=0")
        return ids, page1, page2, bad

    ids, page1, page2, (bad_status, _) = using(sim, go)
    assert [b["id"] for b in page1["data"]] == ids[::-1][:2] and page1["has_more"]
    assert page2["data"][0]["id"] == ids[0]
    assert bad_status == 400


# -- bad input ----------------------------------------------------------------

GOOD = orjson.dumps(line("a", body("sim-good", 1)))


@pytest.mark.parametrize("data, words", [
    (GOOD + b"\n" + GOOD.replace(b'"a"', b'"b"') + b"\n{not json\n", "line 3: not valid JSON"),
    (orjson.dumps(line("a", body("sim-good", 1), url="/v1/embeddings")),
     "line 1: 'url' must be '/v1/chat/completions'"),
    (GOOD + b"\n" + GOOD + b"\n", "line 2: custom_id 'a' is already used on line 1"),
    (orjson.dumps({"method": "POST", "url": ENDPOINT, "body": {}}), "line 1: 'custom_id' is required"),
    (orjson.dumps({**line("a", {}), "method": "GET"}), "line 1: 'method' must be 'POST'"),
    (orjson.dumps({**line("a", {}), "body": "hi"}), "line 1: 'body' is required and must be a JSON object"),
    (b"[1, 2]\n", "line 1: must be a JSON object"),
    (b"\n", "the file holds no requests"),
])
def test_bad_input_files_are_refused_with_the_line(sim, data, words):
    status, r = using(sim, lambda c: c.upload(data, filename="mine.jsonl"))
    assert status == 400 and r["error"]["param"] == "file"
    assert r["error"]["message"].startswith("mine.jsonl: ") and words in r["error"]["message"]


@pytest.mark.parametrize("change, words, param", [
    ({"endpoint": "/v1/embeddings"}, "endpoint must be '/v1/chat/completions'", "endpoint"),
    ({"completion_window": "48h"}, "completion_window must be '24h'", "completion_window"),
    ({"input_file_id": "file-missing"}, "No such File object: file-missing", "input_file_id"),
    ({"metadata": {"k": 1}}, "metadata must be an object", "metadata"),
])
def test_bad_batch_requests_are_refused(sim, change, words, param):
    async def go(c: Client):
        _, f = await c.upload(GOOD)
        return await c.call("POST", "/batches", {"input_file_id": f["id"], "endpoint": ENDPOINT,
                                                 "completion_window": "24h", **change})

    status, r = using(sim, go)
    assert status == 400 and words in r["error"]["message"] and r["error"]["param"] == param
    assert sim.log()["batches_created"] == 0


def test_upload_needs_purpose_batch(sim):
    status, r = using(sim, lambda c: c.upload(GOOD, purpose="fine-tune"))
    assert status == 400 and r["error"]["param"] == "purpose" and "fine-tune" in r["error"]["message"]


# -- configuration and size ------------------------------------------------------

def test_batch_settings_are_checked_like_other_faults(sim):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(sim.root + "/admin/faults", data=orjson.dumps({"batch_expire": 2}), method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with pytest.raises(urllib.error.HTTPError) as e:
        opener.open(req, timeout=10)
    assert e.value.code == 400 and "batch_expire: must be a fraction" in e.value.read().decode()
    pool = parse_pool({"workers": [{"id": "w", "model": "openai/m",
                                    "simulate": {"batch_delay_s": 5, "batch_line_error_rate": 0.1}}]})
    assert served_models(pool)["m"].faults == {"batch_delay_s": 5.0, "batch_line_error_rate": 0.1}


def test_batch_faults_can_be_set_at_start(tmp_path):
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(
        {"workers": [{"id": "w", "model": "openai/sim-w", "simulate": {"skill": 1.0}}]}))
    cols = {c: [r.get(c) for r in QUERIES[:5]] for c in ("query_id", "prompt", "task", "reference")}
    pq.write_table(pa.table(cols), tmp_path / "q.parquet")
    with start_sim(tmp_path / "pool.yaml", tmp_path / "q.parquet", latency_ms=0, batch_expire=1.0) as other:
        b, out, err = using(other, lambda c: c.run([line("a", body("sim-w", 0))]))
        effective = other.faults()["effective"]["sim-w"]
    assert b["status"] == "expired" and list(err) == ["a"] and out == {}
    assert effective["batch_expire"] == 1.0 and effective["batch_delay_s"] == 0.0


def test_ten_thousand_lines(sim):
    n = 10_000
    lines = [line(f"n{i}", body(("sim-good", "sim-plain")[i % 2], i)) for i in range(n)]

    async def go(c: Client):
        t0 = time.perf_counter()
        b = await c.submit(lines)
        t1 = time.perf_counter()
        done = await c.wait(b["id"])
        t2 = time.perf_counter()
        out = await c.content(done["output_file_id"])
        print(f"\n10,000-line batch: upload+create {t1 - t0:.2f} s, answered by the first poll in {t2 - t1:.2f} s, "
              f"download {time.perf_counter() - t2:.2f} s")
        return done, out

    done, out = using(sim, go)
    assert done["request_counts"] == {"total": n, "completed": n, "failed": 0}
    assert sorted(r["custom_id"] for r in out) == sorted(f"n{i}" for i in range(n))
    assert sim.log()["batch_lines"] == {"200": n}
