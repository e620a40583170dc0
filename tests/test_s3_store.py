"""Runs kept on an S3-compatible server (moto's, started on 127.0.0.1 by the fixture):
tables written there, `conductor sql` answering from them, a killed worker's run
resumed by another process from what the store holds, and the run's lease there
that refuses a second process on a live run from any machine."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import orjson
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, run_cli, write_pool

moto = pytest.importorskip("moto", reason="moto[server] is not installed (pip install -e '.[test]')")


@pytest.fixture
def s3(monkeypatch):
    from conductor.execute.shared.servers import S3Server

    with S3Server() as server:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        server.create_bucket("conductor-test")  # as an operator does once; conductor creates none
        yield server


def another_holder(run_id: str = "s3run") -> dict:
    """A lease of the run held by another machine for the next hour, as it would write it."""
    now = datetime.now(timezone.utc)
    return {"run_id": run_id, "host": "machine-b", "pid": 4242, "token": "theirs", "started_at": now.isoformat(),
            "renewed_at": now.isoformat(), "expires_at": (now + timedelta(hours=1)).isoformat()}


def run_args(queries, pool, data_dir, store):
    return ["run", queries, "--pool", pool, "--data-dir", data_dir, "--store", store, "--quiet", "--no-cache",
            "--run-id", "s3run"]


SYNC = {"CONDUCTOR_STORE_SYNC_S": "0.5"}  # the journal uploaded and the lease renewed every 0.5 s


def start_run(queries, pool, data_dir, store):
    """A run in the background, as another machine's worker would run it."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", **SYNC}
    return subprocess.Popen([sys.executable, "-m", "conductor", *map(str, run_args(queries, pool, data_dir, store))],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, text=True,
                            # as from a terminal: a suite started in the background ignores SIGINT, and
                            # its children would inherit that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def slow_pool(tmp_path, sim):
    return write_pool(tmp_path / "pool.yaml", sim.url, names=("slow",),
                      providers={"sim": {"max_concurrency": 2, "timeout_s": 10}})


def lease(objects) -> dict | None:
    """The run's lease object on the store, as another machine reads it."""
    if not objects.exists("runs", "s3run", "lease.json"):
        return None
    with objects.fs.open_input_stream(objects.path("runs", "s3run", "lease.json")) as f:
        return orjson.loads(f.read())


def uploaded(objects) -> set[str]:
    """The plans the store's journal calls finished."""
    if not objects.exists("runs", "s3run", "work", "plans.jsonl"):
        return set()
    with objects.fs.open_input_stream(objects.path("runs", "s3run", "work", "plans.jsonl")) as f:
        lines = f.read().splitlines()
    return {orjson.loads(x)["plan_id"] for x in lines if x.endswith(b"}")}


def finished_on_store(store, folder) -> set[str]:
    """The plans a resume from the store counts finished: those its plans.jsonl calls finished and
    its steps.jsonl has the steps of. The two go up one after the other, and the test kills the
    worker as soon as it sees the new plans.jsonl, at times (1 run in 10 on a busy machine) before
    the steps follow: the plans of that last interval then have no steps there and run again, as
    the journal's gap check means them to (counted by plans.jsonl alone: "52 > 48 answers")."""
    from conductor.execute.journal import load_state
    from conductor.execute.shared.objects import ObjectStore
    from conductor.store import RunDir

    run = RunDir(folder, "s3run")
    assert ObjectStore(store).pull_run(run)
    return load_state(run.work).finished


def holding_run(tmp_path, sim, queries, name):
    """(pool, store URL, its objects, the process) of a run on machine-a that holds its lease on
    the store and has uploaded a finished plan."""
    from conductor.execute.shared.objects import ObjectStore

    pool = slow_pool(tmp_path, sim)
    store = f"s3://conductor-test/{name}"
    objects = ObjectStore(store)
    first = start_run(queries, pool, tmp_path / "machine-a", store)
    wait_for(first, lambda: lease(objects) and uploaded(objects))
    return pool, store, objects, first


@contextlib.contextmanager
def paused(proc):
    """The holder stopped while the test writes the lease as another process would. moto checks a
    write's If-Match and then writes, without a lock (S3 does both at once), so a renewal in flight
    could land just after the test's write and undo it; a second is left for one to be answered."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        time.sleep(1.0)
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def visible(what, timeout=10):
    """Held paused until the store shows the test's write, so the holder wakes to find it."""
    deadline = time.monotonic() + timeout
    while not what() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert what(), "the store never showed the test's write"


def wait_for(proc, what, timeout=240):
    deadline = time.monotonic() + timeout
    while not what() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert what(), f"not seen while the run ran (exit {proc.poll()}): {proc.stderr.read() if proc.poll() else ''}"


def test_a_bucket_that_does_not_exist_or_a_bad_endpoint_is_refused(tmp_path, s3, fresh_sim, sample_queries):
    """A mistyped bucket was created and the runs went there, where nobody looks for them."""
    from conductor.execute.shared.objects import ObjectStore

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    r = run_cli(*run_args(sample_queries, pool, tmp_path / "data", "s3://conductor-tset/nightly"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "store s3://conductor-tset/nightly: bucket 'conductor-tset' does not exist" in r.stderr, r.stderr
    assert fresh_sim.log()["total"] == 0
    assert ObjectStore("s3://conductor-test/x").fs.get_file_info("conductor-tset").type.name == "NotFound"
    r = run_cli(*run_args(sample_queries, pool, tmp_path / "data", "s3://conductor-test/nightly"),
                env={"AWS_ENDPOINT_URL": "notaurl"})  # was "GET https:///conductor-test/...: not known"
    assert r.returncode == 2 and "AWS_ENDPOINT_URL='notaurl': expected the URL of an S3-compatible server" in \
        r.stderr, r.stderr


@pytest.mark.slow
def test_a_run_writes_its_tables_to_the_store_and_sql_answers_from_them(tmp_path, s3, fresh_sim, sample_queries):
    from conductor.execute.shared.objects import ObjectStore

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    store = "s3://conductor-test/nightly"
    r = run_cli(*run_args(sample_queries, pool, tmp_path / "machine-a", store))
    assert r.returncode == 0, r.stderr
    files = ObjectStore(store).table_files()
    assert {"plans", "traces", "results", "rewards"} <= set(files), files
    # Answered from the store alone: another machine's empty data folder.
    q = run_cli("sql", "SELECT status, count(*) AS n FROM results GROUP BY ALL", "--store", store,
                "--format", "json", "--data-dir", tmp_path / "elsewhere")
    assert q.returncode == 0, q.stderr
    assert [orjson.loads(line) for line in q.stdout.splitlines()] == [{"status": "ok", "n": 60}]
    q = run_cli("sql", "SELECT run_id, status FROM runs", "--store", store, "--format", "csv")
    assert q.returncode == 0, q.stderr
    assert q.stdout.splitlines()[0] == "run_id,status" and q.stdout.splitlines()[1].startswith("s3run,")


@pytest.mark.slow
def test_a_damaged_object_on_the_store_is_left_out_and_named(tmp_path, s3, fresh_sim, sample_queries):
    """One damaged object made `conductor sql --store` fail for every run."""
    from conductor.execute.shared.objects import ObjectStore

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))
    store = "s3://conductor-test/damaged"
    assert run_cli(*run_args(sample_queries, pool, tmp_path / "machine-a", store)).returncode == 0
    objects = ObjectStore(store)
    bad = tmp_path / "garbage"
    bad.write_bytes(b"not parquet at all")
    objects.put(bad, "runs", "other", "results.parquet")
    bad.write_bytes(b'{"run_id": "oth')
    objects.put(bad, "runs", "other", "manifest.json")
    q = run_cli("sql", "SELECT run_id, count(*) AS n FROM results GROUP BY ALL", "--store", store, "--format", "csv",
                "--data-dir", tmp_path / "elsewhere")
    assert q.returncode == 0 and q.stdout.splitlines() == ["run_id,n", "s3run,60"], q.stdout + q.stderr
    assert "leaves out 2 damaged object(s)" in q.stderr and "other/results.parquet" in q.stderr, q.stderr
    assert "other/manifest.json (not JSON" in q.stderr, q.stderr
    q = run_cli("sql", "SELECT run_id FROM runs", "--store", store, "--format", "csv")
    assert q.returncode == 0 and q.stdout.splitlines() == ["run_id", "s3run"], q.stdout + q.stderr


@pytest.mark.slow
def test_a_killed_workers_run_resumes_on_another_process_from_the_store(tmp_path, s3, fresh_sim, sample_queries):
    from conductor.execute.shared.objects import ObjectStore

    pool = slow_pool(tmp_path, fresh_sim)
    store = "s3://conductor-test/resume"
    first = start_run(sample_queries, pool, tmp_path / "machine-a", store)
    objects = ObjectStore(store)
    wait_for(first, lambda: len(uploaded(objects)) >= 10)
    os.killpg(first.pid, signal.SIGKILL)  # the worker dies mid-run, its disk with it
    first.wait()
    done = finished_on_store(store, tmp_path / "scratch")
    assert done <= uploaded(objects) and len(uploaded(objects)) >= 10 and len(done) < 60, len(done)
    held = lease(objects)  # left behind by the killed worker: it lapses 4 intervals after its last renewal
    assert held["pid"] == first.pid, held
    fresh_sim.reset()
    # Started at once, as a scheduler retries: it watches the lease until it lapses (if it has not
    # already: it lapses 2 s after the kill here), then takes it over.
    r = run_cli(*run_args(sample_queries, pool, tmp_path / "machine-b", store), env=SYNC)
    assert r.returncode == 0, r.stderr
    assert f"taking over its lease, lapsed at {held['expires_at']} (host {held['host']}, process {first.pid})" \
        in r.stderr, r.stderr
    # What the store held was not asked for again (answers uploaded with the run's own cache
    # after the journal was are claimed from it, not asked for either).
    assert 0 < fresh_sim.log()["by_status"].get("200", 0) <= 60 - len(done)
    q = run_cli("sql", "SELECT count(*) FILTER (WHERE status = 'ok') AS ok, count(*) AS n FROM results",
                "--store", store, "--format", "json")
    assert q.returncode == 0, q.stderr
    assert orjson.loads(q.stdout.splitlines()[0]) == {"ok": 60, "n": 60}
    # Released at the end: the same command on a third machine runs at once, and pays nothing.
    assert lease(objects) is None
    fresh_sim.reset()
    again = run_cli(*run_args(sample_queries, pool, tmp_path / "machine-c", store), env=SYNC)
    assert again.returncode == 0 and "taking over" not in again.stderr, again.stderr
    assert fresh_sim.log()["total"] == 0


def test_a_run_stopped_while_planning_resumes_elsewhere_from_the_plan_parts_it_stored(
        tmp_path, s3, fresh_sim, sample_queries):
    """A planning node preempted midway (an hour of a GPU engine's plans) left them on its
    own disk: the machine that resumed the run planned every query again."""
    from conductor import runner
    from tests.test_plan_parts import StoppedAfter

    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, names=("fast",))

    def config(machine):
        return runner.RunConfig(queries=sample_queries, pool=pool, data_dir=tmp_path / machine, run_id="s3run",
                                store="s3://conductor-test/planning", plan_chunk=20, progress=False)

    first = StoppedAfter(runner.configured_planner(config("machine-a")), parts=2)
    with pytest.raises(KeyboardInterrupt):
        runner.run_all(config("machine-a"), planner=first)
    assert first.asked == [(0, 20), (20, 40)] and fresh_sim.log()["total"] == 0

    second = StoppedAfter(runner.configured_planner(config("machine-b")))
    summary = runner.run_all(config("machine-b"), planner=second)
    assert second.asked == [(40, 60)]
    assert summary["statuses"] == {"ok": 60}


