"""Runs on object storage: `s3://bucket/prefix` through pyarrow's S3 filesystem.

A run still works in a local folder (its journal is appended line by line and
its per-run cache is SQLite, neither of which object storage can do), and the
store holds its copy: the finished tables and manifest after every stage, and
the journal every `interval` seconds while it executes. Every object is written
by one PUT (multipart uploads complete only on close), so a reader sees the
old object or the new one, never half of one. A run that is not in the local
folder is fetched from the store first: a run whose worker was killed resumes
on any other process or machine (calls made after the last journal upload are
served again from the shared response cache, or paid again without one).
A run holds a lease on the store while it runs (RunLease), so a second process
on the same run id, on any machine, refuses instead of paying for it again.

Credentials come from the usual AWS variables (AWS_ACCESS_KEY_ID, ...); an
S3-compatible server other than AWS is named by AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import sqlite3
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from conductor.envsettings import env_number
from conductor.errors import ConductorError, StorageError
from conductor.execute.shared.s3cond import ConditionalObject, Unsupported

log = logging.getLogger("conductor.store")
ENV = "CONDUCTOR_STORE"
TABLE_FILES = ("manifest.json", "plans.parquet", "traces.parquet", "results.parquet", "rewards.parquet",
               "summary.json", "records.parquet")
# The journal in the order it is uploaded, each file a snapshot taken a little later than
# the one before. A plan's line is written after its steps' lines (journal.Journal.flush),
# so plans first: every plan the uploaded plans.jsonl calls finished has its steps in the
# later steps.jsonl. Reservations last: one sent after the steps snapshot is counted as
# spent on resume unless its answer is in the run cache, uploaded after them all.
# batches.jsonl too: without it a run resumed elsewhere submits its in-flight batches again (paid twice)
WORK_FILES = ("plans.jsonl", "steps.jsonl", "reservations.jsonl", "batches.jsonl")
PLAN_PARTS = "plan_parts"  # work/plan_parts/part-*.parquet: plans written as planning goes (conductor.planparts)
ENV_SYNC_S = "CONDUCTOR_STORE_SYNC_S"
LEASE_FILE = "lease.json"  # beside the run's objects: runs/<run id>/lease.json
# Beside the run's objects while its work/ there is stale: the journal of a work folder deleted mid-run,
# whose spend the manifest records (runner.DELETED_WORK_SPEND). It holds that record and names the exact
# objects (path, size, time) of that journal: it speaks only for a manifest that counts them, and
# deletes nothing else (see ObjectStore._settle_deleted_work).
STALE_WORK = "stale_work.json"
DELETED_WORK_SPEND_KEY = "spend_of_deleted_work"  # runner.DELETED_WORK_SPEND: the runner imports this module


def sync_interval() -> float:
    """$CONDUCTOR_STORE_SYNC_S, else 30 s: how often the journal goes up and the lease is renewed.
    Below 0.1 s every run would flood the store with writes; above an hour a killed worker's run
    waits four hours for its lease to lapse."""
    return env_number(None, ENV_SYNC_S, 30.0, "a number of seconds from 0.1 to 3600", lambda s: 0.1 <= s <= 3600)


def store_url(value: str | None) -> str | None:
    url = value or os.environ.get(ENV) or None
    if url is not None and "@" in urlsplit(url).netloc:  # not echoed: it holds credentials
        raise ConductorError("store: an s3:// URL with credentials in it (s3://KEY:SECRET@bucket) is not taken; "
                             "give s3://bucket/prefix and the credentials in AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY")
    if url is not None and (urlsplit(url).query or urlsplit(url).fragment):  # not echoed: ?token=... may be one
        raise ConductorError("store: an s3:// URL with a query or fragment (?... or #...) is not taken, and not shown "
                             "(it may hold a token); give s3://bucket/prefix, with credentials in the AWS_* variables")
    if url is not None and urlsplit(url).scheme != "s3":
        raise ConductorError(f"store {url!r}: must be s3://bucket/prefix (a local folder is --data-dir)")
    return url


class ObjectStore:
    def __init__(self, url: str):
        import pyarrow.fs as pafs

        parts = urlsplit(store_url(url))
        if parts.scheme != "s3" or not parts.netloc:
            raise ConductorError(f"store {url!r}: must be s3://bucket/prefix")
        self.url = url.rstrip("/")
        self.root = f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/")
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
        kw: dict = {"allow_bucket_creation": False}
        if endpoint:
            e = urlsplit(endpoint)
            if e.scheme not in ("http", "https") or not e.hostname:  # else "GET https:///bucket/...: not known"
                from conductor.pool import redact_url

                raise ConductorError(f"AWS_ENDPOINT_URL={redact_url(endpoint)!r}: expected the URL of an "
                                     f"S3-compatible server, http(s)://host[:port]")
            kw.update(endpoint_override=e.netloc, scheme=e.scheme)
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            kw["region"] = region
        self.fs = pafs.S3FileSystem(**kw)
        self._pafs = pafs
        # (run id, plan part) -> (inode, size, mtime_ns) of the local file this process uploaded
        self._parts_sent: dict[tuple[str, str], tuple[int, int, int]] = {}
        self._settled: dict[str, dict] = {}  # run id -> the deleted-work record the store's manifest carries

    def path(self, *rel: str) -> str:
        return "/".join((self.root, *rel))

    def check_bucket(self) -> None:
        """The bucket must exist: creating it would file the runs of a mistyped name under a new
        bucket nobody reads (and, on AWS, bill for it)."""
        bucket = self.root.split("/", 1)[0]
        try:
            missing = self.fs.get_file_info(bucket).type == self._pafs.FileType.NotFound
        except OSError as e:
            raise StorageError(f"store {self.url}: cannot reach the bucket ({e}); check AWS_ENDPOINT_URL, "
                               f"the credentials and the network, then rerun the same command: nothing done "
                               f"so far is lost") from None
        if missing:
            raise ConductorError(f"store {self.url}: bucket {bucket!r} does not exist (or these credentials "
                                 f"cannot see it); create it, or fix the name, then rerun the same command "
                                 f"(conductor creates no bucket)")

    def put(self, local: Path | bytes, *rel: str) -> None:
        """One object, from a local file or bytes, whole or not at all (the upload completes on close)."""
        if isinstance(local, bytes):
            with self.fs.open_output_stream(self.path(*rel)) as out:
                out.write(local)
            return
        with open(local, "rb") as src, self.fs.open_output_stream(self.path(*rel)) as out:
            while chunk := src.read(8 << 20):
                out.write(chunk)

    def get(self, local: Path, *rel: str) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{os.getpid()}.tmp")
        with self.fs.open_input_stream(self.path(*rel)) as src, open(tmp, "wb") as out:
            while chunk := src.read(8 << 20):
                out.write(chunk)
        os.replace(tmp, local)

    def exists(self, *rel: str) -> bool:
        return self.fs.get_file_info(self.path(*rel)).type == self._pafs.FileType.File

    @contextlib.contextmanager
    def _reaching(self, what: str):
        """pyarrow's errors of the store (unreachable, refused, throttled) as a storage error
        naming it, not a traceback; a local disk's errors (with an errno) pass through."""
        try:
            yield
        except OSError as e:
            if e.errno is not None:
                raise
            raise StorageError(f"store {self.url}: cannot {what} ({e}); check AWS_ENDPOINT_URL, the credentials "
                               f"and the network, then rerun the same command: finished work is kept") from None

    def push_run(self, run_dir) -> None:
        """The run's journal, then its tables, then its manifest to the store: a reader that sees
        the manifest's status sees the tables it names. Always the whole push:
        a push of the tables alone would upload a manifest counting a deleted journal without
        deleting the store's copy of it (_settle_deleted_work), which a resume elsewhere counted
        twice."""
        with self._reaching(f"upload run {run_dir.run_id}"):
            self._push_run(run_dir)

    def _push_run(self, run_dir) -> None:
        self.check_bucket()
        # The manifest is read once, here: the one uploaded last is the one whose record of a deleted
        # journal this push settled. Read again at the end, a record written meanwhile (the work folder
        # deleted during a long upload) went up unsettled, the stale journal stayed, and the next push,
        # finding the store's record equal to its own, took the run as settled: counted twice elsewhere.
        manifest = _read_local(run_dir.manifest_path)
        if (covers := _deleted_work_spend(manifest)) is not None:
            self._settle_deleted_work(run_dir, covers, manifest)  # before any work/ goes up
        if run_dir.work.exists():
            self._push_work(run_dir)
        self._push_tables(run_dir, manifest)

    def _push_tables(self, run_dir, manifest: bytes | None) -> None:
        for name in TABLE_FILES[1:]:
            f = run_dir.path / name
            if f.exists():
                self.put(f, "runs", run_dir.run_id, name)
        if manifest is not None:
            self.put(manifest, "runs", run_dir.run_id, "manifest.json")

    def _settle_deleted_work(self, run_dir, covers: dict, manifest: bytes) -> None:
        """The local manifest counts a journal deleted mid-run (`covers`, runner.DELETED_WORK_SPEND), so the
        store's copy of it must go, and only it: a resume elsewhere fetched it and counted its money twice.
        Work/ is uploaded only once the store's manifest carries the local record: while it does not, the
        store's work/ holds journals uploaded before the record was made, which it counts. Steps, and what
        a process killed after each leaves for the next reader (a push here, a pull elsewhere, which both
        finish a pending marker first, by _finish_marker, before they read or upload any work/):
          1. finish a pending marker            -> the marker, some of its objects: finished again
          2. marker naming work/'s objects      -> marker != stored record: voided, work/ kept and
                                                   counted once (the stored manifest does not count it)
          3. tables, then the manifest          -> before the manifest: as 2; after: marker == stored
                                                   record: its objects deleted, and only they
          4. delete the marker's objects        -> as 3 after the manifest
          5. delete the marker                  -> nothing pending
        A later journal (a rerun's) is uploaded after 5, with the stored record equal to the local one:
        no marker is written for it, and no marker names its objects, so none deletes it. A push whose
        manifest has no record looks for no marker: one is written only under a record, which never
        leaves a manifest, and a run fetched from the store had its marker finished by that pull."""
        rid = run_dir.run_id
        if self._settled.get(rid) == covers:
            return
        stored = self._stored_record(rid)
        self._finish_marker(rid, stored)
        if stored != covers:
            objects = self._work_objects(rid)
            if objects:
                self._put_json({DELETED_WORK_SPEND_KEY: covers, "objects": objects}, "runs", rid, STALE_WORK)
            self._push_tables(run_dir, manifest)
            if objects:
                self._drop_work(rid, objects)
        self._settled[rid] = covers

    def _stored_record(self, rid: str):
        """The store's manifest's DELETED_WORK_SPEND (None: none, or no manifest)."""
        import orjson

        if not self.exists("runs", rid, "manifest.json"):
            return None
        with self.fs.open_input_stream(self.path("runs", rid, "manifest.json")) as f:
            try:
                manifest = orjson.loads(f.read())
            except orjson.JSONDecodeError:
                return None
        return (manifest.get(DELETED_WORK_SPEND_KEY) or None) if isinstance(manifest, dict) else None

    def _work_objects(self, rid: str) -> list[list]:
        """[path under runs/<rid>, size, mtime_ns] of each object of the store's work/: the exact
        objects a marker covers (an object written again later differs, and is kept). S3 gives whole
        seconds and pyarrow no ETag, so a same-size object written in the same second would match;
        none is: every push under the record and every fetch finishes a pending marker before it
        touches work/. The one exception, a push from a folder whose manifest never held the record
        (an older copy of the run elsewhere), replaces the store's manifest and journal anyway, and
        comes a lease lapse (ttl > 1 s) after the marker's writer unless that process released it."""
        sel = self._pafs.FileSelector(self.path("runs", rid, "work"), recursive=True, allow_not_found=True)
        cut = len(self.path("runs", rid)) + 1
        return sorted([i.path[cut:], i.size, i.mtime_ns] for i in self.fs.get_file_info(sel)
                      if i.type == self._pafs.FileType.File)

    def _put_json(self, doc: dict, *rel: str) -> None:
        import orjson

        with self.fs.open_output_stream(self.path(*rel)) as out:
            out.write(orjson.dumps(doc))

    def _finish_marker(self, rid: str, stored) -> None:
        """A pending marker (a process killed in _settle_deleted_work): when the store's manifest carries
        the record it was written for (`stored`), that manifest counts the objects it names, which go;
        otherwise none does, and the marker is void (its objects are the journal the manifest counts)."""
        import orjson

        if not self.exists("runs", rid, STALE_WORK):
            return
        with self.fs.open_input_stream(self.path("runs", rid, STALE_WORK)) as f:
            try:
                mark = orjson.loads(f.read())
            except orjson.JSONDecodeError:
                mark = None
        mark = mark if isinstance(mark, dict) else {}
        if stored is not None and mark.get(DELETED_WORK_SPEND_KEY) == stored:
            self._drop_work(rid, mark.get("objects") or [])
        else:
            self.fs.delete_file(self.path("runs", rid, STALE_WORK))

    def _drop_work(self, rid: str, objects: list) -> None:
        """Delete the marker's objects still as it names them, then the marker (last: a process killed
        midway leaves it for the next reader to finish)."""
        named = {tuple(o) for o in objects if isinstance(o, list) and len(o) == 3}
        for path, size, mtime in self._work_objects(rid):
            if (path, size, mtime) in named:
                self.fs.delete_file(self.path("runs", rid, path))
                self._parts_sent.pop((rid, path.rsplit("/", 1)[-1]), None)
        self.fs.delete_file(self.path("runs", rid, STALE_WORK))

    def _push_work(self, run_dir) -> None:
        rid = run_dir.run_id
        self._push_plan_parts(run_dir)
        for name in WORK_FILES:
            f = run_dir.work / name
            if f.exists():
                self.put(f, "runs", rid, "work", name)
        db = run_dir.work / "responses.sqlite"
        if db.exists():  # a consistent copy of a database in use (WAL), by SQLite's backup API
            with tempfile.TemporaryDirectory(dir=run_dir.work) as t:
                copy = Path(t) / "responses.sqlite"
                src, dst = sqlite3.connect(db, timeout=60), sqlite3.connect(copy)
                try:
                    src.backup(dst)
                finally:
                    dst.close()
                    src.close()
                self.put(copy, "runs", rid, "work", "responses.sqlite")

    def _push_plan_parts(self, run_dir) -> None:
        """Each plan part once while its file stays the same: a planning node lost midway (a GPU
        preempted after an hour of planning) resumes elsewhere from the parts it wrote. A part
        set aside (damaged, another run's) and planned again gets the same name in a new file
        (a new inode: parts are written under a temporary name, then renamed): sent once by
        name, the store kept the bad one, and a resume elsewhere planned those queries again."""
        folder = run_dir.work / PLAN_PARTS
        for f in sorted(folder.glob("part-*.parquet")) if folder.is_dir() else []:
            try:
                st = f.stat()
            except FileNotFoundError:  # set aside meanwhile
                continue
            key, ident = (run_dir.run_id, f.name), (st.st_ino, st.st_size, st.st_mtime_ns)
            if self._parts_sent.get(key) != ident:
                self.put(f, "runs", run_dir.run_id, "work", PLAN_PARTS, f.name)
                self._parts_sent[key] = ident

    def _pull_plan_parts(self, run_dir) -> None:
        sel = self._pafs.FileSelector(self.path("runs", run_dir.run_id, "work", PLAN_PARTS), allow_not_found=True)
        for info in self.fs.get_file_info(sel):
            if info.type == self._pafs.FileType.File and info.base_name.startswith("part-"):
                self.get(run_dir.work / PLAN_PARTS / info.base_name, "runs", run_dir.run_id, "work", PLAN_PARTS,
                         info.base_name)

    def pull_run(self, run_dir) -> bool:
        """Fetch a run this folder does not have (a resume on another machine)."""
        with self._reaching(f"look for run {run_dir.run_id}"):
            return self._pull_run(run_dir)

    def _pull_run(self, run_dir) -> bool:
        rid = run_dir.run_id
        if run_dir.exists() or not self.exists("runs", rid, "manifest.json"):
            return False
        self._finish_marker(rid, self._stored_record(rid))  # before work/ is fetched
        for name in TABLE_FILES[1:]:
            if self.exists("runs", rid, name):
                self.get(run_dir.path / name, "runs", rid, name)
        for name in (*WORK_FILES, "responses.sqlite"):
            if self.exists("runs", rid, "work", name):
                self.get(run_dir.work / name, "runs", rid, "work", name)
        self._pull_plan_parts(run_dir)
        self.get(run_dir.manifest_path, "runs", rid, "manifest.json")
        return True

    def table_files(self) -> dict[str, list[str]]:
        """Table name -> the store paths of every run's file of it."""
        sel = self._pafs.FileSelector(self.path("runs"), recursive=True, allow_not_found=True)
        out: dict[str, list[str]] = {}
        with self._reaching("list the runs"):
            infos = self.fs.get_file_info(sel)
        for info in infos:
            rel = info.path[len(self.path("runs")) + 1:].split("/")
            if info.type == self._pafs.FileType.File and len(rel) == 2 and rel[1].endswith(".parquet"):
                out.setdefault(rel[1][:-len(".parquet")], []).append(info.path)
        return {k: sorted(v) for k, v in out.items()}


