"""Enrichment jobs end to end on the real finance data against the simulated pool over HTTP:
typed records, the catalog view joined back to the input, metrics checked by a separate
computation, repairs under malformed JSON, incremental reruns counted in the sim's log."""

from __future__ import annotations

import json
import os
import re
import string
from pathlib import Path

import duckdb
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from conductor.enrich import load_job, render_queries
from conductor.enrich.run import run_job
from conductor.errors import ConductorError, InputError
from conductor.store import write_table
from tests.conftest import REPO, cli, kill_when_journaled, line_count

FINANCE = Path(os.environ.get("CONDUCTOR_FINANCE_DIR", REPO.parent / "shared" / "finance"))
QA_JOB = REPO / "jobs" / "finance_qa.yaml"
DOCS_JOB = REPO / "jobs" / "finance_documents.yaml"
SIM_POOL = REPO / "data" / "pools" / "sim.yaml"

# slow: enrichment jobs end to end on the finance data
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (FINANCE / "questions.parquet").exists(),
                                reason=f"the finance data is not at {FINANCE} (see ../shared/finance/README.md)")]


@pytest.fixture(scope="module")
def fin_sim(tmp_path_factory):
    """The demo pool's simulated workers, knowing every query of both finance jobs."""
    from conductor.sim import start_sim

    d = tmp_path_factory.mktemp("finsim")
    files = []
    for job in (QA_JOB, DOCS_JOB):
        out = d / f"{job.stem}.parquet"
        write_table(out, render_queries(load_job(job)))
        files.append(out)
    old = os.environ.get("CONDUCTOR_SIM_URL")
    with start_sim(SIM_POOL, files) as sim:
        os.environ["CONDUCTOR_SIM_URL"] = sim.url
        try:
            yield sim
        finally:
            if old is None:
                os.environ.pop("CONDUCTOR_SIM_URL", None)
            else:
                os.environ["CONDUCTOR_SIM_URL"] = old


@pytest.fixture
def sim(fin_sim):
    fin_sim.clear_faults()
    fin_sim.reset()
    return fin_sim


def variant(src: Path, folder: Path, name: str | None = None, rows: pa.Table | None = None, **changes) -> Path:
    """A copy of a shipped job in `folder`, paths made absolute, optionally over other rows."""
    doc = yaml.safe_load(src.read_text())
    doc["input"]["path"] = str((src.parent / doc["input"]["path"]).resolve())
    for j in doc["input"].get("join", []):
        j["path"] = str((src.parent / j["path"]).resolve())
    doc["pool"] = str((src.parent / doc["pool"]).resolve())
    if rows is not None:
        pq.write_table(rows, folder / "input.parquet")
        doc["input"]["path"] = str(folder / "input.parquet")
    doc.update(changes)
    if name:
        doc["name"] = name
    path = folder / f"{doc['name']}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def questions(n: int | None = None, offset: int = 0) -> pa.Table:
    t = pq.read_table(FINANCE / "questions.parquet")
    return t.slice(offset, n) if n is not None else t


# ---- the per-question job over all rows ----------------------------------------

def test_finance_qa_all_rows_typed_joined_and_scored(sim, tmp_path):
    data = tmp_path / "data"
    s = run_job(load_job(QA_JOB), data_dir=data, progress=False)
    gold = questions()
    assert s["rows"] == gold.num_rows == 1668 and s["computed"] == 1668 and s["reused"] == 0

    rec = pq.read_table(s["records_path"])
    types = {f.name: f.type for f in rec.schema}
    assert types["question_id"] == pa.string() and types["doc_id"] == pa.string()
    assert types["answer"] == pa.list_(pa.string())
    assert types["scale"] == pa.string() and types["answer_type"] == pa.string()
    assert types["evidence"] == pa.string()
    assert types["cost_usd"] == pa.float64() and types["calls"] == pa.int32() and types["score"] == pa.float64()
    assert set(rec.column("status").to_pylist()) <= {"ok", "invalid"}
    ok = pc.equal(rec.column("status"), "ok")
    assert pc.all(pc.is_valid(pc.filter(rec.column("answer"), ok))).as_py()  # required field present
    assert set(pc.filter(rec.column("scale"), ok).to_pylist()) <= {"", "thousand", "million", "billion", "percent"}

    # The catalog view joins back to the input on its id: no row lost, none duplicated.
    con = duckdb.connect(str(data / "conductor.duckdb"), read_only=True)
    qpath = str(FINANCE / "questions.parquet")
    n, distinct = con.sql(f"SELECT count(*), count(DISTINCT question_id) FROM finance_qa "
                          f"JOIN read_parquet('{qpath}') USING (question_id)").fetchone()
    assert n == distinct == 1668
    lost = con.sql(f"SELECT count(*) FROM read_parquet('{qpath}') q ANTI JOIN finance_qa USING (question_id)")
    assert lost.fetchone()[0] == 0
    # Costs in the records are what the traces paid.
    paid = con.sql(f"SELECT sum(cost_usd) FROM traces WHERE run_id = '{s['run_id']}'").fetchone()[0]
    assert pc.sum(rec.column("cost_usd")).as_py() == pytest.approx(paid)
    con.close()

    # Per-field metrics match a separate computation from the records and the gold answers.
    g = {r["question_id"]: r for r in gold.to_pylist()}
    rows = rec.to_pylist()
    scale_acc = sum(r["status"] == "ok" and r["scale"] == g[r["question_id"]]["scale"] for r in rows) / len(rows)
    type_acc = sum(r["status"] == "ok" and r["answer_type"] == g[r["question_id"]]["answer_type"]
                   for r in rows) / len(rows)
    em = [tatqa_em(r, g[r["question_id"]]) for r in rows]
    m = s["metrics"]["fields"]
    assert m["scale"]["accuracy"] == pytest.approx(scale_acc)
    assert m["answer_type"]["accuracy"] == pytest.approx(type_acc)
    assert m["answer"]["em"] == pytest.approx(sum(em) / len(em))
    assert m["answer"]["scored_rows"] == 1668
    overall = sum((e + (r["status"] == "ok" and r["scale"] == g[r["question_id"]]["scale"])
                   + (r["status"] == "ok" and r["answer_type"] == g[r["question_id"]]["answer_type"])) / 3
                  for e, r in zip(em, rows)) / len(rows)
    assert s["metrics"]["overall"] == pytest.approx(overall)
    # The simulated worker is right with its skill, so the scores are neither 0 nor 1.
    assert 0.2 < m["answer"]["em"] < 0.95 and 0.2 < scale_acc < 0.95
    # Rewards per row for the policy and RL export.
    rewards = pq.read_table(Path(s["records_path"]).with_name("rewards.parquet"))
    assert rewards.num_rows == 1668 and pc.all(pc.is_valid(rewards.column("reward"))).as_py()


