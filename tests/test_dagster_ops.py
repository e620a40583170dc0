"""Operating the Dagster front end: the inbox sensor, each asset check passing
and failing on real run outputs, the per-provider concurrency pools, the
instance configuration (retries, pools, storage), and the Kubernetes
configuration files of docs/scaling.md."""

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml
from dagster import asset, build_sensor_context, materialize

from conductor import runner
from conductor.pool import parse_pool
from conductor.queries import file_digest
from assets import checks
from assets.concurrency import hold_pools, planner_pools, provider_pools
from pipelines.definitions import defs
from assets.resources import ChecksResource, QueryFilesResource
from pipelines.sensors import query_set_inbox
from tests.conftest import REPO, write_pool
from tests.test_dagster import INSTANCE_YAML, instance  # noqa: F401  (the shared instance fixture)

# slow: Dagster runs, sensors and concurrent processes
pytestmark = pytest.mark.slow

DEPLOY = REPO / "deploy"


# ---- the inbox sensor ---------------------------------------------------------

@pytest.fixture
def folders(tmp_path) -> QueryFilesResource:
    files = QueryFilesResource(inbox=str(tmp_path / "inbox"), store=str(tmp_path / "store"),
                               rejected=str(tmp_path / "rejected"), settle_seconds=0)
    Path(files.inbox).mkdir()
    return files


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def tick(instance, files: QueryFilesResource, log: Records | None = None):
    context = build_sensor_context(instance=instance, resources={"query_files": files})
    if log is not None:
        context.log.addHandler(log)  # what the UI shows as the tick's log
    return query_set_inbox(context)


def test_sensor_adds_a_partition_and_requests_a_run_for_a_new_file(instance, folders, sample_queries):
    dropped = Path(folders.inbox) / "arith-2024.parquet"
    shutil.copy(sample_queries, dropped)
    digest = file_digest(dropped)

    result = tick(instance, folders)
    assert [r.partition_keys for r in result.dynamic_partitions_requests] == [["arith-2024"]]
    assert [(r.partition_key, r.run_key) for r in result.run_requests] == [("arith-2024", f"arith-2024:{digest[:16]}")]
    assert result.run_requests[0].job_name in (None, "run_query_set")
    stored = Path(folders.store) / "arith-2024.parquet"
    assert file_digest(stored) == digest and not dropped.exists()
    assert folders.path_for("arith-2024") == stored

    # Once the daemon has added the partition, a later tick finds nothing new.
    instance.add_dynamic_partitions("query_sets", ["arith-2024"])
    again = tick(instance, folders)
    assert again.run_requests == [] and again.dynamic_partitions_requests == []