class RunLease:
    """One process per run across machines: the local flock (conductor/execute/lock.py) sees
    only its own data folder, so a second machine (a scheduler's retry of a pod still alive)
    ran the whole job again and overwrote the first one's objects.

    The lease is an object beside the run's, naming its holder (host, pid, a random token).
    The holder renews it every sync interval (CONDUCTOR_STORE_SYNC_S) and deletes it when
    the run ends, however it ends short of SIGKILL; one not renewed for `ttl` (four
    intervals and a second, 121 s by default) has lapsed and is taken over. The second covers
    the settle of a plain-write take, before the first renewal: without it a lease renewed
    every 0.25 s had lapsed by the time it was taken.

    Taking and renewing it are conditional writes (s3cond: create only if absent, replace
    only the version read), so of two takers exactly one wins, and a holder whose lease was
    taken over finds out at its next renewal. Without credentials in AWS_* variables, or on a
    server that refuses conditional writes, pyarrow's plain writes remain: write ours, wait
    `settle`, read it back, refuse unless ours is there; then two takers both win if one
    pauses for more than `settle` between its read and its write. Expiry is read
    on this machine's clock against the holder's: the clocks must agree to well within `ttl`.
    A holder whose lapsed lease was taken over stops (SIGTERM: the CLI's Ctrl-C path) and
    uploads nothing more; release reads, then deletes, so it could delete a lease taken over
    between the two, which only a holder already past its expiry can do.
    """

    settle = 1.0

    def __init__(self, store: ObjectStore, run_id: str, interval: float | None = None):
        self.store, self.run_id = store, run_id
        self.interval = interval or sync_interval()
        self.ttl = 4 * self.interval + self.settle
        self.token = secrets.token_hex(16)
        self.started = time.time()
        self.lost: dict | None = None  # the holder that took it over after ours lapsed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="store-lease", daemon=True)
        self._object = ConditionalObject.from_env(store.root, "runs", run_id, LEASE_FILE)
        self._etag: str | None = None  # of the lease as last read or written (conditional writes)

    @property
    def where(self) -> str:
        return f"{self.store.url}/runs/{self.run_id}/{LEASE_FILE}"

    def _read(self, any_etag: bool = False) -> dict | None:
        """The lease as stored (None: no lease). With conditional writes, its ETag is kept as the
        version the next renewal swaps when the lease is ours, or, with `any_etag` (taking over a
        lapsed lease), whoever's it is. Kept for another's, a check of the journal uploader's thread
        armed the renewal thread's next swap with the new holder's version: a process resumed after a
        pause wrote its lease over the new holder's."""
        import orjson

        raw, etag = None, None
        if self._object is not None:
            try:
                got = self._object.get()
            except Unsupported as e:
                self._plain_writes(e)
            else:
                if got is None:
                    return None
                raw, etag = got
        if raw is None:
            try:
                with self.store.fs.open_input_stream(self.store.path("runs", self.run_id, LEASE_FILE)) as f:
                    raw = f.read()
            except FileNotFoundError:
                return None
        try:
            held = orjson.loads(raw)
        except orjson.JSONDecodeError:  # not a lease: taken over as a lapsed one
            held = {}
        held = held if isinstance(held, dict) else {}
        if etag is not None and (any_etag or held.get("token") == self.token):
            self._etag = etag
        return held

    def _plain_writes(self, why: Unsupported) -> None:
        log.warning("store %s: conditional writes are refused (%s); the lease of run %s is kept with plain "
                    "writes", self.store.url, why, self.run_id)
        self._object = None

    def _body(self) -> bytes:
        import orjson

        now = time.time()
        return orjson.dumps({"run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid(),
                             "token": self.token, "started_at": _iso(self.started), "renewed_at": _iso(now),
                             "expires_at": _iso(now + self.ttl)})

    def _write(self) -> None:
        with self.store.fs.open_output_stream(self.store.path("runs", self.run_id, LEASE_FILE)) as out:
            out.write(self._body())

    def _swap(self, expected: str | None) -> bool:
        """Write ours if the lease is still absent (expected None) or still the version read:
        False when another process wrote it first."""
        etag = self._object.put(self._body(), if_match=expected)
        if etag is not None:
            self._etag = etag
        return etag is not None

    @staticmethod
    def _live(held: dict) -> bool:
        try:
            return datetime.fromisoformat(held["expires_at"]).timestamp() > time.time()
        except (KeyError, TypeError, ValueError):
            return False

    def take(self) -> "RunLease":
        """Hold the run, or refuse (ConductorError, exit 2) naming the live holder. A lease that
        looks live may be a killed holder's (a scheduler retrying an evicted pod): it is watched
        until it is renewed (refused: its holder lives) or lapses (taken over), at most `ttl`."""
        with self.store._reaching(f"look for run {self.run_id}"):
            held = self._read(any_etag=True)
        if held is not None and self._live(held):
            log.warning("store %s: run %s: its lease is held by process %s on host %s (renewed %s); waiting up "
                        "to %.0f s to see whether that process still runs it", self.store.url, self.run_id,
                        held.get("pid", "?"), held.get("host", "?"), held.get("renewed_at", "?"), self.ttl)
            while held is not None and self._live(held):
                time.sleep(min(self.interval / 4, 5.0))
                with self.store._reaching(f"look for run {self.run_id}"):
                    now = self._read(any_etag=True)
                if now is not None and (now.get("token"), now.get("renewed_at")) != \
                        (held.get("token"), held.get("renewed_at")):
                    raise ConductorError(self._refusal(now))
                held = now
        with self.store._reaching(f"take the lease of run {self.run_id}"):
            self.store.check_bucket()
            if not self._took(held):
                now = self._read()  # another process took it meanwhile
                raise ConductorError(self._refusal(now or {}))
        if held is not None:
            log.warning("store %s: run %s: taking over its lease, lapsed at %s (host %s, process %s)",
                        self.store.url, self.run_id, held.get("expires_at", "?"), held.get("host", "?"),
                        held.get("pid", "?"))
        return self

    def _took(self, held: dict | None) -> bool:
        if self._object is not None:
            try:
                return self._swap(None if held is None else self._etag)
            except Unsupported as e:
                self._plain_writes(e)
        self._write()
        time.sleep(self.settle)
        now = self._read()
        return now is not None and now.get("token") == self.token

    def _refusal(self, held: dict) -> str:
        return (f"run {self.run_id} is already running on host {held.get('host', '?')} in process "
                f"{held.get('pid', '?')} (lease {self.where}, last renewed {held.get('renewed_at', '?')}, "
                f"expires {held.get('expires_at', '?')} unless renewed); wait for it to finish or stop it, "
                f"then rerun the same command; if that process is dead, rerun after the lease expires")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if self._object is not None and self._swap(self._etag):
                    continue
                if not self.still_ours():
                    return
                if self._object is not None:  # ours, but not the version we wrote last (an answer lost)
                    self._swap(self._etag)
                else:
                    self._write()
            except Unsupported as e:
                self._plain_writes(e)  # from the next renewal on
            except Exception as e:  # the next renewal may succeed; the lease lapses only after `ttl`
                log.warning("store %s: run %s: lease renewal failed: %s", self.store.url, self.run_id, e)

    def still_ours(self) -> bool:
        """Whether this process still holds the lease. If not, the run stops (SIGTERM: the CLI's Ctrl-C
        path) and uploads nothing more. A lease gone while the run goes on was taken over by another
        process after ours lapsed (a paused machine), which may have finished and released it since."""
        if self.lost is not None:
            return False
        held = self._read()
        if held is not None and held.get("token") == self.token:
            return True
        self.lost = held if held is not None else {"released": True}
        log.error("store %s: run %s: our lease lapsed and %s took the run over; stopping", self.store.url,
                  self.run_id, self._taker())
        os.kill(os.getpid(), signal.SIGTERM)  # the CLI stops as on Ctrl-C
        return False

    def _taker(self) -> str:
        if self.lost is not None and self.lost.get("released"):
            return "another process (which has since released it)"
        lost = self.lost or {}
        return f"process {lost.get('pid', '?')} on host {lost.get('host', '?')}"

    def release(self) -> None:
        """Delete the lease if it is still ours, so the same run can start again at once."""
        try:
            held = self._read()
            if held is not None and held.get("token") == self.token:
                self.store.fs.delete_file(self.store.path("runs", self.run_id, LEASE_FILE))
        except Exception as e:
            log.warning("store %s: run %s: the lease was not released (%s); it lapses %.0f s after its last "
                        "renewal", self.store.url, self.run_id, e, self.ttl)

    def __enter__(self) -> "RunLease":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.lost is None:
            self.release()
            return
        raise ConductorError(
            f"run {self.run_id} stopped: its lease {self.where} lapsed (not renewed for {self.ttl:.0f} s) and "
            f"{self._taker()} took the run over; the store's copy of the run is that process's") from None