def tatqa_em(rec: dict, gold: dict) -> float:
    """TAT-QA exact match, written out again here: answers sorted and joined, numbers rounded
    to 2 decimals and multiplied by their scale (percent: 0.01, and "12%" is 0.12), words
    followed by the scale, compared after lower-casing and removing punctuation, articles
    and extra spaces."""
    if rec["status"] != "ok" or not rec["answer"]:
        return 0.0
    mult = {"": 1, "thousand": 1e3, "million": 1e6, "billion": 1e9, "percent": 0.01}

    def num(x):
        s = str(x).strip().replace(",", "").replace("$", "").replace("%", "").replace(" ", "")
        neg = s.startswith("(") and s.endswith(")")
        try:
            v = float(s.strip("()"))
        except ValueError:
            return None
        return -v if neg else v

    def canon(items, scale):
        out = []
        for a in sorted(map(str, items)):
            v = num(a)
            out.append(f"{a} {scale}".strip() if v is None else
                       "%.4f" % round(v / 100, 4) if "%" in a else "%.4f" % (round(v, 2) * mult[scale]))
        return " ".join(out)

    def norm(s):
        s = "".join(c for c in s.lower() if c not in string.punctuation)
        return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())

    g = json.loads(gold["answer_json"])
    target = norm(canon(g if isinstance(g, list) else [g], gold["scale"]))
    tries = [canon(rec["answer"], rec["scale"])]
    if len(rec["answer"]) == 1 and not rec["scale"] and "%" not in rec["answer"][0] and num(rec["answer"][0]) is not None:
        tries.append("%.4f" % num(rec["answer"][0]))
    return float(any(norm(t) == target for t in tries))


# ---- malformed JSON and repairs ---------------------------------------------------

def test_malformed_json_every_row_valid_or_explicit_failure(sim, tmp_path):
    job = load_job(variant(QA_JOB, tmp_path, "qa_faults", rows=questions(300)))
    sim.set_faults("*", malformed_json=0.2)
    s = run_job(job, data_dir=tmp_path / "data", progress=False)
    rec = pq.read_table(s["records_path"])
    assert rec.num_rows == 300 and sorted(rec.column("question_id").to_pylist()) == sorted(
        questions(300).column("question_id").to_pylist())
    statuses = rec.column("status").to_pylist()
    assert set(statuses) <= {"ok", "invalid"} and statuses.count("ok") > 250
    for r in rec.to_pylist():
        assert (r["status"] == "ok") == (r["error"] is None)
        if r["status"] == "invalid":
            assert "not a valid record" in r["error"] and r["answer"] is None and r["calls"] == 2
    traces = pq.read_table(Path(s["records_path"]).with_name("traces.parquet")).to_pylist()
    repairs = [t for t in traces if t["step_path"] == "0.repair"]
    first_bad = [t for t in traces if t["step_path"] == "0" and t["status"] == "invalid"]
    assert 30 < len(repairs) == len(first_bad) < 100
    assert all(t["cost_usd"] > 0 and t["attempts"] == 1 for t in repairs)
    assert {t["failure"] for t in first_bad} == {"malformed"}
    assert pc.sum(rec.column("cost_usd")).as_py() == pytest.approx(sum(t["cost_usd"] for t in traces))
    assert sim.log()["by_kind"].get("repair", 0) == len(repairs)

    # A rerun retries the rows without a valid record by asking again: the response cache
    # holds the same bad answer. The valid rows are reused, nothing else is sent.
    sim.set_faults("*", malformed_json=0.0)
    sim.reset()
    bad = {r["question_id"] for r in rec.to_pylist() if r["status"] == "invalid"}
    again = run_job(job, data_dir=tmp_path / "data", progress=False)
    assert again["computed"] == len(bad) and again["reused"] == 300 - len(bad)
    assert set(sim.log()["by_query"]) == bad
    rec = pq.read_table(again["records_path"])
    assert set(rec.column("status").to_pylist()) == {"ok"}


