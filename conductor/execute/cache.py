"""A persistent response cache in SQLite, shared by runs and processes.

The key covers everything that decides a response: model, api_base, the full
message list (system prompt included) and every sampling parameter. Entries are
committed as responses arrive (WAL mode), so they survive a crash, and several
processes can share one file.

Inside an event loop, entries put in the same loop turn are committed together
right after it (one transaction instead of one per answer: a commit cost more
than the rest of the executor's own work per call). A failed commit is raised by
the next `put` (or `flush`), after which every put commits at once.
"""

from __future__ import annotations

import errno
import hashlib
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from conductor.errors import ConductorError
from conductor.execute.turns import AfterTurn

KEY_VERSION = 1
_KEYS_PER_QUERY = 500  # well under SQLite's limit on a statement's parameters
_JSON_EACH = sqlite3.sqlite_version_info >= (3, 38, 0)  # JSON functions built in from then on


def cache_key(model: str, api_base: str | None, messages: list[dict], params: dict[str, Any]) -> str:
    doc = {"v": KEY_VERSION, "model": model, "api_base": (api_base or "").rstrip("/"),
           "messages": messages, "params": params}
    return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).hexdigest()


@dataclass
class Entry:
    """One cached answer. (Not frozen, though never changed: building a frozen
    dataclass costs four times as much, a tenth of a step served from the cache.)"""

    text: str
    prompt_tokens: int
    completion_tokens: int
    usage_estimated: bool
    simulated: bool
    cost_usd: float | None
    latency_s: float
    logprob: float | None = None  # of the completion, when the provider sent log-probabilities
    attempts: int = 1  # sends it took, so a resumed run can record a call it paid for but never logged
    # The price the answer was paid at, as its call priced it (USD per token, the online list price;
    # a batch call paid it x the provider's batch_price_factor), and how: "online" or "batch". So a run
    # served from the cache after a price change knows what its logged costs were paid at. None: an
    # entry from before they were kept, no known price, a cost the server stated (a replay's recorded
    # cost), or no call at all (a function step).
    input_price: float | None = None
    output_price: float | None = None
    paid_mode: str | None = None


_ENTRY_FIELDS = frozenset(Entry.__dataclass_fields__)


def read_entry(value: bytes) -> Entry | None:
    """`Entry(**orjson.loads(value))` in a third of the time for an entry with every field
    (a rerun builds one per step); older entries, missing fields (their defaults: None), go
    through `Entry`, as do entries a newer version wrote (fields this one does not know are
    dropped, not an error). None for an entry without text: older versions cached a 200 whose
    content was null (a refusal), which is no answer, and served it for ever; it is asked for again."""
    d = orjson.loads(value)
    if not isinstance(d.get("text"), str):
        return None
    if d.keys() != _ENTRY_FIELDS:
        return Entry(**{k: v for k, v in d.items() if k in _ENTRY_FIELDS})
    entry = object.__new__(Entry)
    entry.__dict__ = d
    return entry


# SQLite's result codes for a disk that is full or failing, as the errno the CLI reports
# as a storage error ("free space and rerun"): moving the cache away would not help.
_DISK_ERRORS = {13: errno.ENOSPC, 10: errno.EIO}  # SQLITE_FULL, SQLITE_IOERR (and its extended codes)
_DAMAGE_CODES = {11, 26}  # SQLITE_CORRUPT, SQLITE_NOTADB: the file, not the disk


def _move_away(path: Path) -> str:
    return (f"It holds cached answers only: move it away (mv '{path}' '{path}.bad') and rerun; its answers will be "
            f"asked for again")


class CacheDamaged(sqlite3.DatabaseError):
    """A cache file found damaged after it opened: a page deep in it, which opening does not read
    (checking every page would cost each run a read of the whole file). Still a database error, so
    the executor stops the run as on any storage error; its message names the file and what to do
    (the runner's message said "free space" and named the run folder)."""

    def __init__(self, path: Path, e: sqlite3.DatabaseError):
        super().__init__(f"the response cache {path} is damaged ({e}). {_move_away(path)}")
        self.path, self.reason = path, str(e)


