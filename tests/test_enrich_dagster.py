"""Enrichment jobs as Dagster assets: a job file materializes through
`materialize` against the simulated pool, with its metadata and checks; a
rematerialized day pays for nothing; a failing schema-validity check blocks
the downstream asset; the code location lists the assets and the schedule."""

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from dagster import AssetKey, DagsterInstance, Definitions, materialize

import conductor.enrich
from assets.enrichment import all_job_assets, job_assets, job_name
from conductor.sim import start_sim
from assets.resources import StorageResource

# slow: enrichment jobs materialized through Dagster
pytestmark = pytest.mark.slow

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


DAY = "2026-11-01"
N = 30
UNITS = ["thousand", "million", "billion"]


def write_job(root: Path, **over) -> Path:
    rows = [{"doc_id": f"d{i}",
             "report": f"Company {i} reported revenue of {100 + i * 3.5} {UNITS[i % 3]} dollars in {2015 + i % 9}, "
                     f"up from the year before, on the strength of its retail stores.",
             "gold_amount": 100 + i * 3.5, "gold_unit": UNITS[i % 3]} for i in range(N)]
    pq.write_table(pa.Table.from_pylist(rows), root / "docs.parquet")
    doc = {
        "name": "revenue_facts",
        "description": "revenue, its unit and year from a short report",
        "input": {"path": "docs.parquet", "id": "doc_id", "carry": ["report"]},
        "prompt": "Read the report and extract the figures.\n\nReport: {{ report }}",
        "fields": {"summary": {"type": "string", "description": "one sentence"},
                   "amount": {"type": "number", "required": True},
                   "unit": {"type": "enum", "values": UNITS, "required": True},
                   "year": {"type": "integer"}},
        "references": {"amount": {"column": "gold_amount", "score": "numeric", "rel_tol": 0.001},
                       "unit": {"column": "gold_unit", "score": "exact"}},
        "pool": "pool.yaml", "mode": "direct", "worker": "ext", "budget_usd": 1.0,
        "quality": {"min_valid_share": 0.9},
        **over,
    }
    path = root / "revenue_facts.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def write_pool(root: Path, url: str) -> Path:
    doc = {"providers": {"sim": {"max_concurrency": 16, "timeout_s": 10}},
           "workers": [{"id": "ext", "model": "openai/ext", "provider": "sim", "api_base": url,
                        "description": "simulated extractor", "params": {"temperature": 0, "max_tokens": 512},
                        "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
                        "simulate": {"skill": {"record": 0.8}}}]}
    path = root / "pool.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture
def job_sim(tmp_path):
    """A job file, and the sim started on the job's own rendered queries."""
    write_pool(tmp_path, "http://127.0.0.1:9/v1")  # the sim's address is not known yet
    job_path = write_job(tmp_path)
    queries = tmp_path / "queries.parquet"
    pq.write_table(conductor.enrich.render_queries(conductor.enrich.load_job(job_path)), queries)
    with start_sim(tmp_path / "pool.yaml", queries, latency_ms=0) as sim:
        write_pool(tmp_path, sim.url)
        yield job_path, sim


def run(job_path: Path, data: Path, instance, **kw):
    assets, checks = job_assets(job_path)
    return materialize([*assets, *checks], partition_key=DAY, instance=instance,
                       resources={"storage": StorageResource(data_dir=str(data))}, **kw)


