"""`conductor graders check`: how often the graders agree with a table's own
correctness labels (the shared replay tables, or any table with a label column),
what kinds of disagreement there are, and every row where they do not agree, for a
reader to judge."""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from pathlib import Path

from conductor import argtypes
from conductor.errors import ConductorError
from conductor.grading import TASKS
from conductor.replay.datasets import DATASETS, DEFAULT_DIR_HELP, REPLAY_ENV, default_replay_dir

_TAIL = 160
_CSV_TAIL = 600


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("graders", help="check the answer graders against recorded, labelled model outputs")
    actions = p.add_subparsers(dest="graders_command", metavar="ACTION", required=True)
    c = actions.add_parser("check", help="agreement of the graders with a table's correctness labels",
                           description="Grade every recorded response and compare with the table's own "
                                       "correctness label: the shared replay tables (default), or any table "
                                       "with a label column (--table).")
    c.add_argument("--table", type=argtypes.path, default=None,
                   help="any Parquet or CSV table with response, reference and label columns")
    c.add_argument("--task", default=None, help=f"task of rows without a 'task' column value ({', '.join(TASKS)})")
    c.add_argument("--response-col", default="response")
    c.add_argument("--reference-col", default="reference")
    c.add_argument("--label-col", default="correct")
    c.add_argument("--replay-dir", "--replay", dest="replay", type=argtypes.path, default=None,
                   help=f"folder with gsm8k.parquet and mmlu_pro.parquet (default: {DEFAULT_DIR_HELP})")
    c.add_argument("--dataset", choices=(*DATASETS, "all"), default=None,
                   help="which shared table (default: all); not with --table")
    c.add_argument("--limit", type=argtypes.int_in(1, 2 ** 63 - 1), default=None, help="grade only the first N rows of each table")
    c.add_argument("--examples", type=argtypes.int_in(0, 10 ** 9), default=3, help="examples printed per kind of disagreement (default 3)")
    c.add_argument("--out", type=argtypes.path, default=None, help="write every disagreement to this CSV file")
    c.set_defaults(func=main, resumes=False)  # the check keeps nothing: it starts over


def main(args: argparse.Namespace) -> int:
    from conductor.agreement import check, check_table

    if args.table is not None and (args.dataset is not None or args.replay is not None):
        raise ConductorError("--table checks that one table: leave out --dataset and --replay-dir")
    names = list(DATASETS) if args.dataset in (None, "all") else [args.dataset]
    replay = args.replay or default_replay_dir()
    if args.table is None and not replay.is_dir():  # said before --out's folder is made
        raise ConductorError(f"replay folder {replay} not found: pass --replay DIR or --table PATH, "
                             f"or set ${REPLAY_ENV}")
    if args.out is not None:  # before the grading, which takes a while on the shared tables
        inputs = ({"--table": args.table} if args.table is not None
                  else {f"the replay table {n}": replay / f"{n}.parquet" for n in names})
        _check_out(args.out, inputs)
    if args.table is not None:
        results = [check_table(args.table, task=args.task, limit=args.limit, response_col=args.response_col,
                               reference_col=args.reference_col, label_col=args.label_col)]
    else:
        results = [check(replay, name, args.limit) for name in names]
    for r in results:
        tasks = ", ".join(f"{t} {n}" for t, n in sorted(r.tasks.items()))
        notes = ([f"{r.unlabelled} unlabelled row(s) left out"] if r.unlabelled else []) + (
            [f"{r.unreferenced} row(s) with no reference: not graded"] if r.unreferenced else [])
        skipped = f" ({'; '.join(notes)})" if notes else ""
        print(f"{r.dataset} ({tasks}): {r.rows} rows{skipped}, agreement {r.rate:.2%}, "
              f"{len(r.disagreements)} disagreement(s), graded in {r.seconds:.1f} s")
        for kind, n in r.kinds().most_common():
            print(f"  {n:6d}  {kind}")
    for r in results:
        if not r.disagreements:
            continue
        print(f"\n{r.dataset} disagreements, up to {args.examples} per kind: "
              "question_id | model | task | reference | extracted | label | verdict | response tail")
        shown: Counter = Counter()
        for d in r.disagreements:
            if shown[d.kind] >= args.examples:
                continue
            shown[d.kind] += 1
            print(f"[{d.kind}] " + " | ".join((d.question_id, d.model, str(d.task), _tail(d.reference, 60),
                                               repr(d.answer)[:80], _tf(d.label), _tf(d.verdict),
                                               _tail(d.response, _TAIL))))
    if args.out:
        from conductor.cli.replay import _writing
        from conductor.store import replacing

        with _writing(args.out), replacing(args.out) as tmp:  # a failed write leaves the old file whole
            _write_csv(tmp, [d for r in results for d in r.disagreements])
        print(f"\nwrote {sum(len(r.disagreements) for r in results)} disagreement(s) to {args.out}")
    return 0


def _check_out(path: Path, inputs: dict[str, Path | None]) -> None:
    """--out is never an input (the table it checks would be lost), nor a folder, and can be
    written: said before the grading, not after it."""
    import os

    from conductor.cli.replay import _writable, _writing

    _writable(path, **inputs)
    probe = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # the name the write renames from
    with _writing(path):
        probe.touch()
        probe.unlink()


def _write_csv(path: Path, rows: list) -> None:
    with open(path, "w", newline="", encoding="utf-8", errors="replace") as f:  # lone surrogates survive
        w = csv.writer(f)
        w.writerow(["dataset", "question_id", "model", "task", "kind", "reference", "extracted", "label", "verdict",
                    "detail", "response_tail"])
        for d in rows:
            w.writerow([d.dataset, d.question_id, d.model, d.task or "", d.kind, d.reference, d.answer or "",
                        _tf(d.label), _tf(d.verdict), d.detail or "", d.response[-_CSV_TAIL:]])


def _tf(v: bool | None) -> str:
    return "none" if v is None else ("correct" if v else "wrong")


def _tail(text: str, n: int) -> str:
    flat = " ".join(text.encode("utf-8", "replace").decode("utf-8").split())
    return ("…" + flat[-n:]) if len(flat) > n else flat