def _read_local(path: Path) -> bytes | None:
    """A local file's bytes (None: there is none). The manifest is replaced whole (store.write_atomic)."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None


def _deleted_work_spend(manifest: bytes | None) -> dict | None:
    """The local manifest's record of what a journal deleted mid-run paid (None: it has none)."""
    import orjson

    try:
        manifest = orjson.loads(manifest) if manifest is not None else None
    except orjson.JSONDecodeError:
        return None
    return (manifest.get(DELETED_WORK_SPEND_KEY) or None) if isinstance(manifest, dict) else None


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


class JournalUploader:
    """Uploads a run's plan parts and journal every `interval` seconds while it plans and executes,
    and once at the end."""

    def __init__(self, store: ObjectStore, run_dir, interval: float | None = None, lease: "RunLease | None" = None):
        self.store, self.run_dir, self.lease = store, run_dir, lease
        self.interval = interval or sync_interval()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="journal-upload", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self._lost():
                return
            try:
                self.store.push_run(self.run_dir)
            except Exception as e:  # the run goes on; the next upload catches up
                log.warning("store %s: journal upload failed: %s", self.store.url, e)

    def _lost(self) -> bool:
        """A run whose lease another process took over uploads nothing more: the objects are its.
        Asked of the store before each upload: a process resumed after a pause must not push its
        stale files over the new holder's before its next renewal would have told it."""
        if self.lease is None:
            return False
        try:
            return not self.lease.still_ours()
        except Exception:  # the store cannot be read: the upload will say so
            return self.lease.lost is not None

    def __enter__(self) -> "JournalUploader":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._lost():
            return
        try:
            self.store.push_run(self.run_dir)
        except Exception as e:
            if exc[0] is None:
                raise StorageError(f"store {self.store.url}: the run finished here but could not be "
                                   f"uploaded ({e}); rerun the same command to upload it") from None
            log.warning("store %s: journal upload failed: %s", self.store.url, e)