@pytest.mark.slow
def test_a_second_process_on_a_live_run_from_another_machine_is_refused_and_pays_nothing(
        tmp_path, s3, fresh_sim, sample_queries):
    """A scheduler's retry of a pod still alive pulled the live run, paid for it all again,
    and the two overwrote each other's objects (audit 28): the local lock sees one folder."""
    from conductor.execute.shared.objects import ObjectStore

    pool = slow_pool(tmp_path, fresh_sim)
    store = "s3://conductor-test/twins"
    objects = ObjectStore(store)
    first = start_run(sample_queries, pool, tmp_path / "machine-a", store)
    wait_for(first, lambda: uploaded(objects))  # a run the second process could resume
    second = run_cli(*run_args(sample_queries, pool, tmp_path / "machine-b", store), env=SYNC)
    held = lease(objects)
    assert first.wait(timeout=300) == 0, first.stderr.read()
    assert second.returncode == 2, second.stderr
    assert (f"run s3run is already running on host {held['host']} in process {first.pid} "
            f"(lease {store}/runs/s3run/lease.json, last renewed ") in second.stderr, second.stderr
    assert "if that process is dead, rerun after the lease expires" in second.stderr
    assert not (tmp_path / "machine-b" / "runs" / "s3run").exists()  # nothing fetched, nothing run
    assert fresh_sim.log()["by_status"].get("200", 0) == 60  # each plan's one call, paid once


