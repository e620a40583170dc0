"""A run's work folder deleted mid-run, with --store (review41 finding 4): the manifest then
records what the deleted journal paid (spend_of_deleted_work), but the store kept that journal,
and a resume on another machine fetched both and counted the money twice.

Real parts: `conductor run` as a user starts it, the simulated LLM server over HTTP, moto's
S3-compatible server on 127.0.0.1 (the s3 fixture of tests/test_s3_store.py)."""

from __future__ import annotations

import os
import shutil
import signal
from types import SimpleNamespace

import orjson
import pytest

from tests.conftest import PRICE_IN, PRICE_OUT, run_cli
from tests.test_s3_store import SYNC, run_args, s3, slow_pool, start_run, uploaded, wait_for  # noqa: F401

DELETED = "spend_of_deleted_work"


def billed_usd(sim) -> float:
    """What the simulated provider billed, at the pool's prices."""
    return sum(p * PRICE_IN + c * PRICE_OUT for p, c in sim.log()["billed_tokens"].values())


def stored_manifest(objects) -> dict:
    with objects.fs.open_input_stream(objects.path("runs", "s3run", "manifest.json")) as f:
        return orjson.loads(f.read())


def stored_work(objects) -> list[str]:
    sel = objects._pafs.FileSelector(objects.path("runs", "s3run", "work"), recursive=True, allow_not_found=True)
    return sorted(i.base_name for i in objects.fs.get_file_info(sel) if i.type == objects._pafs.FileType.File)


@pytest.mark.slow
def test_a_run_whose_work_folder_was_deleted_resumes_elsewhere_counting_its_spend_once(
        tmp_path, s3, fresh_sim, sample_queries):
    from conductor.execute.shared.objects import ObjectStore

    pool = slow_pool(tmp_path, fresh_sim)
    store = "s3://conductor-test/deleted"
    objects = ObjectStore(store)
    first = start_run(sample_queries, pool, tmp_path / "machine-a", store)
    try:
        wait_for(first, lambda: len(uploaded(objects)) >= 10)  # the store holds a journal with money in it
        shutil.rmtree(tmp_path / "machine-a" / "runs" / "s3run" / "work")
        assert first.wait(timeout=120) == 2
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    err = first.stderr.read()
    assert "was deleted while the run was executing" in err, err
    assert stored_manifest(objects).get(DELETED), stored_manifest(objects)
    assert stored_work(objects) == []  # the deleted journal is gone from the store too
    # Resumed on another machine, as a scheduler retries it: every cent counted once.
    r = run_cli(*run_args(sample_queries, pool, tmp_path / "machine-b", store), env=SYNC)
    assert r.returncode == 0, r.stderr
    q = run_cli("sql", "SELECT status, spent_usd FROM runs", "--store", store, "--format", "json",
                "--data-dir", tmp_path / "elsewhere")
    assert q.returncode == 0, q.stderr
    row = orjson.loads(q.stdout.splitlines()[0])
    assert row["status"] == "complete", row
    assert row["spent_usd"] == pytest.approx(billed_usd(fresh_sim), rel=1e-6), (row, fresh_sim.log()["total"])


def run_dir(root, run_id="gone"):
    return SimpleNamespace(run_id=run_id, path=root / run_id, work=root / run_id / "work",
                           manifest_path=root / run_id / "manifest.json", exists=lambda: (root / run_id).exists())


STEP = {"plan_id": "p0", "step_path": "0", "status": "ok", "response_text": "x", "provider": "sim",
        "cost_usd": 0.25, "attempts": 1, "request_key": "k0"}


def journaled(root):
    """A run on one machine whose journal paid $0.25, uploaded to the store."""
    here = run_dir(root)
    here.work.mkdir(parents=True)
    (here.work / "steps.jsonl").write_bytes(orjson.dumps(STEP) + b"\n")
    (here.work / "plans.jsonl").write_bytes(orjson.dumps({"plan_id": "p0", "status": "ok", "calls": 1}) + b"\n")
    here.manifest_path.write_bytes(orjson.dumps({"run_id": "gone", "status": "executing"}))
    return here


def counted(there) -> float:
    """What a resume from this folder counts as paid: its journal's and the manifest's deleted work's."""
    from conductor.execute.journal import load_state

    spent = sum(load_state(there.work).spent.values()) if (there.work / "steps.jsonl").exists() else 0.0
    return spent + sum((orjson.loads(there.manifest_path.read_bytes()).get(DELETED) or {}).values())


def work_deleted(here):
    """The work folder deleted mid-run: the manifest takes over what its journal paid, as the runner records it."""
    shutil.rmtree(here.work)
    here.manifest_path.write_bytes(orjson.dumps({"run_id": "gone", "status": "failed", DELETED: {"sim": 0.25}}))


class Killed(BaseException):
    """The process, killed mid-upload."""