def test_job_asset_materializes_with_metadata_and_checks_and_a_rerun_pays_nothing(tmp_path, job_sim):
    job_path, sim = job_sim
    data = tmp_path / "data"
    with DagsterInstance.ephemeral() as inst:
        result = run(job_path, data, inst)
        assert result.success
        mats = {e.asset_key.to_user_string(): e.materialization.metadata
                for e in result.get_asset_materialization_events()}
        assert set(mats) == {"enrich/revenue_facts/records", "enrich/revenue_facts/published"}
        md = mats["enrich/revenue_facts/records"]
        assert md["dagster/row_count"].value == md["rows"].value == N
        assert md["computed"].value == N and md["reused"].value == 0
        assert md["cost_usd"].value > 0
        assert md["preview"].value.startswith("| doc_id | status")
        assert md["run_id"].value.startswith("revenue_facts")
        records_path = Path(md["records_path"].value)
        assert records_path.exists()
        assert set(md["null_share"].value) == {"summary", "amount", "unit", "year"}
        assert md["null_share"].value["amount"] == 0.0  # required
        assert 0 < md["null_share"].value["year"] < 0.5  # optional: the sim leaves a few out
        # the sim answers with skill 0.8 per referenced field: accuracy shows per field
        acc = {r.split("|")[1].strip(): r.split("|")[3].strip() for r in md["fields"].value.splitlines()[2:]}
        assert 0.6 <= float(acc["amount"]) <= 0.95 and 0.6 <= float(acc["unit"]) <= 0.95 and acc["year"] in ("", "-")
        t = pq.read_table(records_path)
        assert t.schema.field("amount").type == pa.float64() and t.schema.field("year").type == pa.int64()
        evals = {e.check_name: e for e in result.get_asset_check_evaluations()}
        assert set(evals) == {"schema_valid_share", "unique_ids", "no_budget_stop"}
        assert all(e.passed for e in evals.values())
        assert evals["schema_valid_share"].metadata["valid_share"].value == 1.0
        published = pq.read_table(mats["enrich/revenue_facts/published"]["published_path"].value)
        assert published.num_rows == N and len(set(published.column("doc_id").to_pylist())) == N
        assert sim.log()["total"] == N

        # The same day again: every row is reused at $0, nothing is sent.
        sim.reset()
        again = run(job_path, data, inst)
        assert again.success
        md2 = {e.asset_key.to_user_string(): e.materialization.metadata
               for e in again.get_asset_materialization_events()}["enrich/revenue_facts/records"]
        assert md2["reused"].value == N and md2["computed"].value == 0 and md2["cost_usd"].value == 0
        assert sim.log()["total"] == 0
        assert inst.get_latest_materialization_event(AssetKey(["enrich", "revenue_facts", "published"]))


def test_failing_schema_validity_check_blocks_the_downstream_asset(tmp_path, job_sim):
    job_path, sim = job_sim
    sim.set_faults("*", malformed_json=1.0)  # every reply and every repair is broken
    with DagsterInstance.ephemeral() as inst:
        result = run(job_path, tmp_path / "data", inst, raise_on_error=False)
    assert not result.success
    done = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    assert done == {"enrich/revenue_facts/records"}
    failed = {e.check_name: e for e in result.get_asset_check_evaluations() if not e.passed}
    assert set(failed) == {"schema_valid_share"}
    assert failed["schema_valid_share"].metadata["valid_share"].value == 0.0
    assert not (tmp_path / "data" / "enrichment" / "revenue_facts.parquet").exists()


def test_a_budget_stopped_job_fails_until_a_rerun_with_room_finishes_it(tmp_path, job_sim):
    """`conductor job run` exits 3 there; the Dagster run must not go green and publish a
    day with rows missing. The budget stops 1 to 3 rows of 30, so the schema-valid share (0.9)
    alone would let the run through."""
    job_path, sim = job_sim
    doc = yaml.safe_load(job_path.read_text())
    job_path.write_text(yaml.safe_dump({**doc, "budget_usd": 0.0066}, sort_keys=False))
    with DagsterInstance.ephemeral() as inst:
        result = run(job_path, tmp_path / "data", inst, raise_on_error=False)
        assert not result.success
        mats = {e.asset_key.to_user_string(): e.materialization.metadata
                for e in result.get_asset_materialization_events()}
        assert set(mats) == {"enrich/revenue_facts/records"}  # kept, but not published
        stopped = mats["enrich/revenue_facts/records"]["statuses"].value["budget_exhausted"]
        assert 0 < stopped <= 3
        assert all(e.passed for e in result.get_asset_check_evaluations() if e.check_name != "no_budget_stop")
        [check] = [e for e in result.get_asset_check_evaluations() if e.check_name == "no_budget_stop"]
        assert not check.passed and check.metadata["budget_exhausted"].value == stopped
        assert check.description.startswith(f"{stopped} row(s) stopped by a budget: the run is unfinished")
        assert "finished rows are not paid again" in check.description
        assert not (tmp_path / "data" / "enrichment" / "revenue_facts.parquet").exists()

        sent = sim.log()["total"]
        job_path.write_text(yaml.safe_dump({**doc, "budget_usd": 1.0}, sort_keys=False))
        finished = run(job_path, tmp_path / "data", inst)
        assert all(e.passed for e in finished.get_asset_check_evaluations())
        assert sim.log()["total"] - sent == stopped  # only the stopped rows were sent
    assert pq.read_table(tmp_path / "data" / "enrichment" / "revenue_facts.parquet").num_rows == N