def _damaged(path: Path, e: sqlite3.DatabaseError) -> CacheDamaged | None:
    """A CacheDamaged naming `path` when SQLite says the file is damaged, else None."""
    if not isinstance(e, CacheDamaged) and getattr(e, "sqlite_errorcode", 0) & 0xFF in _DAMAGE_CODES:
        return CacheDamaged(path, e)
    return None


class Cache:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._pending: dict[str, tuple[str, str, bytes, float]] = {}
        self._turn = AfterTurn(self.flush, (OSError, sqlite3.DatabaseError))
        if self.path.is_dir():  # sqlite3's "unable to open database file" ended the run in a traceback
            raise ConductorError(f"{self.path} is a folder, not a response cache file: move it away, or point "
                                 f"CONDUCTOR_CACHE at a file (or run with --no-cache)")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ConductorError(f"cannot make the response cache {self.path}: a file is in the way of its "
                                 f"folder {self.path.parent}") from None
        self._db = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives a process kill
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, model TEXT, value BLOB, created REAL)")
            self._db.execute("SELECT count(*) FROM (SELECT 1 FROM responses LIMIT 1)").fetchone()
        except sqlite3.DatabaseError as e:
            self._db.close()
            if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                raise
            if getattr(e, "sqlite_errorcode", 0) & 0xFF in _DISK_ERRORS:  # the disk, not the file: exit 5
                raise OSError(_DISK_ERRORS[e.sqlite_errorcode & 0xFF], str(e), str(self.path)) from None
            raise ConductorError(f"{self.path} is not a readable response cache ({e}). "
                                 f"{_move_away(self.path)}") from None

    def get(self, key: str) -> Entry | None:
        pending = self._pending.get(key)
        if pending is not None:
            return read_entry(pending[2])
        try:
            row = self._db.execute("SELECT value FROM responses WHERE key = ?", (key,)).fetchone()
        except sqlite3.DatabaseError as e:
            if (damaged := _damaged(self.path, e)) is not None:
                raise damaged from None
            raise
        if row is None:
            return None
        return read_entry(row[0])

    def get_many(self, keys: list[str]) -> dict[str, Entry]:
        """The entries of those keys that are cached, in one query: a rerun looks up a
        batch of steps at once instead of one query each."""
        found: dict[str, Entry | None] = {}
        rest = []
        for key in keys:
            pending = self._pending.get(key)
            if pending is not None:
                found[key] = read_entry(pending[2])
            else:
                rest.append(key)
        try:
            if rest and _JSON_EACH:  # the keys as one JSON array: cheaper to bind than one parameter each
                for key, value in self._db.execute("SELECT r.key, r.value FROM json_each(?) AS k "
                                                   "JOIN responses AS r ON r.key = k.value", (orjson.dumps(rest),)):
                    found[key] = read_entry(value)
            else:
                for i in range(0, len(rest), _KEYS_PER_QUERY):
                    part = rest[i:i + _KEYS_PER_QUERY]
                    query = f"SELECT key, value FROM responses WHERE key IN ({','.join('?' * len(part))})"
                    for key, value in self._db.execute(query, part):
                        found[key] = read_entry(value)
        except sqlite3.DatabaseError as e:
            if (damaged := _damaged(self.path, e)) is not None:
                raise damaged from None
            raise
        return {k: e for k, e in found.items() if e is not None}

    def put(self, key: str, model: str, entry: Entry) -> None:
        self._turn.raise_pending()
        self._pending[key] = (key, model, orjson.dumps(entry.__dict__), time.time())
        self._turn.schedule()

    def flush(self) -> None:
        """Commit the entries put since the last commit (raises a commit's error)."""
        self._turn.raise_pending()
        if not self._pending:
            return
        rows = list(self._pending.values())
        self._db.execute("BEGIN")
        try:
            self._db.executemany("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)", rows)
            self._db.execute("COMMIT")
        except BaseException as e:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if isinstance(e, sqlite3.DatabaseError) and (damaged := _damaged(self.path, e)) is not None:
                raise damaged from None
            raise
        for row in rows:
            if self._pending.get(row[0]) is row:
                del self._pending[row[0]]

    def __len__(self) -> int:
        self.flush()
        return self._db.execute("SELECT count(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        """Commit what is pending and close; a commit that fails here (the disk is full)
        is dropped: the run already stops on that storage error."""
        try:
            self.flush()
        except (OSError, sqlite3.DatabaseError):
            pass
        finally:
            self._db.close()