def test_a_refused_repair_keeps_what_the_first_reply_cost(sim, tmp_path):
    """A repair call refused (billed, no content) was written under the first call's path,
    replacing its row: the paid invalid first reply dropped out of the job's cost."""
    from conductor.pool import load_pool

    job = load_job(variant(QA_JOB, tmp_path, "qa_refused_repairs", rows=questions(40)))
    sim.set_faults("*", malformed_json=1.0, refusal_rate=0.5)
    s = run_job(job, data_dir=tmp_path / "data", progress=False)
    traces = pq.read_table(Path(s["records_path"]).with_name("traces.parquet")).to_pylist()
    refused = [t for t in traces if t["step_path"].endswith(".repair") and t["status"] == "error"]
    assert refused and all("no text content" in t["error"] and t["cost_usd"] > 0 for t in refused)
    first = {(t["plan_id"], t["step_path"]) for t in traces if t["status"] == "invalid"}
    assert {(t["plan_id"], t["step_path"][:-len(".repair")]) for t in refused} <= first
    prices = {w.model.split("/", 1)[1]: w.price for w in load_pool(SIM_POOL).workers if w.price and w.model}
    billed = sum(p * prices[m].input + c * prices[m].output for m, (p, c) in sim.log()["billed_tokens"].items())
    assert sum(t["cost_usd"] or 0 for t in traces) == pytest.approx(billed, rel=1e-9)
    assert s["cost_usd"] == pytest.approx(billed, rel=1e-9)


# ---- incremental runs -------------------------------------------------------------

def test_rerun_sends_only_new_rows_template_change_and_full_refresh_send_all(sim, tmp_path):
    data = tmp_path / "data"
    path = variant(QA_JOB, tmp_path, "qa_daily", rows=questions(200))
    first = run_job(load_job(path), data_dir=data, progress=False)
    assert first["computed"] == 200 and sim.log()["total"] == 200

    # Tomorrow's file: the same 200 rows and 100 new ones.
    pq.write_table(questions(300), tmp_path / "input.parquet")
    sim.reset()
    second = run_job(load_job(path), data_dir=data, progress=False)
    new_ids = set(questions(100, offset=200).column("question_id").to_pylist())
    log = sim.log()
    assert second["computed"] == 100 and second["reused"] == 200
    assert log["total"] == 100 and set(log["by_query"]) == new_ids
    rec = pq.read_table(second["records_path"])
    reused = pc.filter(rec, rec.column("reused"))
    assert reused.num_rows == 200 and pc.sum(reused.column("cost_usd")).as_py() == 0
    assert set(reused.column("run_id").to_pylist()) == {first["run_id"]}
    con = duckdb.connect(str(data / "conductor.duckdb"), read_only=True)
    assert con.sql("SELECT count(*), count(DISTINCT question_id) FROM qa_daily").fetchone() == (300, 300)
    con.close()

    # Nothing new: nothing sent.
    sim.reset()
    assert run_job(load_job(path), data_dir=data, progress=False)["computed"] == 0 and sim.log()["total"] == 0

    # Rows removed from the input leave the view (they stayed, from older runs' records).
    pq.write_table(questions(250), tmp_path / "input.parquet")
    assert run_job(load_job(path), data_dir=data, progress=False)["computed"] == 0 and sim.log()["total"] == 0
    con = duckdb.connect(str(data / "conductor.duckdb"), read_only=True)
    assert con.sql("SELECT count(*), max(question_id) FROM qa_daily").fetchone() == \
        (250, max(questions(250).column("question_id").to_pylist()))
    con.close()
    pq.write_table(questions(300), tmp_path / "input.parquet")

    # A changed template recomputes every row.
    doc = yaml.safe_load(path.read_text())
    doc["prompt"] = doc["prompt"].replace("You are a financial analyst.", "You are a careful financial analyst.")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    sim.reset()
    third = run_job(load_job(path), data_dir=data, progress=False)
    assert third["computed"] == 300 and sim.log()["total"] == 300

    # --full-refresh recomputes every row, and asks the workers again (no cache).
    sim.reset()
    r = cli("job", "run", path, "--data-dir", data, "--full-refresh", "--quiet")
    assert r.returncode == 0, r.stderr
    assert re.search(r"rows\s+300\s+\(computed 300, reused 0", r.stdout)
    assert sim.log()["total"] == 300


