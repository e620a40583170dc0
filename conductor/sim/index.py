"""Which known query a request is about: the query whose prompt appears in a message.

A message that is exactly a prompt is found with one dict lookup. Otherwise the
message is scanned at each word start against a trie of fixed-size prompt
chunks, so the cost grows with the message, not with the number of prompts, and
prompts sharing a long template prefix do not pile up in one bucket. Prompts
shorter than one chunk are only found when a message is exactly the prompt.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from conductor.errors import InputError
from conductor.queries import load_queries, validate

RECORD_TASK = "record"  # an enrichment job's rows: the reference is a JSON object of field values
CHUNK = 16
SPLIT = 8
_WORD_START = re.compile(r"(?<!\w)\S")
_OPTION = re.compile(r"(?m)^[ \t]*\(?([A-Z])[).:]\s")


class Known:
    """One question the server can answer."""

    __slots__ = ("query_id", "prompt", "task", "reference", "_options")

    def __init__(self, query_id: str, prompt: str, task: str | None, reference: str | None):
        self.query_id = query_id
        self.prompt = prompt
        self.task = task
        self.reference = reference
        self._options: tuple[str, ...] | None = None

    @property
    def options(self) -> tuple[str, ...]:
        """Option letters listed in the prompt, as in '(A) ...' or 'B. ...'."""
        if self._options is None:
            seen = dict.fromkeys(_OPTION.findall(self.prompt))
            self._options = tuple(seen)
        return self._options


class _Node:
    """Prompts whose text so far matched this node's chunks. `ends` holds the
    rest of each prompt, grouped by length so a lookup costs one slice per
    distinct length. A node pushes rests of a chunk or more down into children
    only once it holds more than SPLIT of them, so building stays cheap."""

    __slots__ = ("children", "ends", "n_long")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.ends: dict[int, dict[str, Known]] = {}
        self.n_long = 0

    def add(self, tail: str, k: Known) -> None:
        self.ends.setdefault(len(tail), {}).setdefault(tail, k)
        if len(tail) >= CHUNK:
            self.n_long += 1
            if self.n_long > SPLIT:
                self.split()

    def split(self) -> None:
        for n in [n for n in self.ends if n >= CHUNK]:
            for tail, k in self.ends.pop(n).items():
                self.child(tail[:CHUNK]).add(tail[CHUNK:], k)
        self.n_long = 0

    def child(self, chunk: str) -> "_Node":
        node = self.children.get(chunk)
        if node is None:
            node = self.children[chunk] = _Node()
        return node


class QueryIndex:
    def __init__(self, known: Iterable[Known]):
        self.exact: dict[str, Known] = {}
        self.refs_by_task: dict[str | None, list[str]] = {}
        self._root = _Node()
        seen_refs: set[tuple[str | None, str]] = set()
        for k in known:
            prompt = k.prompt.strip()
            if not prompt or prompt in self.exact:
                continue
            self.exact[prompt] = k
            if k.reference is not None and (k.task, k.reference) not in seen_refs:
                seen_refs.add((k.task, k.reference))
                self.refs_by_task.setdefault(k.task, []).append(k.reference)
            if len(prompt) >= CHUNK:
                self._insert(prompt, k)

    def __len__(self) -> int:
        return len(self.exact)

    def _insert(self, prompt: str, k: Known) -> None:
        node, tail = self._root.child(prompt[:CHUNK]), prompt[CHUNK:]
        while node.children and len(tail) >= CHUNK:
            node, tail = node.child(tail[:CHUNK]), tail[CHUNK:]
        node.add(tail, k)

    def find(self, texts: Sequence[str]) -> Known | None:
        """The known query with the longest prompt found in any of `texts`."""
        for text in texts:
            hit = self.exact.get(text.strip())
            if hit is not None:
                return hit
        best, best_len = None, 0
        root_children = self._root.children
        for text in texts:
            if len(text) < CHUNK:
                continue
            for m in _WORD_START.finditer(text):
                i = m.start()
                node = root_children.get(text[i:i + CHUNK])
                if node is None:
                    continue
                pos = i + CHUNK
                while True:
                    for length, tails in node.ends.items():
                        n = pos - i + length
                        if n > best_len:
                            k = tails.get(text[pos:pos + length])
                            if k is not None:
                                best, best_len = k, n
                    if not node.children:
                        break
                    node = node.children.get(text[pos:pos + CHUNK])
                    if node is None:
                        break
                    pos += CHUNK
        return best


def query_files(paths: Sequence[str | Path]) -> list[Path]:
    """Parquet files named directly or found (recursively) in folders."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.rglob("*.parquet"))
            if not found:
                raise InputError(f"query folder {p}: holds no .parquet files")
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise InputError(f"query set {p}: file not found")
    return files


def load_index(paths: Sequence[str | Path]) -> QueryIndex:
    def rows() -> Iterable[Known]:
        for f in query_files(paths):
            t = _load(f)
            cols: list[list[Any]] = [t.column(c).to_pylist() for c in ("query_id", "prompt", "task", "reference")]
            for qid, prompt, task, ref in zip(*cols):
                yield Known(qid, prompt, task, ref)

    return QueryIndex(rows())


def _load(path: Path) -> pa.Table:
    """A query set, validated as `conductor run` reads it, except that task
    "record" (an enrichment job's rows, see `conductor job queries`) is allowed."""
    try:
        table = pq.read_table(path)
    except Exception:  # load_queries names the problem
        return load_queries(path)
    if "task" not in table.column_names or not pa.types.is_string(table.schema.field("task").type):
        return validate(table, str(path))
    task = table.column("task")
    is_record = pc.fill_null(pc.equal(task, RECORD_TASK), False)
    if not pc.any(is_record).as_py():
        return validate(table, str(path))
    blanked = pc.if_else(is_record, pa.scalar(None, pa.string()), task)
    checked = validate(table.set_column(table.column_names.index("task"), "task", blanked), str(path))
    return checked.set_column(checked.column_names.index("task"), "task", task.combine_chunks().cast(pa.string()))