def test_sensor_rejects_bad_files_with_the_reason_and_loses_nothing(instance, folders, sample_queries):
    inbox = Path(folders.inbox)
    pq.write_table(pq.read_table(sample_queries).drop_columns(["prompt"]), inbox / "no_prompt.parquet")
    (inbox / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    (inbox / "queries.csv").write_text("query_id,prompt\nq1,hi\n")
    shutil.copy(sample_queries, inbox / "bad name!.parquet")
    originals = {p.name: p.read_bytes() for p in inbox.iterdir()}

    log = Records()
    result = tick(instance, folders, log)
    assert result.run_requests == [] and result.dynamic_partitions_requests == []
    assert list(inbox.iterdir()) == []
    rejected = Path(folders.rejected)
    for name, data in originals.items():  # every file moved intact, its reason beside it
        assert (rejected / name).read_bytes() == data, name
        assert (rejected / f"{name}.reason.txt").read_text().strip(), name
    assert "column 'prompt' is missing" in (rejected / "no_prompt.parquet.reason.txt").read_text()
    assert "not a readable Parquet file" in (rejected / "broken.parquet.reason.txt").read_text()
    assert "Parquet files named <key>.parquet" in (rejected / "queries.csv.reason.txt").read_text()
    assert "cannot be a partition key" in (rejected / "bad name!.parquet.reason.txt").read_text()
    warnings = [line for line in log.lines if line.startswith("WARNING rejected ")]
    assert len(warnings) == 4 and any("no_prompt.parquet" in w and "'prompt' is missing" in w for w in warnings)
    assert not Path(folders.store).exists() or not list(Path(folders.store).iterdir())


def test_sensor_refuses_to_replace_a_query_set_and_keeps_both_files(instance, folders, sample_queries, tmp_path):
    first = Path(folders.inbox) / "daily.parquet"
    shutil.copy(sample_queries, first)
    tick(instance, folders)
    instance.add_dynamic_partitions("query_sets", ["daily"])
    changed = pq.read_table(sample_queries).slice(0, 10)
    pq.write_table(changed, Path(folders.inbox) / "daily.parquet")
    newer = (Path(folders.inbox) / "daily.parquet").read_bytes()

    result = tick(instance, folders)
    assert result.run_requests == []
    assert file_digest(Path(folders.store) / "daily.parquet") == file_digest(sample_queries)
    assert (Path(folders.rejected) / "daily.parquet").read_bytes() == newer
    assert "already exists with other content" in (Path(folders.rejected) / "daily.parquet.reason.txt").read_text()


def test_sensor_waits_for_files_still_being_written(instance, folders, sample_queries):
    slow = QueryFilesResource(inbox=folders.inbox, store=folders.store, rejected=folders.rejected, settle_seconds=3600)
    shutil.copy(sample_queries, Path(slow.inbox) / "fresh.parquet")
    (Path(slow.inbox) / ".fresh2.parquet.tmp").write_bytes(b"partial")
    result = tick(instance, slow)
    assert result.run_requests == [] and result.dynamic_partitions_requests == []
    assert (Path(slow.inbox) / "fresh.parquet").exists() and not Path(slow.rejected).exists()


def test_sensor_picks_up_a_stored_file_whose_partition_was_never_added(instance, folders, sample_queries):
    Path(folders.store).mkdir()
    shutil.copy(sample_queries, Path(folders.store) / "orphan.parquet")
    result = tick(instance, folders)
    assert [r.partition_keys for r in result.dynamic_partitions_requests] == [["orphan"]]
    assert [r.partition_key for r in result.run_requests] == ["orphan"]


# ---- asset checks, each passing and failing -------------------------------------

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, sim, sample_queries):
    """One real run against the simulated pool; tests copy and alter it."""
    sim.clear_faults()  # an earlier test of this worker may have left some (a refusal rate failed every plan)
    root = tmp_path_factory.mktemp("checked")
    pool = write_pool(root / "pool.yaml", sim.url, providers={"sim": {"max_concurrency": 32, "budget_usd": 5.0}})
    cfg = runner.RunConfig(queries=sample_queries, pool=pool, data_dir=root / "data", run_id="checked",
                           samples=2, progress=False)
    runner.run_all(cfg)
    return cfg