@pytest.mark.slow
def test_ctrl_c_releases_the_lease_and_the_run_resumes_at_once_elsewhere(tmp_path, s3, fresh_sim, sample_queries):
    pool, store, objects, first = holding_run(tmp_path, fresh_sim, sample_queries, "interrupted")
    os.kill(first.pid, signal.SIGINT)
    assert first.wait(timeout=120) == 130, first.stderr.read()
    assert lease(objects) is None
    r = run_cli(*run_args(sample_queries, pool, tmp_path / "machine-b", store), env=SYNC)
    assert r.returncode == 0 and "taking over" not in r.stderr, r.stderr


@pytest.mark.slow
def test_a_run_whose_lapsed_lease_was_taken_over_stops_and_leaves_the_store_to_the_new_holder(
        tmp_path, s3, fresh_sim, sample_queries):
    """A process paused past its lease's expiry (or cut off from the store) found its run
    taken over: going on would pay for it twice and overwrite the new holder's objects."""
    _, _, objects, first = holding_run(tmp_path, fresh_sim, sample_queries, "lapsed")  # held, and running
    other = another_holder()
    with paused(first):
        with objects.fs.open_output_stream(objects.path("runs", "s3run", "lease.json")) as out:
            out.write(orjson.dumps(other))
        visible(lambda: lease(objects) == other)
    assert first.wait(timeout=120) == 2
    err = first.stderr.read()
    assert "process 4242 on host machine-b took the run over" in err, err
    assert lease(objects) == other  # theirs, not deleted by the process that lost it