def test_a_complete_run_removes_its_journal_unless_asked_to_keep_it(sim, tmp_path):
    """A daily job kept every run's journal, about ten times its outputs (892 MB at 400,000
    rows). The same run id given again still answers from the records, asking nothing."""
    data = tmp_path / "data"
    path = variant(QA_JOB, tmp_path, "qa_tidy", rows=questions(30))
    r = cli("job", "run", path, "--data-dir", data)
    assert r.returncode == 0, r.stderr
    assert "removed the run's work folder" in r.stderr
    (run_dir,) = (data / "runs").iterdir()
    assert not (run_dir / "work").exists() and (run_dir / "records.parquet").exists()
    sim.reset()
    again = run_job(load_job(path), data_dir=data, run_id=run_dir.name, progress=False)
    assert again["run_id"] == run_dir.name and again["valid"] == 30 and sim.log()["total"] == 0
    assert again["cost_usd"] > 0  # what the run paid, as it was

    kept = variant(QA_JOB, tmp_path, "qa_kept", rows=questions(30))
    r = cli("job", "run", kept, "--data-dir", data, "--keep-work", "--quiet")
    assert r.returncode == 0, r.stderr
    (kept_dir,) = data.glob("runs/qa_kept-*")
    assert (kept_dir / "work" / "steps.jsonl").exists()