def catalog(store: ObjectStore, views_left_out: dict[str, str] | None = None):
    """An in-memory DuckDB with the catalog's views over the store's run files, read by
    pyarrow (DuckDB's httpfs extension cannot be installed offline, see docs/scaling.md)
    and registered as Arrow datasets, which DuckDB scans lazily with filters pushed down.
    The views read as the local catalog's do (conductor.store): a carried-over query-set column
    whose type differs between runs is text, and the runs view is the same query. A table whose
    runs differ in the type of a column of its schema has no view; `views_left_out` (view ->
    why) and standard error say which column, both types and both runs."""
    import sys

    import duckdb
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from conductor.viewsql import ident, text_groups, union_by_name

    con = duckdb.connect(":memory:")
    con.execute("SET TimeZone = 'UTC'")
    left_out: list[str] = []  # one damaged object must not take its whole view down for every run
    clashes = views_left_out if views_left_out is not None else {}
    for name, paths in store.table_files().items():
        schema_of: dict[str, pa.Schema] = {}
        for p in paths:
            try:
                schema_of[p] = pq.read_schema(p, filesystem=store.fs)
            except (OSError, pa.ArrowException) as e:
                left_out.append(f"{p} ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})")
        if not schema_of:
            continue
        groups = text_groups(name, schema_of) or [(list(schema_of), {})]
        texted = {col.lower() for _, texts in groups for col in texts}
        try:  # the columns not read as text must read as one type across every group
            _unified(name, {p: pa.schema([f for f in s if f.name.lower() not in texted]) for p, s in schema_of.items()})
            datasets = [ds.dataset(ps, schema=_unified(name, {p: schema_of[p] for p in ps}), filesystem=store.fs,
                                   format="parquet") for ps, _ in groups]
        except _Clash as e:
            clashes[name] = str(e)
            continue
        if len(groups) == 1:
            con.register(name, datasets[0])
            continue
        for i, dataset in enumerate(datasets):
            con.register(f"_{name}_{i}", dataset)
        con.execute(f"CREATE VIEW {ident(name)} AS "
                    f"{union_by_name([(ident(f'_{name}_{i}'), texts) for i, (_, texts) in enumerate(groups)])}")
    manifests = _manifests(store, left_out)
    if manifests is not None:
        from conductor.viewsql import MANIFEST_FIELDS, runs_view

        con.register("_manifests", manifests)
        source = ", ".join(f"{ident(k)}::{t} AS {ident(k)}" for k, t in MANIFEST_FIELDS.items())
        con.execute(f"CREATE VIEW runs AS {runs_view(f'(SELECT {source} FROM _manifests)')}")
    for name, why in clashes.items():
        print(f"conductor: the store's catalog has no view {name}: {why}", file=sys.stderr)
    if left_out:
        print(f"conductor: the store's catalog leaves out {len(left_out)} damaged object(s), so the views lack "
              f"their runs' rows; replace or delete each: " + "; ".join(left_out[:10])
              + (f"; and {len(left_out) - 10} more" if len(left_out) > 10 else ""), file=sys.stderr)
    return con