@pytest.mark.slow
def test_a_paused_holder_whose_run_was_taken_over_and_released_stops(tmp_path, s3, fresh_sim, sample_queries):
    """audit49 F1: a process paused past its lease, whose run another process took over, finished
    and released, found no lease when it woke: its renewals failed with a warning, it ran to the end
    (paying calls again) and uploaded its stale run over the other's."""
    _, _, objects, first = holding_run(tmp_path, fresh_sim, sample_queries, "released")
    with paused(first):
        objects.fs.delete_file(objects.path("runs", "s3run", "lease.json"))  # taken over, finished, released
        visible(lambda: lease(objects) is None)
    assert first.wait(timeout=120) == 2
    err = first.stderr.read()
    assert "another process (which has since released it) took the run over" in err, err
    assert lease(objects) is None  # not written again by the process that lost it


@pytest.mark.slow
def test_a_lease_that_is_never_renewed_is_waited_for_and_taken_over(tmp_path, s3, fresh_sim, sample_queries):
    """A scheduler retrying a killed worker at once found the dead holder's lease not yet lapsed
    and was refused; it watches the lease instead, and takes it over once it lapses."""
    from conductor.execute.shared.objects import ObjectStore

    store = "s3://conductor-test/watched"
    objects = ObjectStore(store)
    now = datetime.now(timezone.utc)
    dead = {"run_id": "s3run", "host": "machine-a", "pid": 4242, "token": "killed",
            "started_at": now.isoformat(), "renewed_at": now.isoformat(),
            "expires_at": (now + timedelta(seconds=8)).isoformat()}  # never renewed again
    with objects.fs.open_output_stream(objects.path("runs", "s3run", "lease.json")) as out:
        out.write(orjson.dumps(dead))
    queries = tmp_path / "q.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 4), queries)
    r = run_cli(*run_args(queries, slow_pool(tmp_path, fresh_sim), tmp_path / "machine-b", store), env=SYNC)
    assert r.returncode == 0, r.stderr
    assert "its lease is held by process 4242 on host machine-a" in r.stderr, r.stderr
    assert f"taking over its lease, lapsed at {dead['expires_at']}" in r.stderr, r.stderr
    assert lease(objects) is None  # released at the end