@pytest.fixture
def run_copy(finished_run, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(Path(finished_run.data_dir) / "runs" / "checked", data / "runs" / "checked")
    cfg = runner.RunConfig(queries=finished_run.queries, pool=finished_run.pool, data_dir=data, run_id="checked",
                           samples=2, progress=False)
    return cfg, data / "runs" / "checked"


def alter(path: Path, fn) -> None:
    t = pq.read_table(path)
    pq.write_table(fn(t).cast(t.schema), path)


def duplicate_first_row(t: pa.Table) -> pa.Table:
    return pa.concat_tables([t, t.slice(0, 1)])


def test_valid_plan_share_check(run_copy):
    cfg, run = run_copy
    ok = checks.plans_valid_share(plans=cfg, checks=ChecksResource(min_valid_share=0.9))
    assert ok.passed and ok.metadata["valid_share"].value == 1.0

    def invalidate_a_quarter(t):
        valid = [i % 4 != 0 for i in range(t.num_rows)]
        return t.set_column(t.schema.get_field_index("valid"), "valid", pa.array(valid))
    alter(run / "plans.parquet", invalidate_a_quarter)
    bad = checks.plans_valid_share(plans=cfg, checks=ChecksResource(min_valid_share=0.9))
    assert not bad.passed and bad.metadata["valid_share"].value == pytest.approx(0.75)
    assert checks.plans_valid_share(plans=cfg, checks=ChecksResource(min_valid_share=0.7)).passed


@pytest.mark.parametrize("table,check", [("plans", checks.plans_unique_ids), ("rewards", checks.rewards_unique_ids),
                                          ("results", checks.executions_unique_ids),
                                          ("traces", checks.executions_unique_ids)])
def test_unique_ids_checks(run_copy, table, check):
    cfg, run = run_copy
    assert check(cfg).passed
    alter(run / f"{table}.parquet", duplicate_first_row)
    bad = check(cfg)
    assert not bad.passed and "1 duplicate" in bad.description


def test_every_plan_has_a_result_or_status_check(run_copy):
    cfg, run = run_copy
    ok = checks.executions_complete(cfg)
    assert ok.passed and ok.metadata["plans"].value == 120
    alter(run / "results.parquet", lambda t: t.slice(1))
    missing = checks.executions_complete(cfg)
    assert not missing.passed and "1 plan(s) without a result" in missing.description

    def ok_without_answer(t):
        status = t.column("status").to_pylist()
        first_ok = status.index("ok")
        answers = t.column("final_answer").to_pylist()
        answers[first_ok] = None
        return t.set_column(t.schema.get_field_index("final_answer"), "final_answer", pa.array(answers, pa.string()))
    alter(run / "results.parquet", ok_without_answer)
    silent = checks.executions_complete(cfg)
    assert not silent.passed and "1 result(s) with neither an answer nor a failure status" in silent.description

    alter(run / "results.parquet", lambda t: t.set_column(
        t.schema.get_field_index("status"), "status", pa.array([None] * t.num_rows, pa.string())))
    no_status = checks.executions_complete(cfg)
    assert not no_status.passed and "119 result(s) with neither an answer nor a failure status" in no_status.description


def test_spend_within_budget_check(run_copy):
    cfg, run = run_copy
    spent = pc.sum(pq.read_table(run / "results.parquet").column("cost_usd")).as_py()
    assert spent > 0
    ok = checks.executions_spend(cfg, checks=ChecksResource())
    assert ok.passed and "provider sim budget_usd" in ok.metadata["caps"].value

    run_cap = runner.RunConfig(**{**cfg.__dict__, "budget_usd": spent / 2})
    over = checks.executions_spend(run_cap, checks=ChecksResource())
    assert not over.passed and "run budget_usd" in over.description
    capped = checks.executions_spend(cfg, checks=ChecksResource(max_run_usd=spent * 0.9))
    assert not capped.passed and "checks max_run_usd" in capped.description


def test_budget_stop_check_fails_with_the_count_and_how_to_finish(run_copy):
    cfg, run = run_copy
    ok = checks.executions_budget_stop(cfg)
    assert ok.passed and ok.description == "no plan of 120 stopped by a budget"

    def stop_three(t):
        status = t.column("status").to_pylist()
        return t.set_column(t.schema.get_field_index("status"), "status",
                            pa.array(["budget_exhausted"] * 3 + status[3:], pa.string()))
    alter(run / "results.parquet", stop_three)
    stopped = checks.executions_budget_stop(cfg)
    assert not stopped.passed and stopped.severity.value == "ERROR" and stopped.metadata["budget_exhausted"].value == 3
    assert stopped.description.startswith("3 of 120 plans stopped by a budget (budget_exhausted); to finish them, "
                                          "raise the run's budget_usd")
    assert checks.executions_failed_share(cfg).passed  # a budget stop is not a failure


def test_checks_are_attached_and_blocking_where_bad_output_must_not_flow():
    specs = {(k.asset_key.to_user_string(), k.name): d for d in checks.ALL for k in d.check_keys}
    blocking = {key for key, d in specs.items() if all(s.blocking for s in d.check_specs)}
    assert blocking == {("plans", "valid_plan_share"), ("plans", "unique_ids"), ("executions", "unique_ids"),
                        ("executions", "every_plan_has_result"), ("executions", "failed_share"),
                        ("executions", "no_budget_stop"), ("rewards", "unique_ids")}
    assert ("executions", "spend_within_budget") in set(specs)
    graph_checks = {(k.asset_key.to_user_string(), k.name) for k in defs.resolve_asset_graph().asset_check_keys}
    assert set(specs) <= graph_checks


# ---- concurrency pools ----------------------------------------------------------

def test_pools_are_one_per_provider_of_the_pool_file():
    pool = parse_pool({"providers": {"openai": {}, "local-vllm": {}},
                       "workers": [{"id": "a", "model": "openai/gpt-x", "provider": "openai"},
                                   {"id": "b", "model": "openai/gpt-y", "provider": "openai"},
                                   {"id": "c", "model": "hosted_vllm/m", "provider": "local-vllm"},
                                   {"id": "vote", "kind": "function"}]})
    assert provider_pools(pool) == ["provider-local-vllm", "provider-openai"]
    assert planner_pools("embedded", {}, pool) == [] and planner_pools("vllm", {"model": "/m"}, pool) == ["planner-vllm"]
    # An LLM planner shares the pool of the provider it calls with the workers on it.
    assert planner_pools("llm", {"model": "openai/gpt-x"}, pool) == ["provider-openai"]
    assert planner_pools("llm", {"model": "hosted_vllm/m", "provider": "local-vllm"}, pool) == ["provider-local-vllm"]
    planner_pool = parse_pool({"workers": [{"id": "p", "kind": "planner", "model": "x/y", "provider": "openai"},
                                           {"id": "a", "model": "openai/gpt-x", "provider": "openai"}]})
    assert planner_pools("llm", {"worker": "p"}, planner_pool) == ["provider-openai"]


def test_llm_calling_assets_are_tagged_as_holding_provider_pools():
    graph = defs.resolve_asset_graph()
    tagged = {k.to_user_string() for k in graph.get_all_asset_keys()
              if graph.get(k).tags.get("conductor/pools") == "provider"}
    # and each enrichment job's records asset (assets/enrichment.py), one per job file
    assert {k for k in tagged if not (k.startswith("enrich/") and k.endswith("/records"))} == {"plans", "executions"}


# A run in its own process, as the daemon launches them: it waits for a "go"
# file, then holds its pools for HOLD_S seconds and writes when it held them.
POOLED_RUN = """
import json, sys, time
from pathlib import Path
from dagster import DagsterInstance, asset, materialize
from assets.concurrency import hold_pools

pools, out, go = sys.argv[1].split(","), Path(sys.argv[2]), Path(sys.argv[3])

@asset
def pooled(context):
    with hold_pools(context, pools, poll_s=0.1) as held:
        start = time.time()
        time.sleep(1.0)
        out.write_text(json.dumps([start, time.time(), held]))

out.with_suffix(".ready").touch()
while not go.exists():
    time.sleep(0.05)
with DagsterInstance.get() as instance:
    assert materialize([pooled], instance=instance).success
"""


def start_runs(tmp_path, pools_per_run: list[str]):
    script = tmp_path / "pooled_run.py"
    script.write_text(POOLED_RUN)
    go = tmp_path / "go"
    procs, outs = [], []
    for i, pools in enumerate(pools_per_run):
        outs.append(tmp_path / f"run{i}.json")
        procs.append(subprocess.Popen([sys.executable, str(script), pools, str(outs[-1]), str(go)], cwd=REPO,
                                      env={**os.environ, "PYTHONPATH": str(REPO)}))
    deadline = time.monotonic() + 60
    while not all(o.with_suffix(".ready").exists() for o in outs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "runs did not start"
        time.sleep(0.05)
    return procs, outs, go


def finish(procs, outs):
    for p in procs:
        assert p.wait(60) == 0
    return [json.loads(o.read_text()) for o in outs]


def test_parallel_runs_sharing_a_provider_take_turns(instance, tmp_path):
    procs, outs, go = start_runs(tmp_path, ["provider-x,provider-y", "provider-y,provider-x"])
    go.touch()  # both reach their pools at the same moment
    (a0, a1, held_a), (b0, b1, held_b) = finish(procs, outs)
    assert held_a == held_b == ["provider-x", "provider-y"]
    assert b0 >= a1 or a0 >= b1  # never both inside the shared providers' pools at once
    for name in ("provider-x", "provider-y"):
        info = instance.event_log_storage.get_concurrency_info(name)
        assert info.slot_count == 1 and not info.claimed_slots and not info.pending_steps


def test_a_step_waits_while_its_provider_pool_is_full_and_other_providers_go_on(instance, tmp_path):
    storage = instance.event_log_storage
    storage.set_concurrency_slots("provider-x", 1)
    assert storage.claim_concurrency_slot("provider-x", "other-run", "executions").is_claimed
    procs, outs, go = start_runs(tmp_path, ["provider-x", "provider-z"])
    go.touch()
    assert procs[1].wait(60) == 0 and json.loads(outs[1].read_text())[2] == ["provider-z"]
    deadline = time.monotonic() + 30
    while not storage.get_concurrency_info("provider-x").pending_steps:  # queued behind the other run
        assert time.monotonic() < deadline and procs[0].poll() is None
        time.sleep(0.1)
    time.sleep(0.5)
    assert not outs[0].exists() and procs[0].poll() is None
    freed = time.time()
    storage.free_concurrency_slots_for_run("other-run")
    [(start, _, held)] = finish(procs[:1], outs[:1])
    assert held == ["provider-x"] and start >= freed


# A run in its own process that takes provider-x and holds it until killed.
HOLDING_RUN = """
import sys, time
from pathlib import Path
from dagster import DagsterInstance, asset, materialize
from assets.concurrency import hold_pools

@asset
def holder(context):
    with hold_pools(context, ["provider-x"], poll_s=0.1):
        Path(sys.argv[1] + ".tmp").write_text(context.run.run_id)
        Path(sys.argv[1] + ".tmp").rename(sys.argv[1])  # the test never reads it half-written
        time.sleep(600)

with DagsterInstance.get() as instance:
    materialize([holder], instance=instance)
"""


def start_holding_run(tmp_path, pool: str = "provider-x") -> tuple[subprocess.Popen, str]:
    """A run in its own process holding `pool` until killed: (its process, its run id)."""
    script, held = tmp_path / f"{pool}.py", tmp_path / f"{pool}.txt"
    script.write_text(HOLDING_RUN.replace("provider-x", pool))
    proc = subprocess.Popen([sys.executable, str(script), str(held)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 60
    while not held.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the holding run did not start"
        time.sleep(0.05)
    return proc, held.read_text()


def test_a_slot_held_by_a_killed_run_is_freed_by_the_next_run(instance, tmp_path):
    """kill -9 leaves the run STARTED and its slot claimed; the next run to wait for
    the pool sees the holder's process is gone, frees the slot and goes on."""
    proc, dead = start_holding_run(tmp_path)
    proc.kill()
    proc.wait(30)
    assert instance.get_run_by_id(dead).status.value == "STARTED"
    assert [s.run_id for s in instance.event_log_storage.get_concurrency_info("provider-x").claimed_slots] == [dead]

    @asset
    def next_run(context):
        with hold_pools(context, ["provider-x"], poll_s=0.1) as pools:
            return pools

    result = materialize([next_run], instance=instance)
    assert result.success and result.output_for_node("next_run") == ["provider-x"]
    logs = [e.user_message for e in instance.all_logs(result.run_id) if not e.is_dagster_event]
    assert any(f"freed the slots of run {dead} in pool provider-x" in m for m in logs), logs
    assert not instance.event_log_storage.get_concurrency_info("provider-x").claimed_slots


def test_a_run_whose_worker_died_is_failed_by_the_sensor_and_a_live_one_is_left(instance, tmp_path):
    """With `dagster dev` killed mid-run its runs' workers die with it and the runs stayed
    STARTED for good: never retried, each holding a concurrent-run slot (audit 31)."""
    from pipelines.sensors import dead_runs

    (dead_proc, dead), (alive_proc, alive) = start_holding_run(tmp_path, "provider-dead"), \
        start_holding_run(tmp_path, "provider-alive")
    try:
        dead_proc.kill()
        dead_proc.wait(30)
        assert instance.get_run_by_id(dead).status.value == "STARTED"
        skipped = dead_runs(build_sensor_context(instance=instance))
        assert f"failed 1 run(s) whose worker was gone: {dead}" in skipped.skip_message
        assert instance.get_run_by_id(dead).status.value == "FAILURE"
        assert instance.get_run_by_id(alive).status.value == "STARTED"  # its worker lives
        assert "every STARTED run's worker is alive" in dead_runs(build_sensor_context(instance=instance)).skip_message
    finally:
        alive_proc.kill()
        alive_proc.wait(30)


def test_a_waiting_step_says_how_to_free_a_slot_held_by_a_live_run(instance):
    """A holder that is not a run of this instance is left alone; the message says how to free it."""
    storage = instance.event_log_storage
    storage.set_concurrency_slots("provider-x", 1)
    assert storage.claim_concurrency_slot("provider-x", "other-run", "executions").is_claimed
    lines = []
    ctx = SimpleNamespace(instance=instance, run=SimpleNamespace(run_id="mine"),
                          log=SimpleNamespace(info=lines.append, warning=lines.append),
                          get_step_execution_context=lambda: SimpleNamespace(step=SimpleNamespace(key="executions")))

    def free_later():
        while not lines:
            time.sleep(0.05)
        storage.free_concurrency_slots_for_run("other-run")
    threading.Thread(target=free_later, daemon=True).start()
    with hold_pools(ctx, ["provider-x"], poll_s=0.05) as pools:
        assert pools == ["provider-x"]
    assert lines[0].startswith("waiting for a slot in pool provider-x, held by run(s) other-run")
    assert "Force termination immediately" in lines[0] and "Free all concurrency slots for run" in lines[0]


# A step in its own process claiming a new pool in each round, every process
# at the same instant, as run workers reaching their first call do.
NEW_POOL_CLAIMS = """
import json, sys, time
from pathlib import Path
from types import SimpleNamespace
from dagster import DagsterInstance
from assets.concurrency import hold_pools

index, rounds, go, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
out.with_suffix(".ready").touch()
while not go.exists():
    time.sleep(0.01)
t0, spans = float(go.read_text()), []
with DagsterInstance.get() as instance:
    instance.event_log_storage.get_pool_limits()  # storage opened before the first round
    ctx = SimpleNamespace(instance=instance, run=SimpleNamespace(run_id="run-" + index), log=SimpleNamespace(info=print),
                          get_step_execution_context=lambda: SimpleNamespace(step=SimpleNamespace(key="executions")))
    for r in range(rounds):
        time.sleep(max(0.0, t0 + r - time.time()))
        with hold_pools(ctx, [f"provider-new{r}"], poll_s=0.01):
            began = time.time()
            time.sleep(0.05)
            spans.append([r, began, time.time()])
out.write_text(json.dumps(spans))
"""


def test_steps_claiming_a_new_pool_at_the_same_moment_still_take_turns(instance, tmp_path):
    """Dagster's SQLite storage lets two processes claiming together take the
    same slot, or each create the new pool's slot (this failed in CI); claims
    are serialized (assets.concurrency), so no two steps hold a pool at once."""
    script, go, rounds = tmp_path / "claims.py", tmp_path / "go", 5
    script.write_text(NEW_POOL_CLAIMS)
    outs = [tmp_path / f"claims{i}.json" for i in range(4)]
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(rounds), str(go), str(out)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)
             for i, out in enumerate(outs)]
    deadline = time.monotonic() + 60
    while not all(o.with_suffix(".ready").exists() for o in outs):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "claimers did not start"
        time.sleep(0.05)
    # written whole, then renamed: a claimer polling for the file never reads it half-written
    go.with_suffix(".tmp").write_text(str(time.time() + 3.0))  # every process has opened the instance by then
    go.with_suffix(".tmp").rename(go)
    for p in procs:
        assert p.wait(90) == 0
    spans = [s for o in outs for s in json.loads(o.read_text())]
    for r in range(rounds):
        held = sorted((a, b) for r_, a, b in spans if r_ == r)
        assert len(held) == len(outs)
        assert all(b0 >= a1 for (_, a1), (b0, _) in zip(held, held[1:])), f"two steps held provider-new{r} at once"
        info = instance.event_log_storage.get_concurrency_info(f"provider-new{r}")
        assert info.slot_count == 1 and not info.claimed_slots


def test_executions_retries_and_jobs_carry_retry_tags():
    policy = defs.get_assets_def("executions").op.retry_policy
    assert policy is not None and policy.max_retries >= 2 and policy.delay
    job = defs.resolve_job_def("run_query_set")
    assert job.tags["dagster/max_retries"] == "2"
    assert job.tags["dagster/retry_on_asset_or_op_failure"] == "false"


def test_checked_in_instance_keeps_everything_under_dagster_home(instance, tmp_path):
    home = tmp_path / "dagster_home"
    assert instance.run_retries_enabled and instance.run_retries_max_retries == 2
    assert instance.global_op_concurrency_default_limit == 1
    assert instance.event_log_storage.supports_global_concurrency_limits
    assert yaml.safe_load(INSTANCE_YAML.read_text())["telemetry"] == {"enabled": False}
    assert instance.root_directory == str(home)
    assert (home / "history").is_dir() and (home / "schedules").is_dir()


# ---- the Kubernetes configuration (docs/scaling.md) -----------------------------

def test_k8s_instance_config_validates_against_dagster_and_dagster_k8s(tmp_path):
    from dagster import QueuedRunCoordinator
    from dagster._config import process_config
    from dagster._core.instance.config import dagster_instance_config
    from dagster_k8s import K8sRunLauncher

    shutil.copy(DEPLOY / "dagster.k8s.yaml", tmp_path / "dagster.yaml")
    cfg, _ = dagster_instance_config(str(tmp_path))  # raises on any schema error
    assert "postgres" in cfg["storage"]
    launcher = cfg["run_launcher"]
    assert (launcher["module"], launcher["class"]) == ("dagster_k8s", "K8sRunLauncher")
    checked = process_config(K8sRunLauncher.config_type(), launcher["config"])
    assert checked.success, checked.errors
    assert process_config(QueuedRunCoordinator.config_type(), cfg["run_coordinator"].get("config") or {}).success
    assert cfg["run_retries"]["enabled"] and cfg["concurrency"]["pools"]["default_limit"] == 1

    broken = dict(launcher["config"], job_namespaces="typo")
    assert not process_config(K8sRunLauncher.config_type(), broken).success


def test_k8s_executor_config_loads_as_the_code_locations_executor(tmp_path):
    from dagster_k8s import k8s_job_executor

    from pipelines.executors import executor_from_env

    executor = executor_from_env({"CONDUCTOR_K8S_EXECUTOR": str(DEPLOY / "executor.k8s.yaml")})
    assert executor.executor_creation_fn is k8s_job_executor.executor_creation_fn
    per_step = yaml.safe_load((DEPLOY / "executor.k8s.yaml").read_text())["per_step_k8s_config"]
    assert per_step["plans"]["container_config"]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert executor_from_env({}).name == "in_process"

    bad = tmp_path / "executor.yaml"
    bad.write_text("job_namespace: conductor\nmax_concurent: 4\n")
    with pytest.raises(Exception, match="max_concurent"):
        executor_from_env({"CONDUCTOR_K8S_EXECUTOR": str(bad)})


def test_helm_values_and_vllm_deployment_agree_with_the_instance():
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    instance = yaml.safe_load((DEPLOY / "dagster.k8s.yaml").read_text())
    deployment = values["dagster-user-deployments"]["deployments"][0]
    assert deployment["dagsterApiGrpcArgs"] == ["-m", "pipelines.definitions"]
    workspace = yaml.safe_load((REPO / "workspace.yaml").read_text())
    assert workspace["load_from"][0]["python_module"]["module_name"] == "pipelines.definitions"
    env = {e["name"]: e["value"] for e in deployment["env"]}
    assert env["CONDUCTOR_K8S_EXECUTOR"].endswith("deploy/executor.k8s.yaml")
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert values["concurrency"]["pools"]["defaultLimit"] == instance["concurrency"]["pools"]["default_limit"]
    daemon = values["dagsterDaemon"]
    assert daemon["runRetries"]["maxRetries"] == instance["run_retries"]["max_retries"]
    assert daemon["runRetries"]["retryOnAssetOrOpFailure"] == instance["run_retries"]["retry_on_asset_or_op_failure"]
    assert (values["runLauncher"]["config"]["k8sRunLauncher"]["jobNamespace"]
            == instance["run_launcher"]["config"]["job_namespace"])

    # The governor URL names the Redis that deploy/redis.k8s.yaml runs, which keeps budgets over a restart.
    redis_set, service = yaml.safe_load_all((DEPLOY / "redis.k8s.yaml").read_text())
    assert (redis_set["kind"], service["kind"]) == ("StatefulSet", "Service")
    host = urlsplit(env["CONDUCTOR_GOVERNOR"])
    assert (host.hostname, host.port) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
    redis_args = redis_set["spec"]["template"]["spec"]["containers"][0]["args"]
    assert redis_args[redis_args.index("--appendonly") + 1] == "yes"
    assert redis_args[redis_args.index("--maxmemory-policy") + 1] == "noeviction"

    docs = list(yaml.safe_load_all((DEPLOY / "vllm-planner.k8s.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["Deployment", "Service"]
    container = docs[0]["spec"]["template"]["spec"]["containers"][0]
    args = dict(a.lstrip("-").split("=", 1) for a in container["args"] if "=" in a)
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert int(args["tensor-parallel-size"]) * int(args["data-parallel-size"]) == gpus