def test_a_damaged_manifest_of_an_earlier_run_stops_the_job_clearly(sim, tmp_path):
    """The next run reads earlier runs' manifests to find records to reuse: a damaged one ended
    `conductor job run` in a traceback. Skipping it could pay for those rows again unseen."""
    data = tmp_path / "data"
    path = variant(QA_JOB, tmp_path, "qa_damaged", rows=questions(10))
    first = run_job(load_job(path), data_dir=data, progress=False)
    manifest = data / "runs" / first["run_id"] / "manifest.json"
    manifest.write_text('{"run_id": "cut sh')
    sim.reset()
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{manifest} is damaged (not JSON" in r.stderr and "move the run folder out of" in r.stderr, r.stderr
    assert sim.log()["total"] == 0  # nothing paid again


def test_a_second_run_of_the_same_job_is_refused_while_the_first_runs(sim, tmp_path):
    """Two runs of one job on one data folder would both compute, and pay for, the same rows."""
    import os
    import subprocess
    import sys
    import time

    # 400 rows at 4 s each (under the pool's 5 s timeout) keep the first run going for about 50 s
    # while the second starts (its start-up alone takes seconds on a busy machine); the rest of
    # the answers come at once after.
    sim.set_faults(latency_ms=4000, latency_sd_ms=0)
    path = variant(QA_JOB, tmp_path, "qa_twice", rows=questions(400))
    data = tmp_path / "data"
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "CONDUCTOR_SIM_URL": sim.url}
    first = subprocess.Popen([sys.executable, "-m", "conductor", "job", "run", str(path), "--data-dir", str(data),
                              "--quiet"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while sim.log()["total"] < 4 and first.poll() is None:
        time.sleep(0.05)
    second = cli("job", "run", path, "--data-dir", data, "--quiet")
    sim.clear_faults()
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, out + err
    assert second.returncode == 2 and f"already running in process {first.pid}" in second.stderr, second.stderr
    assert sim.log()["total"] == 400  # each row asked once


def test_the_catalog_view_follows_a_changed_field_type(sim, tmp_path):
    """A field whose type changes (a list of spans becoming one string) recomputes every
    row; the job's view then reads only the runs of the new definition, not a column that
    is a list in one file and text in the next."""
    data = tmp_path / "data"
    path = variant(QA_JOB, tmp_path, "qa_typed", rows=questions(5))
    assert run_job(load_job(path), data_dir=data, progress=False)["computed"] == 5
    doc = yaml.safe_load(path.read_text())
    doc["fields"]["answer"]["type"] = "string"
    doc["references"]["answer"] = {"column": "answer_json", "score": "f1"}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert run_job(load_job(path), data_dir=data, progress=False)["computed"] == 5
    r = cli("sql", "SELECT typeof(answer) AS t, count(*) AS n FROM qa_typed GROUP BY ALL", "--data-dir", data,
                "--format", "csv")
    assert r.returncode == 0 and r.stdout.split() == ["t,n", "VARCHAR,5"], r.stdout + r.stderr


def test_a_run_id_that_is_a_path_is_refused_before_anything_is_written(sim, tmp_path):
    path = variant(QA_JOB, tmp_path, "qa_path", rows=questions(3))
    r = cli("job", "run", path, "--data-dir", tmp_path / "data", "--run-id", "../x", "--quiet")
    assert r.returncode == 2 and "--run-id '../x': use up to 128 letters, digits" in r.stderr
    assert not (tmp_path / "data" / "x").exists() and sim.log()["total"] == 0
    # it was told to use '.', which it does
    r = cli("job", "run", path, "--data-dir", tmp_path / "data", "--run-id", ".hidden", "--quiet")
    assert r.returncode == 2 and "not starting with '.'" in r.stderr, r.stderr


def test_a_run_id_given_again_for_a_changed_job_is_refused(sim, tmp_path):
    """Resuming a run replays its journal: under a changed template those answers are not
    this job's, so the run id is refused instead of reused at $0."""
    data = tmp_path / "data"
    path = variant(QA_JOB, tmp_path, "qa_named", rows=questions(5))
    r = cli("job", "run", path, "--data-dir", data, "--run-id", "daily", "--quiet")
    assert r.returncode == 0, r.stderr
    doc = yaml.safe_load(path.read_text())
    doc["prompt"] = doc["prompt"].replace("You are a financial analyst.", "You are a careful financial analyst.")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    sim.reset()
    r = cli("job", "run", path, "--data-dir", data, "--run-id", "daily", "--quiet")
    assert r.returncode == 2 and "run daily already exists" in r.stderr and "another definition" in r.stderr
    assert sim.log()["total"] == 0
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 0 and sim.log()["total"] == 5, r.stdout + r.stderr  # a new run asks again


# ---- modes and checks ------------------------------------------------------------

def test_planned_documents_job_gives_confidence_from_agreement(sim, tmp_path):
    docs = pq.read_table(FINANCE / "documents.parquet").slice(0, 40)
    s = run_job(load_job(variant(DOCS_JOB, tmp_path, "docs_small", rows=docs)), data_dir=tmp_path / "data",
                progress=False)
    rec = pq.read_table(s["records_path"])
    assert rec.num_rows == 40 and s["valid"] >= 36
    assert rec.schema.field("largest_item").type == pa.struct(
        [("name", pa.string()), ("latest", pa.float64()), ("prior", pa.float64())])
    assert rec.schema.field("periods").type == pa.list_(pa.string())
    ok = pc.filter(rec, pc.equal(rec.column("status"), "ok"))
    conf = ok.column("main_change_confidence").to_pylist()
    # Two extractors witness the reconciler's value: the share of them that gave it, 0, 1/2 or 1.
    assert all(c is not None for c in conf) and set(conf) <= {0.0, 0.5, 1.0} and len(set(conf)) > 1
    m = s["metrics"]
    assert "overall" not in m and m["fields"]["summary"]["mean_confidence"] is not None
    assert m["valid_share"] == s["valid"] / 40
    # No references: the job's judge scored every valid record, through the executor (its own run).
    judged = ok.column("judge_score").to_pylist()
    assert all(j is not None and 0 <= j <= 1 for j in judged) and all(ok.column("judge_reason").to_pylist())
    assert m["judge"]["judged_rows"] == ok.num_rows and s["judge_cost_usd"] > 0
    jtraces = pq.read_table(tmp_path / "data" / "runs" / f"{s['run_id']}-judge" / "traces.parquet")
    assert set(jtraces.column("worker").to_pylist()) == {"mid"} and jtraces.num_rows >= ok.num_rows
    assert rec.schema.field("n_questions").type == pa.int64()  # a carried column keeps its type
    # Complete: neither run's journal is kept (nothing reads it again)
    assert not (tmp_path / "data" / "runs" / s["run_id"] / "work").exists()
    assert not (tmp_path / "data" / "runs" / f"{s['run_id']}-judge" / "work").exists()


def test_a_budget_that_stops_the_judge_exits_3_and_a_rerun_judges_the_rest(sim, tmp_path):
    """budget_usd caps the job, judge included (the judge spends what extraction left);
    records the budget left unjudged are judged by the next run, which reuses them."""
    docs = pq.read_table(FINANCE / "documents.parquet").slice(0, 12)
    # Extraction by a free worker, one call at a time; the judge (mid) is paid.
    pool = yaml.safe_load((REPO / "data" / "pools" / "sim.yaml").read_text())
    for provider in pool["providers"].values():
        provider["max_concurrency"] = 1
    for w in pool["workers"]:
        if w["id"] == "small":
            w["price"] = {"input_per_mtok": 0, "output_per_mtok": 0}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    job = {"pool": str(tmp_path / "pool.yaml"), "mode": "direct", "worker": "small", "planner": None}
    (tmp_path / "free").mkdir()
    free = run_job(load_job(variant(DOCS_JOB, tmp_path / "free", "docs_judged", rows=docs, **job)),
                   data_dir=tmp_path / "free" / "data", progress=False)
    assert free["cost_usd"] == 0 and free["judge_cost_usd"] > 0
    budget = free["judge_cost_usd"] / 2
    path = variant(DOCS_JOB, tmp_path, "docs_judged", rows=docs, budget_usd=budget, **job)
    data = tmp_path / "data"
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 3 and "left unjudged by the budget" in r.stderr, r.stdout + r.stderr
    assert "Raise it and rerun" not in r.stdout  # the advice is on stderr; stdout holds the summary only
    first = orjson.loads(next(data.glob("runs/docs_judged-*/summary.json")).read_bytes())
    assert first["judge_budget_exhausted"] > 0 and first["cost_usd"] + first["judge_cost_usd"] <= budget + 1e-12
    doc = yaml.safe_load(path.read_text())
    doc["budget_usd"] = 1.0
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    sim.reset()
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    rec = pq.read_table(max(data.glob("runs/docs_judged-*/records.parquet"), key=lambda p: p.parent.name))
    ok = pc.filter(rec, pc.equal(rec.column("status"), "ok"))
    assert ok.num_rows and all(j is not None for j in ok.column("judge_score").to_pylist())
    assert sim.log()["by_model"] == {"sim-mid": first["judge_budget_exhausted"]}  # only the unjudged asked


def test_full_refresh_asks_the_judge_again_too(sim, tmp_path):
    """--full-refresh re-asked the extractor but took every judge answer from the cache at $0."""
    docs = pq.read_table(FINANCE / "documents.parquet").slice(0, 5)
    job = {"mode": "direct", "worker": "small", "planner": None}
    path = variant(DOCS_JOB, tmp_path, "docs_refreshed", rows=docs, **job)
    data = tmp_path / "data"
    first = run_job(load_job(path), data_dir=data, progress=False)
    judged = first["metrics"]["judge"]["judged_rows"]
    assert judged and sim.log()["by_model"]["sim-mid"] == judged
    sim.reset()
    again = run_job(load_job(path), data_dir=data, full_refresh=True, progress=False)
    assert sim.log()["by_model"] == {"sim-small": 5, "sim-mid": again["metrics"]["judge"]["judged_rows"]}
    assert again["judge_cost_usd"] > 0


def test_prompt_mode_asks_for_json_in_the_prompt(sim, tmp_path):
    job = load_job(variant(QA_JOB, tmp_path, "qa_prompt", rows=questions(40), structured="prompt"))
    s = run_job(job, data_dir=tmp_path / "data", progress=False)
    assert s["valid"] == 40 and sim.log()["total"] == 40
    assert sim.log()["by_kind"] == {"record": 40}  # the sim read the schema from the prompt's block
    # The rows serve the RL export like any run: one rollout per row, rewarded by the row's score.
    r = cli("export", "--run", s["run_id"], "--data-dir", tmp_path / "data", "--format", "trl",
                "--out", tmp_path / "export")
    assert r.returncode == 0, r.stderr
    rollouts = pq.read_table(tmp_path / "export" / "train.parquet")
    rec = pq.read_table(s["records_path"])
    assert rollouts.num_rows == 40 and rollouts.column("task").to_pylist() == ["record"] * 40
    score = dict(zip(rec.column("question_id").to_pylist(), rec.column("score").to_pylist()))
    assert all(score[q] == pytest.approx(w) for q, w in zip(rollouts.column("query_id").to_pylist(),
                                                             rollouts.column("reward").to_pylist()))


def test_prompt_longer_than_context_window_is_refused_before_any_call(sim, tmp_path):
    pool = yaml.safe_load(SIM_POOL.read_text())
    for w in pool["workers"]:
        if w["id"] == "mid":
            w["context_tokens"] = 400
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    path = variant(QA_JOB, tmp_path, "qa_small_window", rows=questions(60))
    doc = yaml.safe_load(path.read_text())
    doc["pool"] = str(tmp_path / "pool.yaml")
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(InputError, match=r"longer than worker mid's context window \(400 tokens\), counting each "
                                         r"rendered prompt plus the fields' JSON Schema block .*: question_id '"):
        run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
    assert sim.log()["total"] == 0 and not (tmp_path / "data" / "runs").exists()
    rows = questions(60)  # integer ids are named as the input holds them, not quoted as text
    rows = rows.set_column(rows.column_names.index("question_id"), "question_id", pa.array(range(1000, 1060)))
    path = variant(QA_JOB, tmp_path, "qa_small_window", rows=rows)
    doc = yaml.safe_load(path.read_text())
    doc["pool"] = str(tmp_path / "pool.yaml")
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(InputError, match=r"context window \(400 tokens\), .*: question_id 10\d\d, 10\d\d"):
        run_job(load_job(path), data_dir=tmp_path / "data", progress=False)


def test_plain_text_job_carries_text(sim, tmp_path):
    doc = yaml.safe_load(QA_JOB.read_text())
    path = variant(QA_JOB, tmp_path, "qa_plain", rows=questions(20))
    plain = yaml.safe_load(path.read_text())
    for k in ("fields", "references"):
        plain.pop(k)
    path.write_text(yaml.safe_dump(plain))
    s = run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
    rec = pq.read_table(s["records_path"])
    assert "text" in rec.column_names and "answer" not in rec.column_names and doc["fields"]
    assert s["valid"] == 20 and all(rec.column("text").to_pylist()) and s["metrics"]["valid_share"] == 1.0


def test_queries_cli_writes_what_direct_mode_sends(tmp_path):
    out = tmp_path / "q.parquet"
    r = cli("job", "queries", QA_JOB, "--out", out)
    assert r.returncode == 0, r.stderr
    q = pq.read_table(out)
    assert q.num_rows == 1668 and set(q.column("task").to_pylist()) == {"record"}
    ref = orjson.loads(q.column("reference")[0].as_py())
    assert set(ref) == {"answer", "scale", "answer_type"} and isinstance(ref["answer"], list)


def test_cli_exits_4_when_valid_share_is_below_the_jobs_floor(sim, tmp_path):
    path = variant(QA_JOB, tmp_path, "qa_broken", rows=questions(20))
    sim.set_faults("*", malformed_json=1.0)  # every reply and every repair is broken
    r = cli("job", "run", path, "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 4, r.stdout + r.stderr
    assert "below the job's quality.min_valid_share 95.0%" in r.stderr
    assert re.search(r"statuses\s+invalid 20", r.stdout)
    assert "rows without a valid record (a rerun retries them):" in r.stdout
    assert re.search(r"\n  \d+ invalid: the repaired reply was still not a valid record: ", r.stdout)
    # The catalog's runs view tells it from a good run: it was `complete` with no exit code (audit47 F4).
    q = cli("sql", "SELECT status, (summary->>'exit_code') AS code, summary->>'failed_share' AS failed "
                "FROM runs WHERE NOT run_id LIKE '%-judge'", "--data-dir", tmp_path / "data", "--format", "csv")
    assert q.returncode == 0, q.stderr
    assert q.stdout.splitlines()[1:] == ["complete,4,1.0"], q.stdout


def test_integer_ids_from_csv_keep_their_type_and_join_back(sim, tmp_path):
    (tmp_path / "notes.csv").write_text("note_id,body\n" + "".join(f"{i},note {i} on revenue of {i}.5 million\n"
                                                                   for i in range(1, 11)))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "notes", "input": {"path": "notes.csv", "id": "note_id"}, "prompt": "Read: {{ body }}",
        "fields": {"amount": {"type": "number"}, "unit": {"type": "enum", "values": ["thousand", "million"]}},
        "pool": str(SIM_POOL), "worker": "small"}))
    s = run_job(load_job(tmp_path / "job.yaml"), data_dir=tmp_path / "data", progress=False)
    rec = pq.read_table(s["records_path"])
    assert rec.schema.field("note_id").type == pa.int64() and s["valid"] == 10
    con = duckdb.connect(str(tmp_path / "data" / "conductor.duckdb"), read_only=True)
    n = con.sql(f"SELECT count(*) FROM notes JOIN read_csv('{tmp_path / 'notes.csv'}') USING (note_id)").fetchone()
    assert n == (10,)
    con.close()