def test_of_two_processes_taking_a_free_or_lapsed_lease_at_once_only_one_wins(s3):
    """Taking was write, wait 1 s, read back: a taker that paused between its read and its
    write for longer than that (a busy node, a GC pause) won too, and both ran the run."""
    from conductor.execute.shared.objects import ObjectStore, RunLease

    objects = ObjectStore("s3://conductor-test/race")
    for lapsed in (None, {"token": "dead", "expires_at": "2026-01-01T00:00:00+00:00"}):
        if lapsed is not None:
            with objects.fs.open_output_stream(objects.path("runs", "s3run", "lease.json")) as out:
                out.write(orjson.dumps(lapsed))
        slow, fast = RunLease(objects, "s3run", interval=30), RunLease(objects, "s3run", interval=30)
        seen = slow._read()  # the slow taker read the lease (absent, or lapsed) ...
        fast.take()  # ... and paused while another process took it
        assert not slow._took(seen)  # plain writes: it wrote its own, waited, read it back and won
        assert lease(objects)["token"] == fast.token
        fast.release()
        assert lease(objects) is None


def test_a_lease_taken_with_plain_writes_is_live_when_taken_at_the_shortest_interval(s3):
    """A plain-write take waits 1 s to read its lease back before the renewals begin; the lease
    lived four intervals from its write, so at CONDUCTOR_STORE_SYNC_S=0.2 it had lapsed by the
    time take() returned, and a second process took the live run over."""
    from conductor.execute.shared.objects import ObjectStore, RunLease

    objects = ObjectStore("s3://conductor-test/settle")
    held = RunLease(objects, "s3run", interval=0.2)
    held._object = None  # plain writes, as without AWS_* credentials
    held.take()
    written = lease(objects)
    lifetime = (datetime.fromisoformat(written["expires_at"]) - datetime.fromisoformat(written["renewed_at"]))
    # Covers the settle and four renewals: measured on the lease itself, since whether a renewal
    # lands in time at 0.2 s depends on how busy the machine is.
    assert lifetime.total_seconds() >= held.settle + 4 * 0.2 - 1e-3


def test_a_holder_that_reads_the_new_holders_lease_cannot_renew_over_it(s3):
    """Two threads share the lease: the journal uploader asks the store whether the lease is still
    ours before each upload, and the renewal thread swaps on the version it last saw. The uploader's
    read of the new holder's lease handed its version to the renewal thread, whose next swap then
    succeeded: a process resumed after a pause wrote its lease over the new holder's (a fresh-clone
    run beside a busy core caught it, both threads waking together)."""
    from conductor.execute.shared.objects import ObjectStore, RunLease

    objects = ObjectStore("s3://conductor-test/swap")
    held = RunLease(objects, "s3run", interval=0.5)
    held.take()
    assert held._object is not None, "conditional writes expected against the test server"
    other = another_holder()
    with objects.fs.open_output_stream(objects.path("runs", "s3run", "lease.json")) as out:
        out.write(orjson.dumps(other))
    assert held._read() == other  # what the uploader's check reads
    assert held._swap(held._etag) is False  # the renewal thread's next swap
    assert lease(objects) == other


def test_the_lease_requests_are_signed_as_aws_signs_them():
    """Conditional writes go out signed by conductor (pyarrow cannot send the conditions):
    the signature must be AWS's own, else a real S3 refuses every lease. botocore signs the
    same requests here."""
    import hashlib

    botocore = pytest.importorskip("botocore.auth")
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from conductor.execute.shared.s3cond import ConditionalObject

    cases = [("http://127.0.0.1:9000", "conductor-test", "nightly/runs/r1/lease.json", None, {"if-none-match": "*"}),
             (None, "my-bucket", "a b/ü/runs/x+y/lease.json", None, {"if-match": '"abc"'}),
             (None, "my-bucket", "runs/r/lease.json", "FQoGZXIvYXdzEXAMPLE", {"if-none-match": "*"})]
    for endpoint, bucket, key, token, condition in cases:
        o = ConditionalObject(bucket, key, "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token,
                              "eu-west-1", endpoint)
        sha = hashlib.sha256(b"{}").hexdigest()
        theirs = AWSRequest(method="PUT", url=f"{o.scheme}://{o.host}{o.path}", data=b"{}",
                            headers={**condition, "x-amz-content-sha256": sha})
        botocore.S3SigV4Auth(Credentials(o.access_key, o.secret_key, token), "s3", o.region).add_auth(theirs)
        stamp = theirs.headers["X-Amz-Date"]
        ours = {"host": o.host, "x-amz-date": stamp, "x-amz-content-sha256": sha, **condition,
                **({"x-amz-security-token": token} if token else {})}
        when = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
        assert o._authorization("PUT", ours, when) == theirs.headers["Authorization"], key


