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

Credentials come from the usual AWS variables (AWS_ACCESS_KEY_ID, ...); an
S3-compatible server other than AWS is named by AWS_ENDPOINT_URL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

from conductor.errors import ConductorError, StorageError

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


def store_url(value: str | None) -> str | None:
    url = value or os.environ.get(ENV) or None
    if url is not None and "@" in urlsplit(url).netloc:  # not echoed: it holds credentials
        raise ConductorError("store: an s3:// URL with credentials in it (s3://KEY:SECRET@bucket) is not taken; "
                             "give s3://bucket/prefix and the credentials in AWS_ACCESS_KEY_ID and "
                             "AWS_SECRET_ACCESS_KEY")
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
        kw = {"allow_bucket_creation": True}
        if endpoint:
            e = urlsplit(endpoint)
            kw.update(endpoint_override=e.netloc, scheme=e.scheme or "https")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            kw["region"] = region
        self.fs = pafs.S3FileSystem(**kw)
        self._pafs = pafs

    def path(self, *rel: str) -> str:
        return "/".join((self.root, *rel))

    def ensure_bucket(self) -> None:
        bucket = self.root.split("/", 1)[0]
        try:
            if self.fs.get_file_info(bucket).type == self._pafs.FileType.NotFound:
                self.fs.create_dir(bucket)
        except OSError as e:
            raise StorageError(f"store {self.url}: cannot reach or create the bucket ({e}); check AWS_ENDPOINT_URL, "
                               f"the credentials and the network, then rerun the same command: finished work "
                               f"is kept") from None

    def put(self, local: Path, *rel: str) -> None:
        """One object, whole or not at all (the upload completes on close)."""
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

    def push_run(self, run_dir, work: bool = True) -> None:
        """The run's tables and manifest (and its journal) to the store. Tables first, manifest
        last: a reader that sees the manifest's status sees the tables it names."""
        with self._reaching(f"upload run {run_dir.run_id}"):
            self._push_run(run_dir, work)

    def _push_run(self, run_dir, work: bool) -> None:
        self.ensure_bucket()
        rid = run_dir.run_id
        if work and run_dir.work.exists():
            self._push_work(run_dir)
        for name in TABLE_FILES[1:]:
            f = run_dir.path / name
            if f.exists():
                self.put(f, "runs", rid, name)
        if run_dir.manifest_path.exists():
            self.put(run_dir.manifest_path, "runs", rid, "manifest.json")

    def _push_work(self, run_dir) -> None:
        rid = run_dir.run_id
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

    def pull_run(self, run_dir) -> bool:
        """Fetch a run this folder does not have (a resume on another machine)."""
        with self._reaching(f"look for run {run_dir.run_id}"):
            return self._pull_run(run_dir)

    def _pull_run(self, run_dir) -> bool:
        rid = run_dir.run_id
        if run_dir.exists() or not self.exists("runs", rid, "manifest.json"):
            return False
        for name in TABLE_FILES[1:]:
            if self.exists("runs", rid, name):
                self.get(run_dir.path / name, "runs", rid, name)
        for name in (*WORK_FILES, "responses.sqlite"):
            if self.exists("runs", rid, "work", name):
                self.get(run_dir.work / name, "runs", rid, "work", name)
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


class JournalUploader:
    """Uploads a run's journal every `interval` seconds while it executes, and once at the end."""

    def __init__(self, store: ObjectStore, run_dir, interval: float | None = None):
        self.store, self.run_dir = store, run_dir
        self.interval = interval or float(os.environ.get("CONDUCTOR_STORE_SYNC_S") or 30.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="journal-upload", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.push_run(self.run_dir)
            except Exception as e:  # the run goes on; the next upload catches up
                log.warning("store %s: journal upload failed: %s", self.store.url, e)

    def __enter__(self) -> "JournalUploader":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.store.push_run(self.run_dir)
        except Exception as e:
            if exc[0] is None:
                raise StorageError(f"store {self.store.url}: the run finished here but could not be "
                                   f"uploaded ({e}); rerun the same command to upload it") from None
            log.warning("store %s: journal upload failed: %s", self.store.url, e)


def catalog(store: ObjectStore):
    """An in-memory DuckDB with the catalog's views over the store's run files, read by
    pyarrow (DuckDB's httpfs extension cannot be installed offline, see docs/scaling.md)
    and registered as Arrow datasets, which DuckDB scans lazily with filters pushed down."""
    import duckdb
    import orjson
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    con = duckdb.connect(":memory:")
    con.execute("SET TimeZone = 'UTC'")
    for name, paths in store.table_files().items():
        schemas = [pq.read_schema(p, filesystem=store.fs) for p in paths]
        con.register(name, ds.dataset(paths, schema=pa.unify_schemas(schemas, promote_options="permissive"),
                                      filesystem=store.fs, format="parquet"))
    manifests = []
    sel = store._pafs.FileSelector(store.path("runs"), recursive=True, allow_not_found=True)
    for info in store.fs.get_file_info(sel):
        if info.path.endswith("/manifest.json") and info.path.count("/") == store.path("runs").count("/") + 2:
            with store.fs.open_input_stream(info.path) as f:
                m = orjson.loads(f.read())
            manifests.append({"run_id": m.get("run_id"), "status": m.get("status"),
                              "created_at": m.get("created_at"), "updated_at": m.get("updated_at"),
                              "inputs": orjson.dumps(m.get("inputs")).decode(),
                              "summary": orjson.dumps(m.get("summary")).decode()})
    if manifests:
        con.register("_manifests", pa.Table.from_pylist(manifests))
        con.execute("""CREATE VIEW runs AS SELECT run_id, status, created_at::TIMESTAMPTZ AS created_at,
            updated_at::TIMESTAMPTZ AS updated_at, inputs::JSON AS inputs, summary::JSON AS summary
            FROM _manifests""")
    return con
