"""The shared replay tables (real recorded model outputs), read-only.

A replay table holds one row per (question, model): the question exactly as the
model saw it, the model's full response, the gold answer and the benchmark's own
correctness label. Nothing in it is copied into the repository: pool files and
query sets that point at it are written under data/ at run time.

Splits are a pure function of the question id (see `split_of`), so every command
and the learned policy agree on which questions are for training and which for
reporting, whatever file they start from.
"""

from __future__ import annotations

import csv
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from conductor.errors import ConductorError, PoolError
from conductor.pool import Pool, Worker

# Replay table stem -> the task its answers are graded as.
DATASETS = {"gsm8k": "math", "mmlu_pro": "choice"}
REPLAY_ENV = "CONDUCTOR_REPLAY_DIR"
REQUIRED_COLUMNS = ("question_id", "question", "reference", "model", "response", "correct")
# Recorded usage, when a table has it; the shared tables do not, so usage is estimated.
TOKEN_COLUMNS = ("prompt_tokens", "completion_tokens")

# Split: sha256("<salt>:<question_id>"), first 8 bytes as a fraction of 2**64; below
# TRAIN_FRACTION is train. 50/50 keeps a test set large enough to compare policies.
SPLIT_SALT = "conductor-replay-split-v1"
TRAIN_FRACTION = 0.5
SPLITS = ("all", "train", "test")

REPLAY_KEYS = {"dataset", "table", "task", "prices", "split", "skills"}


