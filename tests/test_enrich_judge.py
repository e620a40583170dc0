"""The enrichment judge: a changed judge definition (rubric, judge worker) rescores reused
records without extracting them again, counted in the simulated pool's log over HTTP; a
budget stop half way through keeps the old scores and the next run judges only those; and a
score outside 0..1 is an invalid reply (repaired once, else no score), never clamped."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.enrich import load_job
from conductor.enrich.run import run_job
from tests.conftest import worker

IDS = [f"r{i}" for i in range(8)]
JUDGE_WORST_USD = 64 * 2.0e-6
TEXTS = [f"Invoice {i}: {100 + 7 * i} units of part {chr(65 + i)} shipped on day {i + 3}." for i in range(8)]


def write_job(folder: Path, url: str, *, rubric: str = "Be strict: every field must be in the text.",
              judge_worker: str = "weak", budget_usd: float | None = None, concurrency: int = 32,
              timeout_s: float = 10) -> Path:
    pq.write_table(pa.table({"id": IDS, "text": TEXTS}), folder / "input.parquet")
    # The judge's calls (weak's) are charged for their output only, at most 64 tokens: a call's
    # worst case, reserved against a budget, is JUDGE_WORST_USD.
    (folder / "pool.yaml").write_text(yaml.safe_dump({
        "providers": {"sim": {"max_concurrency": concurrency, "timeout_s": timeout_s}},
        "workers": [worker("fast", url), worker("weak", url, price={"input_per_mtok": 0, "output_per_mtok": 2.0},
                                                params={"temperature": 0, "max_tokens": 64})]}, sort_keys=False))
    doc = {"name": "notes", "input": {"path": "input.parquet", "id": "id"}, "prompt": "Note: {{ text }}",
           "fields": {"part": {"type": "string", "required": True}, "units": {"type": "number"}},
           "pool": "pool.yaml", "mode": "direct", "worker": "fast",
           "quality": {"judge": {"worker": judge_worker, "rubric": rubric}}}
    if budget_usd is not None:
        doc["budget_usd"] = budget_usd
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def records(summary: dict) -> dict[str, dict]:
    return {r["id"]: r for r in pq.read_table(summary["records_path"]).to_pylist()}


def judge_results(data: Path, summary: dict) -> pa.Table | None:
    path = data / "runs" / f"{summary['run_id']}-judge" / "results.parquet"
    return pq.read_table(path) if path.exists() else None


def test_a_changed_rubric_or_judge_worker_rescores_reused_records_without_extracting(fresh_sim, tmp_path):
    sim, data = fresh_sim, tmp_path / "data"
    first = run_job(load_job(write_job(tmp_path, sim.url)), data_dir=data, progress=False)
    assert sim.log()["by_model"] == {"fast": 8, "weak": 8}
    old = records(first)
    assert all(r["status"] == "ok" and r["judge_score"] is not None and 0 <= r["judge_score"] <= 1 for r in
               old.values())  # the sim keeps the score in the schema's 0..1

    # Nothing changed: nothing is judged again, no call, no judge run.
    sim.reset()
    same = run_job(load_job(write_job(tmp_path, sim.url)), data_dir=data, progress=False)
    assert sim.log()["total"] == 0 and same["reused"] == 8 and same["judge_cost_usd"] == 0
    assert judge_results(data, same) is None
    assert {k: (r["judge_score"], r.get("judge_hash")) for k, r in records(same).items()} == \
        {k: (r["judge_score"], r.get("judge_hash")) for k, r in old.items()}

    # A new rubric: every record is judged again under it (8 judge calls), none extracted again.
    sim.reset()
    new = run_job(load_job(write_job(tmp_path, sim.url, rubric="Lenient: any plausible part will do.")),
                  data_dir=data, progress=False)
    assert sim.log()["by_model"] == {"weak": 8}
    assert len({r["judge_hash"] for r in old.values()}) == 1 and old["r0"]["judge_hash"]
    assert new["computed"] == 0 and new["reused"] == 8 and new["cost_usd"] == 0 and new["judge_cost_usd"] > 0
    rescored = records(new)
    assert all(r["reused"] and r["judge_score"] is not None for r in rescored.values())
    assert {r["judge_hash"] for r in rescored.values()} == {rescored["r0"]["judge_hash"]} != {old["r0"]["judge_hash"]}
    assert sorted(judge_results(data, new).column("query_id").to_pylist()) == IDS
    assert new["metrics"]["judge"]["judged_rows"] == 8 and new["metrics"]["judge"]["stale_rows"] == 0

    # Another judge worker, same rubric: judged again by it.
    sim.reset()
    other = run_job(load_job(write_job(tmp_path, sim.url, rubric="Lenient: any plausible part will do.",
                                       judge_worker="fast")), data_dir=data, progress=False)
    assert sim.log()["by_model"] == {"fast": 8} and other["computed"] == 0 and other["cost_usd"] == 0
    assert {r["judge_hash"] for r in records(other).values()}.isdisjoint({rescored["r0"]["judge_hash"]})


def test_a_budget_stop_while_rescoring_keeps_old_scores_and_the_next_run_judges_only_those(fresh_sim, tmp_path):
    sim, data = fresh_sim, tmp_path / "data"
    first = run_job(load_job(write_job(tmp_path, sim.url, concurrency=1)), data_dir=data, progress=False)
    old = records(first)
    # The extraction is reused at $0, so the budget is the judge's: a call's worst case and about
    # three calls more, so some records are judged again and the rest are stopped.
    budget = JUDGE_WORST_USD + 3 * first["judge_cost_usd"] / 8
    sim.reset()
    path = write_job(tmp_path, sim.url, rubric="A new rubric.", budget_usd=budget, concurrency=1)
    half = run_job(load_job(path), data_dir=data, progress=False)
    stopped = half["judge_budget_exhausted"]
    assert 0 < stopped < 8 and half["computed"] == 0 and half["cost_usd"] == 0
    assert sim.log()["by_model"] == {"weak": 8 - stopped}
    mixed = records(half)
    new_hash = {r["judge_hash"] for r in mixed.values()} - {old["r0"]["judge_hash"]}
    assert len(new_hash) == 1
    stale = {k for k, r in mixed.items() if r["judge_hash"] == old["r0"]["judge_hash"]}
    assert len(stale) == stopped
    # No score paid for is lost: the stopped ones keep theirs (and its digest), the rest have the new one.
    assert all(mixed[k]["judge_score"] == old[k]["judge_score"] for k in stale)
    assert all(r["judge_score"] is not None for r in mixed.values())
    assert half["metrics"]["judge"]["judged_rows"] == 8 - stopped
    assert half["metrics"]["judge"]["stale_rows"] == stopped

    sim.reset()
    doc = yaml.safe_load(path.read_text())
    doc["budget_usd"] = 1.0
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    done = run_job(load_job(path), data_dir=data, progress=False)
    assert sim.log()["by_model"] == {"weak": stopped} and done["judge_budget_exhausted"] == 0
    assert sorted(judge_results(data, done).column("query_id").to_pylist()) == sorted(stale)
    final = records(done)
    assert {r["judge_hash"] for r in final.values()} == new_hash
    assert all(final[k]["judge_score"] == mixed[k]["judge_score"] for k in set(IDS) - stale)
    assert done["metrics"]["judge"]["judged_rows"] == 8 and done["metrics"]["judge"]["stale_rows"] == 0


def test_records_without_a_judge_digest_are_judged_once_more(fresh_sim, tmp_path):
    """Records an older version wrote have a score but no judge_hash: which rubric gave it cannot
    be told, so they are judged once more (an unchanged request is the response cache's, at $0)."""
    sim, data = fresh_sim, tmp_path / "data"
    path = write_job(tmp_path, sim.url)
    first = run_job(load_job(path), data_dir=data, progress=False)
    old = pq.read_table(first["records_path"])
    pq.write_table(old.drop_columns(["judge_hash"]) if "judge_hash" in old.column_names else old,
                   first["records_path"])
    sim.reset()
    again = run_job(load_job(path), data_dir=data, progress=False)
    assert sim.log()["total"] == 0 and again["cost_usd"] == 0 and again["judge_cost_usd"] == 0  # the cache's
    assert judge_results(data, again) is not None, "the records without a digest were not judged again"
    assert sorted(judge_results(data, again).column("query_id").to_pylist()) == IDS
    rec = records(again)
    assert all(r["judge_hash"] for r in rec.values())
    assert [rec[i]["judge_score"] for i in IDS] == old.column("judge_score").to_pylist()
    third = run_job(load_job(path), data_dir=data, progress=False)
    assert judge_results(data, third) is None and sim.log()["total"] == 0


def test_a_failed_judge_call_leaves_no_score_with_its_reason_and_the_next_run_asks_again(fresh_sim, tmp_path):
    sim, data = fresh_sim, tmp_path / "data"
    path = write_job(tmp_path, sim.url)
    sim.set_faults("weak", fail_status=400)
    first = run_job(load_job(path), data_dir=data, progress=False)
    rec = records(first)
    assert all(r["status"] == "ok" and r["judge_score"] is None for r in rec.values())
    assert all(r["judge_reason"] and r["judge_reason"].startswith("the judge's call failed") for r in rec.values())
    assert all(r["judge_hash"] is None for r in rec.values())  # not judged: the next run asks again
    sim.clear_faults()
    sim.reset()
    again = run_job(load_job(path), data_dir=data, progress=False)
    assert sim.log()["by_model"] == {"weak": 8} and again["computed"] == 0
    assert all(r["judge_score"] is not None and r["judge_hash"] for r in records(again).values())


# ---- scores outside 0..1 --------------------------------------------------------
# The sim keeps a number within the schema's minimum and maximum, so it never answers a judge
# out of range: this server does, with the scores a rubric asks for: `FIRST=x` for the
# judge's reply and `REPAIR=y` for its repair. Record requests get a record from the schema.

class _Fake(BaseHTTPRequestHandler):
    log: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        users = [m["content"] for m in body["messages"] if m["role"] == "user"]
        repair = users[-1].lstrip().startswith("Your reply was not a valid record:")
        if users[0].startswith("You are reviewing a record"):
            score = re.search(("REPAIR" if repair else "FIRST") + r"=(\S+)", users[0]).group(1)
            content = json.dumps({"score": float(score), "reason": f"said {score}"})
        else:
            content = json.dumps({"part": "A", "units": 100})
        type(self).log.append({"judge": users[0].startswith("You are reviewing"), "repair": repair})
        data = json.dumps({"id": "x", "object": "chat.completion", "model": body["model"],
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": content}}],
                           "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Fake.log = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("first, repair, expected", [
    ("7", "0.7", 0.7),      # a 1-10 scale, fixed by the repair
    ("7", "7", None),       # still out of range: no score, not a perfect one
    ("-3", "-3", None),     # not a zero either
])
def test_a_judge_score_outside_0_to_1_is_an_invalid_reply_not_clamped(fake, tmp_path, first, repair, expected):
    path = write_job(tmp_path, fake, rubric=f"Score on a 1-10 scale. FIRST={first} REPAIR={repair}")
    s = run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
    rec = records(s)
    assert all(r["status"] == "ok" for r in rec.values())  # the extraction is fine
    assert {r["judge_score"] for r in rec.values()} == {expected}
    judged = [e for e in _Fake.log if e["judge"]]
    assert len(judged) == 16 and sum(e["repair"] for e in judged) == 8  # each reply, then its repair
    if expected is None:
        bound = "maximum" if float(first) > 1 else "minimum"
        assert all(re.search(rf"no valid judge reply.*score: {re.escape(repair)}(\.0)? is (greater|less) than the "
                             rf"{bound} of", r["judge_reason"]) for r in rec.values()), rec["r0"]["judge_reason"]
        assert s["metrics"]["judge"]["mean_score"] is None and s["metrics"]["judge"]["judged_rows"] == 0
        # That is the judge's answer under this rubric: a rerun does not ask again (the cache would
        # give the same reply); the record keeps its null score and the reason.
        _Fake.log = []
        again = run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
        assert _Fake.log == [] and again["reused"] == 8
        assert judge_results(tmp_path / "data", again) is None
        assert [(r["judge_score"], r["judge_reason"]) for r in records(again).values()] == \
            [(r["judge_score"], r["judge_reason"]) for r in rec.values()]
    else:
        assert s["metrics"]["judge"]["mean_score"] == pytest.approx(expected)
        assert all(r["judge_reason"] == f"said {repair}" for r in rec.values())


def test_requests_cut_off_by_timeout_are_counted_for_the_job_and_within_its_budget(fresh_sim, tmp_path):
    """Extraction's and the judge's requests cut off by timeout_s may be billed: the job's lost-in-flight
    line counts both runs' (the judge's was counted nowhere), and the judge's budget is what extraction
    left after its cost and those calls at their worst case (it left out the calls)."""
    import time

    sim, data = fresh_sim, tmp_path / "data"
    sim.set_faults(hang_rate=0.3, hang_s=1.5)
    budget = 0.004
    summary = run_job(load_job(write_job(tmp_path, sim.url, budget_usd=budget, timeout_s=0.5)), data_dir=data,
                      progress=False)
    lost = summary["lost_in_flight"]
    # The server logs a request it hung on once it finds the client gone (its hang is 1.5 s): at least
    # 2 s on, and until it has logged as many as the job counted, on a busy machine later still.
    ended = time.monotonic()
    while time.monotonic() < ended + 20 and (time.monotonic() < ended + 2
                                             or sim.log()["by_status"].get("499", 0) < lost["calls"]):
        time.sleep(0.2)
    hung = sim.log()["by_status"].get("499", 0)
    assert hung > 0 and lost["calls"] == hung
    assert summary["cost_usd"] + summary["judge_cost_usd"] + lost["reserved_usd"] <= budget + 1e-9