class _Clash(Exception):
    """Two runs' files of a table whose column pyarrow cannot read as one type."""


def _unified(name: str, schema_of: dict):
    """The schema these objects of a table read as (numbers widened, a dictionary-encoded column
    as its values, as DuckDB reads them); _Clash naming the column and the runs when there is none."""
    import pyarrow as pa

    plain = [pa.schema([f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f for f in s])
             for s in schema_of.values()]
    try:
        return pa.unify_schemas(plain, promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        raise _Clash(_clash(name, dict(zip(schema_of, plain)))) from None


def _clash(name: str, schema_of: dict) -> str:
    """Which column of which two runs' objects does not unify, with both types, and what to do."""
    import pyarrow as pa

    from conductor import schemas
    from conductor.viewsql import column_clash, sql_type

    found = _first_clash(schema_of)
    if found is None:
        return f"its runs' objects do not read as one table ({', '.join(f's3://{p}' for p in schema_of)})"
    column, (a, where_a), (b, where_b) = found
    clash = column_clash(column, name, (sql_type(a), where_a.split("/")[-2], f"s3://{where_a}"),
                         (sql_type(b), where_b.split("/")[-2], f"s3://{where_b}"))
    if column in schemas.TABLES.get(name, pa.schema([])).names:
        clash += "; neither object is damaged (files written by different conductor versions may differ so)"
    else:
        clash += "; neither object is damaged"
    return (f"{clash}, but the column cannot be read as one type across the runs: download each run's file and "
            f"read it apart (SELECT * FROM read_parquet('<file>'))")


def _first_clash(schema_of: dict):
    """(column, (type, object), (other type, other object)) of the first column whose type in an
    object does not unify with its type in an earlier one; None if there is none."""
    import pyarrow as pa

    first: dict = {}  # a column -> its first type, and that type's object
    for where, schema in schema_of.items():
        for field in schema:
            if field.name not in first:
                first[field.name] = (field.type, where)
                continue
            try:
                pa.unify_schemas([pa.schema([pa.field("c", first[field.name][0])]),
                                  pa.schema([pa.field("c", field.type)])], promote_options="permissive")
            except (pa.ArrowTypeError, pa.ArrowInvalid):
                return field.name, first[field.name], (field.type, where)
    return None


def _manifests(store: ObjectStore, left_out: list[str]):
    """Every run's manifest.json on the store as a table of conductor.viewsql.MANIFEST_FIELDS (JSON as
    text, a missing field null); None when there is none. One that does not read is named in `left_out`."""
    import orjson
    import pyarrow as pa

    from conductor.viewsql import MANIFEST_FIELDS

    rows = []
    sel = store._pafs.FileSelector(store.path("runs"), recursive=True, allow_not_found=True)
    for info in store.fs.get_file_info(sel):
        if info.path.endswith("/manifest.json") and info.path.count("/") == store.path("runs").count("/") + 2:
            with store.fs.open_input_stream(info.path) as f:
                try:
                    m = orjson.loads(f.read())
                except orjson.JSONDecodeError as e:
                    m = f"not JSON: {e}"
            if not isinstance(m, dict):
                left_out.append(f"{info.path} ({m if isinstance(m, str) else 'not a JSON object'})")
                continue
            rows.append({k: _manifest_value(m.get(k), t) for k, t in MANIFEST_FIELDS.items()})
    if not rows:
        return None
    types = {"DOUBLE": pa.float64()}
    return pa.Table.from_pylist(rows, schema=pa.schema([(k, types.get(t, pa.string()))
                                                        for k, t in MANIFEST_FIELDS.items()]))


def _manifest_value(value: Any, sql: str) -> Any:
    """A manifest field as the runs view's column of type `sql` holds it (a wrong type: text, or null)."""
    import orjson

    if value is None:
        return None
    if sql == "JSON":
        return orjson.dumps(value).decode()
    if sql == "DOUBLE":
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return value if isinstance(value, str) else str(value)
