"""A machine that still holds an older copy of a run than the store's (fix43b, "stale local copy
wins"): it ran the run, was stopped, and another machine went on with it from the store. Resumed
from its own folder, it paid again for what the other machine had paid, and its uploads put its
older journal and manifest over the store's.

Real parts: `conductor run` as a user starts it, the simulated LLM server over HTTP (whose request
log counts what was paid), and moto's S3-compatible server on 127.0.0.1 (the s3 fixture of
tests/test_s3_store.py)."""

from __future__ import annotations

import os
import signal

import orjson
import pytest

from tests.conftest import run_cli
from tests.test_s3_store import SYNC, run_args, s3, slow_pool, start_run, uploaded, wait_for  # noqa: F401
from tests.test_store_stop42 import run_dir
from tests.test_store_stop43 import stored


@pytest.mark.slow
def test_a_machine_with_an_older_copy_of_the_run_resumes_from_the_stores_newer_one(
        tmp_path, s3, fresh_sim, sample_queries):
    from conductor.execute.shared.objects import ObjectStore

    pool = slow_pool(tmp_path, fresh_sim)
    store = "s3://conductor-test/stale"
    objects = ObjectStore(store)
    a, b = tmp_path / "machine-a", tmp_path / "machine-b"
    first = start_run(sample_queries, pool, a, store)
    try:
        wait_for(first, lambda: len(uploaded(objects)) >= 10)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # preempted; its disk survives
        first.wait()
    a_steps = (a / "runs" / "s3run" / "work" / "steps.jsonl").read_bytes()
    # Machine B, as a scheduler's retry: takes the lapsed lease over and finishes the run from the store.
    r = run_cli(*run_args(sample_queries, pool, b, store), env=SYNC)
    assert r.returncode == 0 and "taking over its lease" in r.stderr, r.stderr
    theirs = {name: stored(objects, "work", name) for name in ("plans.jsonl", "steps.jsonl")}
    assert len(uploaded(objects)) == 60
    fresh_sim.reset()
    # Machine A comes back and runs the same command on its older folder.
    again = run_cli(*run_args(sample_queries, pool, a, store), env=SYNC)
    assert again.returncode == 0, again.stderr
    assert fresh_sim.log()["total"] == 0, "machine A paid again for what machine B had paid"
    for name, body in theirs.items():
        assert stored(objects, "work", name) == body, f"work/{name} on the store was overwritten by the older copy"
    q = run_cli("sql", "SELECT count(*) FILTER (WHERE status = 'ok') AS ok, count(*) AS n FROM results",
                "--store", store, "--format", "json", "--data-dir", tmp_path / "elsewhere")
    assert q.returncode == 0 and orjson.loads(q.stdout.splitlines()[0]) == {"ok": 60, "n": 60}, q.stdout + q.stderr
    # Its own copy is kept aside, out of runs/ (the catalog reads every folder there), and named.
    aside = list((a / "superseded").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith("s3run-"), aside
    assert (aside[0] / "work" / "steps.jsonl").read_bytes() == a_steps
    assert "the store's copy is newer than" in again.stderr and str(aside[0]) in again.stderr, again.stderr


def test_a_folder_that_uploaded_last_is_not_taken_for_an_older_copy(tmp_path, s3):
    """The usual resume on the same machine (its folder ahead of its own last upload, or equal to it)
    keeps the folder; a manifest updated later elsewhere, or recording a journal deleted elsewhere,
    makes the store's copy the newer one."""
    from conductor.execute.shared.objects import ObjectStore

    store = ObjectStore("s3://conductor-test/which")
    here = run_dir(tmp_path / "a")
    here.work.mkdir(parents=True)

    def manifest(updated_at, **more):
        here.manifest_path.write_bytes(orjson.dumps({"run_id": "gone", "updated_at": updated_at, **more}))

    assert store.newer_copy(here) is None  # nothing on the store
    manifest("2026-05-01T10:00:00.000001+00:00")
    (here.work / "steps.jsonl").write_bytes(b'{"plan_id":"p0"}\n{"plan_id":"p1"}\n')
    store.push_run(here)
    assert store.newer_copy(here) is None  # the same copy
    (here.work / "steps.jsonl").write_bytes(b'{"plan_id":"p0"}\n')  # a line dropped here (the README's sed)
    assert store.newer_copy(here) is None
    manifest("2026-05-01T10:00:05+00:00")  # written here after its last upload
    assert store.newer_copy(here) is None
    manifest("2026-05-01T09:00:00+00:00")
    assert "updated at 2026-05-01T10:00:00.000001+00:00, this folder's at 2026-05-01T09:00:00+00:00" in \
        store.newer_copy(here)
    store.put(orjson.dumps({"run_id": "gone", "updated_at": "2026-05-01T08:00:00+00:00",
                            "spend_of_deleted_work": {"sim": 0.25}}), "runs", "gone", "manifest.json")
    assert "spend_of_deleted_work" in store.newer_copy(here)