def test_planned_vote_of_three_extractors_combines_records_field_by_field(sim, tmp_path):
    pool = yaml.safe_load(SIM_POOL.read_text())
    pool["workers"].append({"id": "vote", "kind": "function", "function": "vote", "description": "majority vote"})
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    path = variant(QA_JOB, tmp_path, "qa_vote", rows=questions(30), mode="planned", pool=str(tmp_path / "pool.yaml"),
                   planner={"name": "embedded", "policy": "none", "action": "ensemble:budget+small+mid>vote"})
    doc = yaml.safe_load(path.read_text())
    doc.pop("worker")
    path.write_text(yaml.safe_dump(doc))
    s = run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
    assert s["valid"] == 30 and s["calls"] == 90  # three extractors per row; the vote calls no model
    rec = pq.read_table(s["records_path"])
    traces = pq.read_table(Path(s["records_path"]).with_name("traces.parquet")).to_pylist()
    by_plan: dict = {}
    for t in traces:
        by_plan.setdefault(t["query_id"], {})[t["step_path"]] = t
    for r in rec.to_pylist():
        steps = by_plan[r["question_id"]]
        extracted = [orjson.loads(steps[p]["response_text"]) for p in ("0", "1", "2")]
        voted = orjson.loads(steps["3"]["response_text"])
        for field in ("scale", "answer_type"):
            values = [e[field] for e in extracted]
            assert voted[field] == max(values, key=values.count) == r[field]
            # confidence: the share of the three extractors that gave the voted value
            assert r[f"{field}_confidence"] == pytest.approx(values.count(r[field]) / 3)


