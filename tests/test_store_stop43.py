"""The store after a run's lease was taken over, and what every push of a run does (review42c 1,
review42c 4, fix42k).

Real parts: moto's S3-compatible server on 127.0.0.1 (the s3 fixture of tests/test_s3_store.py), and
for the take-over `conductor run` as a user starts it against the simulated LLM server over HTTP."""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import time

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO
from tests.test_s3_store import another_holder, lease, paused, run_args, s3, slow_pool, visible  # noqa: F401
from tests.test_store_stop42 import counted, journaled, run_dir, work_deleted

SYNC_S = "2"  # the journal uploaded and the lease renewed every 2 s


def start_run(queries, pool, data_dir, store):
    """A run in the background, as another machine's worker would run it."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "CONDUCTOR_STORE_SYNC_S": SYNC_S}
    return subprocess.Popen([sys.executable, "-m", "conductor", *map(str, run_args(queries, pool, data_dir, store))],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def stored(objects, *rel) -> bytes | None:
    if not objects.exists("runs", "s3run", *rel):
        return None
    with objects.fs.open_input_stream(objects.path("runs", "s3run", *rel)) as f:
        return f.read()


def just_uploaded(proc, objects, timeout=240) -> None:
    """Return right after the holder's journal upload changed the store's steps.jsonl: its next
    periodic upload is a sync interval away, so a pause now stops no upload midway (one stopped
    midway would finish after the test's writes, a race of the periodic uploads, not this one's)."""
    before = stored(objects, "work", "steps.jsonl")
    deadline = time.monotonic() + timeout
    while stored(objects, "work", "steps.jsonl") == before:
        assert proc.poll() is None and time.monotonic() < deadline, "the run made no upload"
        time.sleep(0.05)
    time.sleep(0.3)  # the rest of that push: its other objects, the manifest last


THEIRS = {  # the new holder's objects, as it writes them after taking the run over
    ("work", "plans.jsonl"): b'{"plan_id":"theirs","status":"ok"}\n',
    ("work", "steps.jsonl"): b'{"plan_id":"theirs","step_path":"0","cost_usd":0.5}\n',
    ("manifest.json",): b'{"run_id":"s3run","status":"executing","host":"machine-b"}',
}


@pytest.mark.slow
def test_an_interrupted_command_whose_lease_was_taken_over_leaves_the_new_holders_journal(
        tmp_path, s3, fresh_sim, sample_queries):
    """review42c 1: a process paused past its lease while another took the run over wakes, finds the
    lease gone and stops as on Ctrl-C; the last upload of an interrupted command (the whole push,
    34a7bf7) then put its stale journal and manifest over the new holder's, whose resume elsewhere
    lost what it had paid for. The store must keep the new holder's objects as it wrote them."""
    from conductor.execute.shared.objects import ObjectStore

    store = "s3://conductor-test/taken"
    objects = ObjectStore(store)
    first = start_run(sample_queries, slow_pool(tmp_path, fresh_sim), tmp_path / "machine-a", store)
    try:
        just_uploaded(first, objects)
        assert lease(objects) is not None
        other = another_holder()
        with paused(first):
            with objects.fs.open_output_stream(objects.path("runs", "s3run", "lease.json")) as out:
                out.write(orjson.dumps(other))
            for rel, body in THEIRS.items():
                with objects.fs.open_output_stream(objects.path("runs", "s3run", *rel)) as out:
                    out.write(body)
            visible(lambda: lease(objects) == other and all(stored(objects, *r) == b for r, b in THEIRS.items()))
        assert first.wait(timeout=120) == 2
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    err = first.stderr.read()
    assert "process 4242 on host machine-b took the run over" in err, err
    for rel, body in THEIRS.items():
        assert stored(objects, *rel) == body, f"{'/'.join(rel)} was overwritten by the process that lost the run"
    assert lease(objects) == other


def test_every_push_of_a_run_settles_a_deleted_journal(tmp_path, s3):
    """review42c 4: push_run(work=False) uploaded the manifest that counts a journal deleted mid-run
    and left the store's copy of that journal, so a resume elsewhere counted its $0.25 twice. No caller
    passed it; the parameter is gone, so every push settles, and the resume counts the money once."""
    from conductor.execute.shared.objects import ObjectStore

    assert list(inspect.signature(ObjectStore.push_run).parameters) == ["self", "run_dir"]
    store = ObjectStore("s3://conductor-test/settled")
    here = journaled(tmp_path / "a")
    store.push_run(here)
    work_deleted(here)
    store.push_run(here)
    there = run_dir(tmp_path / "b")
    assert ObjectStore("s3://conductor-test/settled").pull_run(there)
    assert counted(there) == pytest.approx(0.25)
    assert not (there.work / "steps.jsonl").exists()


def part(path, run_id, n=4):
    """A plan part of `n` rows naming `run_id` (only the columns the check reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")  # written as planparts are: a new file renamed in place
    pq.write_table(pa.table({"run_id": [run_id] * n, "query_id": [f"q{i}" for i in range(n)],
                             "plan_id": [f"{run_id}-{i}" for i in range(n)]}), tmp)
    os.replace(tmp, path)


def test_a_plan_part_planned_again_under_the_same_name_goes_up_again(tmp_path, s3):
    """A part set aside (damaged, another run's) is planned again under the same name. Sent once by
    name, the store kept the bad part, and a planning node lost after that made a resume elsewhere
    set it aside and plan (pay for) those queries again."""
    from conductor.execute.shared.objects import PLAN_PARTS, ObjectStore

    store = ObjectStore("s3://conductor-test/parts")  # one process: the command that planned again
    here = journaled(tmp_path / "a")
    name = "part-0000000000-0000000004.parquet"
    part(here.work / PLAN_PARTS / name, "another-run")
    store.push_run(here)  # the command's first push: the part as the folder held it
    os.replace(here.work / PLAN_PARTS / name, here.work / PLAN_PARTS / f"{name}.set-aside")
    part(here.work / PLAN_PARTS / name, "gone")  # planned again
    store.push_run(here)
    there = run_dir(tmp_path / "b")
    assert ObjectStore("s3://conductor-test/parts").pull_run(there)
    got = pq.read_table(there.work / PLAN_PARTS / name)
    assert set(got.column("run_id").to_pylist()) == {"gone"}


def test_a_journal_deleted_while_a_push_goes_on_is_counted_once_elsewhere(tmp_path, s3, monkeypatch):
    """The journal upload that began before the work folder went read the manifest at its end, by then
    holding the record of the deleted journal: the store got the record without the stale journal
    being deleted, and the next push, finding the store's record equal to its own, took the run as
    settled. A resume elsewhere counted the $0.25 twice (seen once in the end-to-end test of stop 42,
    the folder deleted during an upload)."""
    from conductor.execute.shared.objects import ObjectStore

    store = ObjectStore("s3://conductor-test/midpush")
    here = journaled(tmp_path / "a")
    store.push_run(here)
    put = ObjectStore.put

    def deleted_meanwhile(self, local, *rel):
        put(self, local, *rel)
        if rel[-1] == "steps.jsonl" and here.work.exists():
            work_deleted(here)  # the runner finds the folder gone and records its spend; this push goes on

    with monkeypatch.context() as m:
        m.setattr(ObjectStore, "put", deleted_meanwhile)
        store.push_run(here)  # the periodic upload, begun before the folder went
    store.push_run(here)  # the command's last upload
    there = run_dir(tmp_path / "b")
    assert ObjectStore("s3://conductor-test/midpush").pull_run(there)
    assert counted(there) == pytest.approx(0.25)