def test_records_metadata_shows_what_the_judge_spent(tmp_path, job_sim):
    """The judge is a run of its own: a day whose judge paid for every record showed cost 0 and 0 calls
    when extraction was reused (audit42)."""
    job_path, sim = job_sim
    doc = yaml.safe_load(job_path.read_text())
    job_path.write_text(yaml.safe_dump({**doc, "references": {}, "quality": {
        "min_valid_share": 0.9, "judge": {"worker": "ext", "rubric": "every field must be in the report"}}},
        sort_keys=False))
    with DagsterInstance.ephemeral() as inst:
        result = run(job_path, tmp_path / "data", inst)
    md = {e.asset_key.to_user_string(): e.materialization.metadata
          for e in result.get_asset_materialization_events()}["enrich/revenue_facts/records"]
    judge_calls = sim.log()["total"] - N
    assert judge_calls == N and md["judge_cost_usd"].value > 0 and md["judge_budget_exhausted"].value == 0


def test_threshold_above_one_share_fails_the_check_though_every_record_is_valid(tmp_path, job_sim):
    """quality.min_valid_share is the job's; a share the run cannot reach blocks publishing."""
    job_path, sim = job_sim
    doc = yaml.safe_load(job_path.read_text())
    doc["quality"]["min_valid_share"] = 1.0
    job_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    sim.set_faults("*", malformed_json=0.5)
    with DagsterInstance.ephemeral() as inst:
        result = run(job_path, tmp_path / "data", inst, raise_on_error=False)
    evals = {e.check_name: e for e in result.get_asset_check_evaluations()}
    share = evals["schema_valid_share"].metadata["valid_share"].value
    # half the replies break, and a quarter of those break again on repair
    assert 0.6 < share < 1.0 and not evals["schema_valid_share"].passed
    assert "enrich/revenue_facts/published" not in {e.asset_key.to_user_string()
                                                    for e in result.get_asset_materialization_events()}


def test_code_location_has_a_group_per_job_file_and_a_daily_schedule(tmp_path):
    from pipelines import jobs, schedules

    folder = tmp_path / "jobs"
    folder.mkdir()
    (folder / "a.yaml").write_text("name: alpha_facts\n")
    (folder / "b.yaml").write_text("name: [not a name\n")  # broken: still an asset, fails when run
    assets, checks = all_job_assets(folder)
    keys = {k.to_user_string() for a in assets for k in a.keys}
    assert keys == {"enrich/alpha_facts/records", "enrich/alpha_facts/published",
                    "enrich/b/records", "enrich/b/published"}
    assert job_name(folder / "b.yaml") == "b"
    defs = Definitions(assets=assets, asset_checks=checks, jobs=[jobs.enrich_jobs],
                       schedules=[schedules.daily_enrich_jobs({"CONDUCTOR_ENRICH_JOBS_HOUR": "5"})],
                       resources={"storage": StorageResource(data_dir=str(tmp_path))})
    graph = defs.resolve_asset_graph()
    blocking = {(k.asset_key.to_user_string(), k.name) for k in graph.asset_check_keys}
    assert ("enrich/alpha_facts/records", "schema_valid_share") in blocking
    for a in checks:
        assert all(s.blocking for s in a.check_specs)
    assert defs.resolve_schedule_def("daily_enrich_jobs").cron_schedule == "0 5 * * *"
    assert defs.resolve_job_def("enrich_jobs").partitions_def.get_cron_schedule() == "0 0 * * *"
    # the repository's own job files are in the code location
    from pipelines.definitions import defs as repo_defs

    repo_jobs = {job_name(p) for p in Path(__file__).parents[1].joinpath("jobs").glob("*.yaml")}
    repo_keys = {k.to_user_string() for k in repo_defs.resolve_asset_graph().get_all_asset_keys()}
    assert {f"enrich/{n}/records" for n in repo_jobs} <= repo_keys