def test_killed_job_run_resumes_the_same_run_without_asking_twice(sim, tmp_path):
    sim.set_faults(latency_ms=40, latency_sd_ms=5)
    path = variant(QA_JOB, tmp_path, "qa_kill", rows=questions(120))
    data = tmp_path / "data"
    run_dir = kill_when_journaled(["job", "run", path, "--quiet"], data, lines=40)
    assert run_dir is not None, "the run ended before it could be killed"
    journaled = line_count(run_dir / "work" / "steps.jsonl")
    assert not (run_dir / "records.parquet").exists()
    sim.reset()
    s = run_job(load_job(path), data_dir=data, progress=False)
    assert s["run_id"] == run_dir.name and s["rows"] == 120 and s["valid"] == 120
    assert sim.log()["total"] <= 120 - journaled  # answered steps are not asked again
    assert len(list((data / "runs").iterdir())) == 1


def test_a_killed_run_whose_input_changed_is_closed_as_abandoned_with_what_it_paid(sim, tmp_path):
    """The rerun cannot resume it (other rows): it used to stay `executing` for good, and what
    it paid showed in no run (the new run gets those answers from the cache at $0)."""
    sim.set_faults(latency_ms=40, latency_sd_ms=5)
    path = variant(QA_JOB, tmp_path, "qa_moved", rows=questions(120))
    data = tmp_path / "data"
    run_dir = kill_when_journaled(["job", "run", path, "--quiet"], data, lines=40)
    assert run_dir is not None, "the run ended before it could be killed"
    pq.write_table(questions(130), tmp_path / "input.parquet")  # tomorrow's file: ten more rows
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 0, r.stderr
    old = orjson.loads((run_dir / "manifest.json").read_bytes())
    paid = old["summary"]
    assert old["status"] == "abandoned" and paid["calls"] >= 40 and paid["cost_usd"] > 0
    assert paid["superseded_by"] != run_dir.name and f"interrupted run {run_dir.name}: ${paid['cost_usd']:.6f}" in r.stdout
    # The calls the kill lost: sent and never settled, or settled but the kill took their step row
    lines = [orjson.loads(x) for x in (run_dir / "work" / "reservations.jsonl").read_bytes().splitlines()]
    logged = {x.get("request_key") for x in map(orjson.loads, (run_dir / "work" / "steps.jsonl").read_bytes()
                                                  .splitlines()) if x.get("attempts")}
    settled = {x["id"]: x["settled"] for x in lines if "settled" in x}
    in_flight = [settled.get(x["id"], x["usd"]) for x in lines if "key" in x
                 and (x["id"] not in settled or (settled[x["id"]] and x["key"] not in logged))]
    assert paid["lost_in_flight"]["calls"] == len(in_flight)
    assert paid["lost_in_flight"]["reserved_usd"] == pytest.approx(sum(in_flight))
    sql = cli("sql", f"SELECT status, summary->>'cost_usd' AS usd FROM runs WHERE run_id = '{run_dir.name}'",
                  "--data-dir", data, "--format", "csv")
    assert sql.stdout.split()[1].startswith("abandoned,"), sql.stdout + sql.stderr
    again = run_job(load_job(path), data_dir=data, progress=False)  # nothing more to close
    assert again["abandoned_runs"] == [] and again["computed"] == 0