def default_replay_dir() -> Path:
    """$CONDUCTOR_REPLAY_DIR, else the `shared/replay` folder beside the repository."""
    env = os.environ.get(REPLAY_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "replay"


def split_of(question_id: str) -> str:
    """'train' or 'test', fixed forever by the question id."""
    h = int.from_bytes(hashlib.sha256(f"{SPLIT_SALT}:{question_id}".encode()).digest()[:8], "big")
    return "train" if h < TRAIN_FRACTION * 2**64 else "test"


def table_path(replay_dir: Path, dataset: str) -> Path:
    if dataset not in DATASETS:
        raise ConductorError(f"--dataset {dataset!r}: unknown (choose from {', '.join(DATASETS)})")
    if not Path(replay_dir).is_dir():
        raise ConductorError(f"replay folder {replay_dir} not found: pass --replay-dir DIR or set ${REPLAY_ENV}")
    path = Path(replay_dir) / f"{dataset}.parquet"
    if not path.is_file():
        raise ConductorError(f"replay table {path} not found")
    return path


def read_table(path: Path, columns: list[str] | None = None) -> pl.DataFrame:
    """The replay table (or some of its columns), checked for the columns replay needs.

    Adds `split`; keeps the table's row order, which fixes which row answers a
    question asked twice under two ids (the first)."""
    path = Path(path)
    try:
        schema = pl.read_parquet_schema(path)
    except Exception as e:  # polars raises several types for a bad file
        raise ConductorError(f"replay table {path}: not a readable Parquet file ({e})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in schema]
    if missing:
        raise ConductorError(f"replay table {path}: missing column(s) {', '.join(missing)}")
    wanted = list(schema) if columns is None else list(dict.fromkeys(
        [*columns, "question_id", *(c for c in TOKEN_COLUMNS if c in schema)]))
    table = pl.read_parquet(path, columns=wanted)
    ids = table.get_column("question_id").unique()
    splits = pl.DataFrame({"question_id": ids, "split": [split_of(q) for q in ids.to_list()]})
    return table.join(splits, on="question_id", how="left", maintain_order="left")


# ---------------------------------------------------------------- prices


def read_prices(path: Path) -> dict[str, tuple[float, float, str]]:
    """model -> (input USD per Mtok, output USD per Mtok, basis), from prices.csv."""
    path = Path(path)
    if not path.is_file():
        raise ConductorError(f"price table {path} not found")
    out: dict[str, tuple[float, float, str]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        need = {"model", "input_usd_per_mtok", "output_usd_per_mtok"}
        if not need <= set(reader.fieldnames or ()):
            raise ConductorError(f"price table {path}: needs columns {', '.join(sorted(need))}")
        for line, row in enumerate(reader, start=2):
            try:
                out[row["model"]] = (float(row["input_usd_per_mtok"]), float(row["output_usd_per_mtok"]),
                                     (row.get("basis") or "").strip())
            except (TypeError, ValueError):
                raise ConductorError(f"price table {path}, line {line}: prices must be numbers") from None
    return out


# ---------------------------------------------------------------- the pool's replay block


@dataclass(frozen=True)
class ReplaySource:
    """What a pool's `replay:` block says: which table its workers answer from."""

    dataset: str
    table: Path
    task: str | None


def replay_source(pool: Pool) -> ReplaySource:
    """Validate `pool.replay`; relative table paths are relative to the pool file."""
    raw = pool.replay
    where = f"pool file {pool.path}: replay" if pool.path else "replay"
    if raw is None:
        raise PoolError(f"{where.rsplit(':', 1)[0]}: not a replay pool (no replay: block); "
                        f"write one with `conductor replay pool`")
    unknown = sorted(set(map(str, raw)) - REPLAY_KEYS)
    if unknown:
        raise PoolError(f"{where}.{unknown[0]}: unknown field (allowed: {', '.join(sorted(REPLAY_KEYS))})")
    dataset = raw.get("dataset")
    if not isinstance(dataset, str) or not dataset:
        raise PoolError(f"{where}.dataset: required (a name such as gsm8k)")
    table = raw.get("table")
    if not isinstance(table, str) or not table:
        raise PoolError(f"{where}.table: required (path of the replay Parquet table)")
    path = Path(os.path.expandvars(table)).expanduser()
    if not path.is_absolute() and pool.path:
        path = Path(pool.path).resolve().parent / path
    if not path.is_file():
        raise PoolError(f"{where}.table: {path} not found")
    split = raw.get("split")
    if split is not None and split != {"salt": SPLIT_SALT, "train_fraction": TRAIN_FRACTION}:
        # The skills were measured on a train split: it must be the one this code reports against.
        raise PoolError(f"{where}.split: {split!r} is not this version's split (salt {SPLIT_SALT}, "
                        f"train_fraction {TRAIN_FRACTION}); rewrite the pool with `conductor replay pool`")
    task = raw.get("task", DATASETS.get(dataset))
    if task is not None and task not in ("math", "choice", "exact"):
        raise PoolError(f"{where}.task: must be math, choice or exact (got {task!r})")
    return ReplaySource(dataset, path, task)


def recorded_model(worker: Worker) -> str | None:
    """The table's model name a worker replays: its model after 'openai/'."""
    if worker.kind != "llm" or not worker.model or not worker.model.startswith("openai/"):
        return None
    return worker.model.split("/", 1)[1] or None


def replay_workers(pool: Pool) -> dict[str, str]:
    """worker id -> recorded model name, for the pool's replayable llm workers."""
    return {w.id: m for w in pool.workers if (m := recorded_model(w)) is not None}


def servable(pool: Pool) -> dict[str, frozenset[str]]:
    """question text -> ids of the pool's workers that have a recorded response to it.

    The planner uses this to plan only steps the replay server can answer."""
    source = replay_source(pool)
    by_model: dict[str, list[str]] = {}
    for wid, model in replay_workers(pool).items():
        by_model.setdefault(model, []).append(wid)
    if not by_model:
        return {}
    t = pl.read_parquet(source.table, columns=["question", "model"]).filter(
        pl.col("model").is_in(list(by_model))).unique()
    out: dict[str, set[str]] = {}
    for q, m in t.iter_rows():
        out.setdefault(q, set()).update(by_model[m])
    return {q: frozenset(ws) for q, ws in out.items()}


def estimate_tokens(chars: Any) -> Any:
    """Characters / 4 rounded half to even (unbiased): the usage the replay server
    reports when the table records none. Takes an int or a polars expression."""
    if isinstance(chars, int):
        return round(chars / 4)
    return (chars / 4).round(0).cast(pl.Int64)