def upload_killed(store, here, monkeypatch, crash: str) -> None:
    """Push `here`, the process killed `crash`: "before the manifest" (its put), "after the manifest"
    (before the store's copy of the deleted journal is deleted), or "none" (the push ends)."""
    from conductor.execute.shared.objects import ObjectStore

    put = ObjectStore.put

    def put_or_die(self, local, *rel):
        if rel[-1] == "manifest.json":
            raise Killed
        put(self, local, *rel)

    def die(self, *args):
        raise Killed

    with monkeypatch.context() as m:
        if crash == "before the manifest":
            m.setattr(ObjectStore, "put", put_or_die)
        if crash == "after the manifest":
            m.setattr(ObjectStore, "_drop_work", die)
        if crash == "none":
            store.push_run(here)
        else:
            with pytest.raises(Killed):
                store.push_run(here)


@pytest.mark.parametrize("crash", ["none", "after the manifest", "before the manifest"])
def test_a_deleted_journal_is_counted_once_by_a_resume_elsewhere_whenever_its_upload_stops(
        tmp_path, s3, monkeypatch, crash):
    """Its upload is two steps (the manifest that counts the deleted journal, and the journal's
    deletion from the store); a process killed between them must leave the $0.25 counted once."""
    from conductor.execute.shared.objects import ObjectStore

    store = ObjectStore("s3://conductor-test/crash")
    here = journaled(tmp_path / "a")
    store.push_run(here)
    work_deleted(here)
    upload_killed(store, here, monkeypatch, crash)
    there = run_dir(tmp_path / "b")
    assert ObjectStore("s3://conductor-test/crash").pull_run(there)
    assert counted(there) == pytest.approx(0.25)
    # The same holds for the next process that resumes it, from what this one found.
    again = run_dir(tmp_path / "c")
    assert ObjectStore("s3://conductor-test/crash").pull_run(again)
    assert counted(again) == pytest.approx(0.25)


def rerun_journal(here, usd=0.5):
    """The same machine reruns the run: a fresh work folder whose journal paid `usd` more."""
    here.work.mkdir()
    step = {**STEP, "plan_id": "p1", "request_key": "k1", "cost_usd": usd}
    (here.work / "steps.jsonl").write_bytes(orjson.dumps(step) + b"\n")
    (here.work / "plans.jsonl").write_bytes(orjson.dumps({"plan_id": "p1", "status": "ok", "calls": 1}) + b"\n")


@pytest.mark.parametrize("crash", ["after the manifest", "before the manifest"])
def test_a_rerun_here_after_a_killed_upload_keeps_its_journal_for_a_resume_elsewhere(
        tmp_path, s3, monkeypatch, crash):
    """review42 1: the upload that deletes the store's copy of a deleted journal is killed midway; the
    same machine reruns the run (its folder is here: nothing is fetched) and pays $0.50 more in a new
    journal, uploaded; a resume elsewhere must count $0.75, not find the new journal deleted as stale."""
    from conductor.execute.shared.objects import ObjectStore

    store = ObjectStore("s3://conductor-test/rerun")
    here = journaled(tmp_path / "a")
    store.push_run(here)
    work_deleted(here)
    upload_killed(store, here, monkeypatch, crash)
    rerun_journal(here)
    ObjectStore("s3://conductor-test/rerun").push_run(here)  # a new process, as a rerun is
    there = run_dir(tmp_path / "b")
    assert ObjectStore("s3://conductor-test/rerun").pull_run(there)
    assert counted(there) == pytest.approx(0.75)
    assert (there.work / "steps.jsonl").exists()


def test_a_later_journal_is_kept_in_the_store_when_its_work_folder_goes_too(tmp_path, s3):
    """review42 2: the manifest keeps its record of a journal deleted long ago; a later command's journal
    (a rerun of the complete run, whose work folder the user then deleted) is not the one it counts."""
    from conductor.execute.shared.objects import ObjectStore

    store = ObjectStore("s3://conductor-test/later")
    here = journaled(tmp_path / "a")
    store.push_run(here)
    work_deleted(here)
    store.push_run(here)  # the store's copy of the deleted journal goes
    rerun_journal(here)
    here.manifest_path.write_bytes(orjson.dumps({**orjson.loads(here.manifest_path.read_bytes()),
                                                 "status": "executing"}))
    store.push_run(here)
    shutil.rmtree(here.work)
    ObjectStore("s3://conductor-test/later").push_run(here)  # the next command, with no work folder
    there = run_dir(tmp_path / "b")
    assert ObjectStore("s3://conductor-test/later").pull_run(there)
    assert counted(there) == pytest.approx(0.75)


def test_the_store_reads_the_deleted_works_spend_under_the_runners_name():
    """The store names the manifest's key itself (the runner imports it): the two must agree."""
    from conductor import runner
    from conductor.execute.shared.objects import DELETED_WORK_SPEND_KEY

    assert DELETED_WORK_SPEND_KEY == runner.DELETED_WORK_SPEND == DELETED