class RegionProxy:
    """moto behind a proxy that answers as S3 does for a bucket in eu-west-1 when the lease's
    own signed requests are signed for another region: 400 AuthorizationHeaderMalformed naming
    the bucket's region, or a 301 PermanentRedirect whose x-amz-bucket-region header is `header`
    (None: names none; a host name: a hostile or broken server's) when `names_region` is False.
    Only the lease's conditional requests come here; pyarrow's (the AWS SDK's, which finds a
    bucket's region itself) go to moto directly."""

    def __init__(self, upstream: str, names_region: bool, header: str | None = None):
        import http.client
        from urllib.parse import urlsplit

        from tests.fakehttp import LoopbackServer, QuietHandler

        self.seen: list[tuple[str, str, int]] = []  # (method, signed-for region, status) of the lease's requests
        proxy, target = self, urlsplit(upstream).netloc

        class Handler(QuietHandler):
            def _any(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                signed = self.headers.get("authorization", "").split("Credential=")[-1].split("/")[2:3]
                if signed != ["eu-west-1"]:
                    if names_region:
                        status, headers = 400, {"x-amz-bucket-region": "eu-west-1"}
                        doc = ("<Error><Code>AuthorizationHeaderMalformed</Code><Message>the region 'us-east-1' "
                               "is wrong; expecting 'eu-west-1'</Message><Region>eu-west-1</Region></Error>")
                    else:
                        status, doc = 301, "<Error><Code>PermanentRedirect</Code></Error>"
                        headers = {} if header is None else {"x-amz-bucket-region": header}
                    proxy.seen.append((self.command, signed[0], status))
                    return self.send(status, doc, headers)
                conn = http.client.HTTPConnection(target, timeout=30)
                conn.request(self.command, self.path, body=body or None, headers=dict(self.headers))
                resp = conn.getresponse()
                data = resp.read()
                proxy.seen.append((self.command, signed[0], resp.status))
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = LoopbackServer(Handler)
        self.url = self.server.root

    def __enter__(self):
        self.server.__enter__()
        return self

    def __exit__(self, *exc):
        self.server.__exit__(*exc)


@pytest.mark.parametrize("names_region, header", [(True, None), (False, None), (False, "evil.example:80/x")],
                         ids=["region-named", "region-not-named", "not-a-region-named"])
def test_the_lease_is_taken_on_a_bucket_in_another_region_without_aws_region(s3, monkeypatch, caplog,
                                                                              names_region, header):
    """Without AWS_REGION the lease's requests are signed for us-east-1; S3 refuses them for a bucket
    elsewhere, and taking the lease failed as a storage error. Where S3 names the bucket's region the
    request is signed again for it (conditional writes kept); where it does not, plain writes. A
    "region" that is not one (it becomes part of the host name) is taken as none named."""
    from conductor.errors import ConductorError
    from conductor.execute.shared.objects import ObjectStore, RunLease

    objects = ObjectStore("s3://conductor-test/regions")
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    with RegionProxy(s3.endpoint, names_region, header) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # read by the lease's own requests only
        held = RunLease(objects, "s3run", interval=2.0).take()
        assert lease(objects)["token"] == held.token
        with held:  # renewed every 2 s: plain writes settle 1 s when taking, and a busy machine must not let it lapse
            with pytest.raises(ConductorError, match="already running"):
                RunLease(objects, "s3run", interval=2.0).take()
        assert lease(objects) is None  # released
    refused = [x for x in proxy.seen if x[2] in (301, 400)]
    if names_region:
        assert refused == [("GET", "us-east-1", 400)] * 2, proxy.seen  # once per process: the region is learnt
        assert ("PUT", "eu-west-1", 200) in proxy.seen  # the lease written with If-None-Match
        assert "conditional writes are refused" not in caplog.text
    else:
        assert refused == [("GET", "us-east-1", 301)] * 2 and "conditional writes are refused (HTTP 301" in caplog.text


def test_an_uploaded_journal_never_holds_a_finished_plan_without_its_steps(tmp_path, s3, monkeypatch):
    """The executor goes on writing while the journal uploads, file after file. Whatever it
    writes between two files' uploads, a plan the store calls finished must have its steps
    there too, or a run resumed elsewhere reports it without them (calls and cost lost)."""
    from types import SimpleNamespace

    from conductor.execute.journal import Journal, load_state
    from conductor.execute.shared.objects import ObjectStore

    def step(plan: str, i: int) -> dict:
        return {"plan_id": plan, "step_path": str(i), "status": "ok", "response_text": f"{plan}/{i}",
                "provider": "sim", "cost_usd": 0.001, "attempts": 1, "request_key": f"{plan}-{i}"}

    def finish(plan: str, steps: int) -> None:  # steps, then the plan: the executor's order
        for i in range(steps):
            journal.step(step(plan, i))
        journal.plan({"plan_id": plan, "status": "ok", "calls": steps})

    run = SimpleNamespace(run_id="snap", path=tmp_path / "a" / "snap", work=tmp_path / "a" / "snap" / "work",
                          manifest_path=tmp_path / "a" / "snap" / "manifest.json")
    journal = Journal(run.work)
    finish("p0", 1)
    put, journal_files = ObjectStore.put, []

    def put_while_running(self, local, *rel):
        put(self, local, *rel)
        if rel[-1].endswith(".jsonl"):
            journal_files.append(rel[-1])
            finish(f"p{len(journal_files)}", 2)  # another plan finishes before the next file goes up

    monkeypatch.setattr(ObjectStore, "put", put_while_running)
    store = ObjectStore("s3://conductor-test/snapshot")
    store.push_run(run)
    journal.close()
    monkeypatch.setattr(ObjectStore, "put", put)
    assert {"plans.jsonl", "steps.jsonl", "reservations.jsonl"} == set(journal_files)
    elsewhere = tmp_path / "b"
    for name in journal_files:
        store.get(elsewhere / name, "runs", "snap", "work", name)
    state = load_state(elsewhere)
    steps = [orjson.loads(x) for x in (elsewhere / "steps.jsonl").read_bytes().splitlines()]
    for plan in state.finished:
        want = 1 if plan == "p0" else 2
        assert sum(1 for r in steps if r["plan_id"] == plan) == want, (plan, state.finished)
    assert "p0" in state.finished


def test_a_bad_store_url_is_refused_with_its_form():
    from conductor.errors import ConductorError
    from conductor.execute.shared.objects import store_url

    with pytest.raises(ConductorError, match="s3://bucket/prefix"):
        store_url("gs://bucket/x")


def test_an_unreachable_store_is_a_storage_error_naming_it(tmp_path, fresh_sim, sample_queries):
    """It was a pyarrow traceback, exit 1."""
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    r = run_cli(*run_args(sample_queries, pool, tmp_path / "data", "s3://runs/dev"), env=env)
    assert r.returncode == 5 and "store s3://runs/dev: cannot look for run s3run" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and fresh_sim.log()["total"] == 0
    sql = run_cli("sql", "SELECT 1", "--store", "s3://runs/dev", env=env)
    assert sql.returncode == 5 and "store s3://runs/dev: cannot reach the bucket" in sql.stderr, sql.stderr
    assert "AWS_ENDPOINT_URL" in sql.stderr and "Traceback" not in sql.stderr


def test_a_run_resumed_from_the_store_gets_its_batch_journal_and_a_lost_store_is_a_storage_error(
        tmp_path, s3, monkeypatch):
    """Without work/batches.jsonl a run resumed on another machine submitted its in-flight
    batches again, paid twice (audit 28). A store lost mid-run exited 2, "bad input"."""
    from types import SimpleNamespace

    from conductor.errors import StorageError
    from conductor.execute.shared.objects import ObjectStore

    def run_dir(root):
        return SimpleNamespace(run_id="batchy", path=root / "batchy", work=root / "batchy" / "work",
                               manifest_path=root / "batchy" / "manifest.json", exists=lambda: (root / "batchy").exists())

    here = run_dir(tmp_path / "a")
    here.work.mkdir(parents=True)
    line = b'{"event": "submitted", "batch_id": "batch_1", "worker": "w"}\n'
    (here.work / "batches.jsonl").write_bytes(line)
    here.manifest_path.write_bytes(b'{"run_id": "batchy", "status": "executing"}')
    store = ObjectStore("s3://conductor-test/batches")
    store.push_run(here)
    there = run_dir(tmp_path / "b")
    assert store.pull_run(there)
    assert (there.work / "batches.jsonl").read_bytes() == line

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(StorageError, match="store s3://conductor-test/batches: cannot"):
        ObjectStore("s3://conductor-test/batches").push_run(here)
