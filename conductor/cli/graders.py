"""`conductor graders check`: how often the graders agree with the replay tables'
own correctness labels, and every row where they do not, for a reader to judge."""

from __future__ import annotations

import argparse
import csv
import os
import time
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from conductor.errors import ConductorError
from conductor.grading import grade

DATASETS = {"gsm8k": "math", "mmlu_pro": "choice"}  # replay file stem -> task it is graded as
REPLAY_ENV = "CONDUCTOR_REPLAY_DIR"
_COLUMNS = ("question_id", "model", "reference", "response", "correct")
_TAIL = 160
_CSV_TAIL = 600


@dataclass(frozen=True)
class Disagreement:
    dataset: str
    question_id: str
    model: str
    reference: str
    answer: str | None
    label: bool
    verdict: bool | None
    response: str


@dataclass(frozen=True)
class Agreement:
    dataset: str
    rows: int
    agreeing: int
    seconds: float
    disagreements: list[Disagreement]

    @property
    def rate(self) -> float:
        return self.agreeing / self.rows if self.rows else 0.0


def default_replay_dir() -> Path:
    """$CONDUCTOR_REPLAY_DIR, else the `shared/replay` folder beside the repository."""
    env = os.environ.get(REPLAY_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "replay"


def check(replay_dir: Path, dataset: str, limit: int | None = None) -> Agreement:
    """Grade every response of one replay table and compare with its `correct` label."""
    path = replay_dir / f"{dataset}.parquet"
    if not path.is_file():
        raise ConductorError(f"replay table {path} not found")
    try:
        table = pl.read_parquet(path, n_rows=limit)
    except Exception as e:  # polars raises several types for a bad file
        raise ConductorError(f"replay table {path}: not a readable Parquet file ({e})") from None
    missing = [c for c in _COLUMNS if c not in table.columns]
    if missing:
        raise ConductorError(f"replay table {path}: missing column(s) {', '.join(missing)}")
    task = DATASETS[dataset]
    start = time.perf_counter()
    agreeing, bad = 0, []
    for row in table.select(_COLUMNS).iter_rows(named=True):
        g = grade(task, row["response"], row["reference"])
        if bool(g.correct) == bool(row["correct"]):
            agreeing += 1
            continue
        bad.append(Disagreement(dataset, str(row["question_id"]), str(row["model"]), str(row["reference"]),
                                g.answer, bool(row["correct"]), g.correct, row["response"] or ""))
    return Agreement(dataset, table.height, agreeing, time.perf_counter() - start, bad)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("graders", help="check the answer graders against recorded, labelled model outputs")
    actions = p.add_subparsers(dest="graders_command", metavar="ACTION", required=True)
    c = actions.add_parser("check", help="agreement of the graders with the replay tables' correctness labels")
    c.add_argument("--replay", type=Path, default=None,
                   help=f"folder with gsm8k.parquet and mmlu_pro.parquet (default: ${REPLAY_ENV}, "
                        "else ../shared/replay beside the repository)")
    c.add_argument("--dataset", choices=(*DATASETS, "all"), default="all")
    c.add_argument("--limit", type=int, default=None, help="grade only the first N rows of each table")
    c.add_argument("--out", type=Path, default=None, help="write the disagreements to this CSV file")
    c.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    replay = args.replay or default_replay_dir()
    if not replay.is_dir():
        raise ConductorError(f"replay folder {replay} not found: pass --replay DIR or set ${REPLAY_ENV}")
    if args.limit is not None and args.limit < 1:
        raise ConductorError(f"--limit must be at least 1 (got {args.limit})")
    names = list(DATASETS) if args.dataset == "all" else [args.dataset]
    results = [check(replay, name, args.limit) for name in names]
    for r in results:
        print(f"{r.dataset} ({DATASETS[r.dataset]}): {r.rows} rows, agreement {r.rate:.2%}, "
              f"{len(r.disagreements)} disagreement(s), graded in {r.seconds:.1f} s")
    for r in results:
        if r.disagreements:
            print(f"\n{r.dataset} disagreements: question_id | model | reference | extracted | label | verdict | response tail")
        for d in r.disagreements:
            print(" | ".join((d.question_id, d.model, d.reference, repr(d.answer), _tf(d.label), _tf(d.verdict),
                              _tail(d.response, _TAIL))))
    if args.out:
        _write_csv(args.out, [d for r in results for d in r.disagreements])
        print(f"\nwrote {sum(len(r.disagreements) for r in results)} disagreement(s) to {args.out}")
    return 0


def _write_csv(path: Path, rows: list[Disagreement]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["dataset", "question_id", "model", "reference", "extracted", "label", "verdict", "response_tail"])
        for d in rows:
            w.writerow([d.dataset, d.question_id, d.model, d.reference, d.answer or "", _tf(d.label),
                        _tf(d.verdict), d.response[-_CSV_TAIL:]])


def _tf(v: bool | None) -> str:
    return "none" if v is None else ("correct" if v else "wrong")


def _tail(text: str, n: int) -> str:
    flat = " ".join(text.split())
    return ("…" + flat[-n:]) if len(flat) > n else flat