def test_a_mistyped_jobs_dir_is_logged_not_silent(tmp_path, caplog, monkeypatch):
    typo = tmp_path / "jbos"
    with caplog.at_level("WARNING", logger="assets.enrichment"):
        assert all_job_assets(env={"CONDUCTOR_JOBS_DIR": str(typo)}) == ([], [])
    [record] = caplog.records
    assert f"CONDUCTOR_JOBS_DIR={typo}: no folder {typo}" in record.getMessage()
    assert "no enrich_jobs job" in record.getMessage()
    caplog.clear()
    typo.mkdir()
    with caplog.at_level("WARNING", logger="assets.enrichment"):
        all_job_assets(env={"CONDUCTOR_JOBS_DIR": str(typo)})
    assert f"no job files (*.yaml, *.yml) in {typo}" in caplog.records[0].getMessage()
    caplog.clear()
    monkeypatch.chdir(tmp_path)  # no jobs/ here: the default folder may be absent without a word
    with caplog.at_level("WARNING", logger="assets.enrichment"):
        assert all_job_assets(env={}) == ([], [])
    assert not caplog.records


# ---- the jobs folder as it really is: stray, broken and non-job YAML files (audit50 F13, F14) ------------

def test_the_code_location_loads_with_unreadable_job_files_and_leaves_out_a_pool_file(tmp_path):
    """One job file that cannot be read (not UTF-8, a date PyYAML cannot build, nesting too deep, a name
    that is no Dagster name, a symlink loop) stopped every pipeline asset from loading; each must get its own asset instead.
    A pool file kept beside the jobs (`pool: pool.yaml`) made assets that could only fail: it makes none,
    and the location's log says why."""
    import subprocess
    import sys

    folder = tmp_path / "jobs"
    folder.mkdir()
    write_pool(folder, "http://127.0.0.1:9/v1")
    write_job(folder)
    (folder / "e_nonutf.yaml").write_bytes(b"name: \xe9\n")
    (folder / "bad_date.yaml").write_text("name: bad_date\ndescription: 2026-13-45\n")
    (folder / "deep.yaml").write_text("name: deep\nfields: " + "[" * 3000 + "]" * 3000 + "\n")
    (folder / "newline.yaml").write_text('name: "abc\\n"\n')
    (folder / "loop.yaml").symlink_to("loop.yaml")  # a symlink loop, and one to a file since removed
    (folder / "dangling.yaml").symlink_to("removed.yaml")
    code = ("from pipelines.definitions import defs\n"
            "for k in sorted(k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()):\n"
            "    print(k)\n")
    env = {**os.environ, "CONDUCTOR_JOBS_DIR": str(folder), "DAGSTER_HOME": str(tmp_path / "home"),
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    (tmp_path / "home").mkdir()
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=Path(__file__).parents[1], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    keys = {k for k in out.stdout.split() if k.startswith("enrich/")}
    assert keys == {f"enrich/{n}/{a}" for n in ("revenue_facts", "e_nonutf", "bad_date", "deep", "newline",
                                                                 "loop", "dangling")
                    for a in ("records", "published")}
    assert "run_report" in out.stdout.split()  # the rest of the location is there too
    assert (f"{folder / 'pool.yaml'} is left out of the enrichment jobs: a pool file, not a job file: it has "
            "workers and providers and none of the keys a job file must have (name, input, prompt, pool)") in out.stderr


def test_a_non_utf8_job_file_fails_its_own_asset_naming_the_file(tmp_path):
    folder = tmp_path / "jobs"
    folder.mkdir()
    bad = folder / "e_nonutf.yaml"
    bad.write_bytes(b"name: \xe9\n")
    assets, checks = all_job_assets(folder)
    [records] = [a for a in assets if a.key == AssetKey(["enrich", "e_nonutf", "records"])]
    with DagsterInstance.ephemeral() as inst:
        result = materialize([*assets, *checks], partition_key=DAY, instance=inst, raise_on_error=False,
                             selection=[records.key],
                             resources={"storage": StorageResource(data_dir=str(tmp_path / "data"))})
    assert not result.success
    [failed] = result.get_step_failure_events()
    error = failed.step_failure_data.error
    # a clean Failure with the loader's message, not a UnicodeDecodeError traceback
    assert error.cls_name == "Failure" and failed.step_failure_data.user_failure_data is not None
    assert f"job file {bad.resolve()}: cannot read it (not UTF-8 text)" in error.message


def test_a_pool_file_makes_no_asset_but_a_broken_job_file_does_and_fails_naming_it(tmp_path, caplog):
    """Only a file that is clearly not a job (a pool key, none of a job's required keys) is left out:
    a job file with mistakes, even one with a pool key in it, keeps its asset, which fails with the
    file, key and line."""
    from pipelines import jobs

    folder = tmp_path / "jobs"
    folder.mkdir()
    write_pool(folder, "http://127.0.0.1:9/v1")
    doc = yaml.safe_load(write_job(folder).read_text())
    mixed = folder / "mixed.yaml"  # a job with the pool pasted into it: a broken job, not a pool
    mixed.write_text(yaml.safe_dump({**doc, "name": "mixed_up", "workers": [{"id": "ext"}]}, sort_keys=False))
    (folder / "notes.yaml").write_text("providers: {}\nprompt: hello\n")  # a job's key: may be a job
    with caplog.at_level("WARNING", logger="assets.enrichment"):
        assets, checks = all_job_assets(folder)
    keys = {k.to_user_string() for a in assets for k in a.keys}
    assert keys == {f"enrich/{n}/{a}" for n in ("revenue_facts", "mixed_up", "notes")
                    for a in ("records", "published")}
    [left_out] = caplog.records
    assert left_out.getMessage() == (f"{folder / 'pool.yaml'} is left out of the enrichment jobs: a pool file, "
                                     "not a job file: it has workers and providers and none of the keys a job "
                                     "file must have (name, input, prompt, pool)")
    defs = Definitions(assets=assets, asset_checks=checks, jobs=[jobs.enrich_jobs],
                       resources={"storage": StorageResource(data_dir=str(tmp_path / "data"))})
    graph_keys = {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    assert not any(k.startswith("enrich/pool/") for k in graph_keys)
    with DagsterInstance.ephemeral() as inst:
        result = materialize([*assets, *checks], partition_key=DAY, instance=inst, raise_on_error=False,
                             selection=[AssetKey(["enrich", "mixed_up", "records"])],
                             resources={"storage": StorageResource(data_dir=str(tmp_path / "data"))})
    [failed] = result.get_step_failure_events()
    assert failed.step_failure_data.error.cls_name == "Failure"
    line = mixed.read_text().splitlines().index("workers:") + 1
    assert f"job file {mixed.resolve()}:{line}: workers: unknown key" in failed.step_failure_data.error.message

    # a CONDUCTOR_JOBS_DIR holding only a pool file has no jobs: said so, as for an empty folder
    only_pool = tmp_path / "pools_only"
    only_pool.mkdir()
    write_pool(only_pool, "http://127.0.0.1:9/v1")
    caplog.clear()
    with caplog.at_level("WARNING", logger="assets.enrichment"):
        assert all_job_assets(env={"CONDUCTOR_JOBS_DIR": str(only_pool)}) == ([], [])
    assert [r.getMessage().split(": ", 1)[0] for r in caplog.records] == [
        f"{only_pool / 'pool.yaml'} is left out of the enrichment jobs", f"CONDUCTOR_JOBS_DIR={only_pool}"]
    assert (f"no job files (*.yaml, *.yml) in {only_pool.resolve()} (pool.yaml left out: not job files), so there are "
            "no enrichment job assets") in caplog.records[1].getMessage()

    # the job file's required keys, as assets/enrichment.py knows them, are still job keys
    import assets.enrichment
    from conductor.enrich.job import TOP_KEYS

    assert set(assets.enrichment.JOB_REQUIRED_KEYS) <= set(TOP_KEYS)