def test_a_killed_batch_run_whose_input_changed_hands_its_batch_to_the_new_run(sim, tmp_path, monkeypatch):
    """A job run killed with a batch in flight, then superseded by tomorrow's file, never
    collected that batch: the provider billed it and the new run submitted those rows again
    (audit 28: $0.158 billed for $0.105 of work). The new run polls the old batch instead."""
    pool = yaml.safe_load(SIM_POOL.read_text())
    for provider in pool["providers"].values():
        provider.update(mode="batch", batch_poll_s=0.2, batch_collect_s=0.3)
    pool_path = tmp_path / "batch-pool.yaml"
    pool_path.write_text(yaml.safe_dump(pool))
    sim.set_faults(batch_delay_s=3.0)
    path = variant(QA_JOB, tmp_path, "qa_batch", rows=questions(40), pool=str(pool_path))
    data = tmp_path / "data"
    run_dir = kill_when_journaled(["job", "run", path, "--quiet"], data, lines=2, journal="work/batches.jsonl")
    assert run_dir is not None, "the run ended before it submitted its batch"
    assert sim.log()["batches_created"] == 1
    pq.write_table(questions(39), tmp_path / "input.parquet")  # tomorrow's file: one row fewer
    # A rerun refused before any call (a bad setting) handed the batch to a run folder that no
    # later rerun finds, which then submitted those rows again (audit51 N1)
    with monkeypatch.context() as m:
        m.setenv("CONDUCTOR_RESERVE_BYTES", "8MB")
        r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 2 and "CONDUCTOR_RESERVE_BYTES" in r.stderr, r.stdout + r.stderr
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 0, r.stderr
    assert re.search(r"valid\s+39 \(100.0%\)", r.stdout), r.stdout
    assert f"interrupted run {run_dir.name}" in r.stdout and "were handed to this run" in r.stdout, r.stdout
    log = sim.log()
    assert log["batches_created"] == 1 and set(log["batch_submissions"].values()) == {1}  # paid once
    assert log["total"] == 0  # and nothing asked online


def test_planned_mode_refuses_rows_a_plan_gives_to_a_worker_too_small_for_them(sim, tmp_path):
    pool = yaml.safe_load(SIM_POOL.read_text())
    for w in pool["workers"]:
        if w["id"] == "budget":
            w["context_tokens"] = 300
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool))
    docs = pq.read_table(FINANCE / "documents.parquet").slice(0, 10)
    path = variant(DOCS_JOB, tmp_path, "docs_window", rows=docs, pool=str(tmp_path / "pool.yaml"))
    with pytest.raises(ConductorError, match=r"worker budget \(300 tokens; the longest about \d+\): doc_id '"):
        run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
    assert sim.log()["total"] == 0
    docs = docs.set_column(docs.column_names.index("doc_id"), "doc_id", pa.array(range(10)))
    path = variant(DOCS_JOB, tmp_path, "docs_window_ints", rows=docs, pool=str(tmp_path / "pool.yaml"))
    with pytest.raises(ConductorError,  # the ids as the input holds them
                       match=r"worker budget \(300 tokens; the longest about \d+\): doc_id \d, \d"):
        run_job(load_job(path), data_dir=tmp_path / "data", progress=False)
    assert sim.log()["total"] == 0
