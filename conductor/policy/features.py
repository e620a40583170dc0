"""The policy's context: hashed word and character n-grams of the query text, its task,
and optionally its group (one field of the query's metadata, `group_by`).

Only what the planner sees before anything runs goes in: the prompt, the task
tag and the metadata. Never the reference answer, never an outcome. Hashing is
our own (crc32 of a namespaced token, modulo 2**bits), so the Vowpal Wabbit
learner and the numpy baselines see exactly the same features, and the settings
stored with an artifact reproduce them.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import asdict, dataclass

import orjson

_WORD = re.compile(r"[a-z]+|\d+|[^\sa-z\d]")
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class FeatureSettings:
    bits: int = 18  # hash space per namespace: 2**bits buckets
    word_ngrams: tuple[int, ...] = (1, 2)
    char_ngrams: tuple[int, ...] = (4,)
    max_chars: int = 300  # the question's start says what it is about; the rest adds noise and time
    length_buckets: bool = True  # log2 length of the text, in words (a difficulty proxy)
    group_by: str | None = None  # a metadata field naming the query's group (the `segment` learner's key)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "FeatureSettings":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        for k in ("word_ngrams", "char_ngrams"):
            if k in known:
                known[k] = tuple(known[k])
        return cls(**known)


@dataclass(frozen=True)
class Context:
    """Hashed features by namespace: t task, w words, c characters, l length; and the
    query's group when the settings name a metadata field (None where it has none)."""

    task: str | None
    namespaces: dict[str, tuple[int, ...]]
    values: dict[str, tuple[float, ...]]
    group: str | None = None


def context(text: str, task: str | None, settings: FeatureSettings = FeatureSettings(),
            metadata: str | None = None) -> Context:
    text = _SPACE.sub(" ", (text or "").lower()).strip()[: settings.max_chars]
    words = [_number(w) for w in _WORD.findall(text)]
    ns: dict[str, list[int]] = {"t": [_h("t", task or "none", settings.bits)], "w": [], "c": []}
    for n in settings.word_ngrams:
        for i in range(len(words) - n + 1):
            ns["w"].append(_h("w", " ".join(words[i:i + n]), settings.bits))
    padded = f" {text} "
    for n in settings.char_ngrams:
        for i in range(len(padded) - n + 1):
            ns["c"].append(_h("c", padded[i:i + n], settings.bits))
    if settings.length_buckets:
        ns["l"] = [_h("l", f"len{int(math.log2(1 + len(words)))}", settings.bits)]
    out, vals = {}, {}
    for name, idx in ns.items():
        counts: dict[int, int] = {}
        for i in idx:
            counts[i] = counts.get(i, 0) + 1
        keys = tuple(sorted(counts))
        # Unit length per namespace, so a long question does not outweigh its task.
        norm = math.sqrt(sum(c * c for c in counts.values())) or 1.0
        out[name] = keys
        vals[name] = tuple(counts[k] / norm for k in keys)
    return Context(task, out, vals, group_of(metadata, settings.group_by))


def group_of(metadata: str | None, field: str | None) -> str | None:
    """The value of `field` in the query's metadata (a JSON object), as text; None when
    no field is asked for, the query has no metadata, or the field is absent or null."""
    if not field or not metadata:
        return None
    try:
        value = orjson.loads(metadata)
    except orjson.JSONDecodeError:
        return None  # load_queries rejects such a query set; nothing to group by
    if not isinstance(value, dict) or value.get(field) is None:
        return None
    value = value[field]
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def _number(token: str) -> str:
    """Numbers by their digit count: '1250' -> '<4d>', so values do not fragment the vocabulary."""
    return f"<{len(token)}d>" if token.isdigit() else token


def _h(ns: str, token: str, bits: int) -> int:
    return zlib.crc32(f"{ns}\x00{token}".encode()) & ((1 << bits) - 1)
