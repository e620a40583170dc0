"""`conductor replay`: query sets, pool files and a server from the shared replay tables."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import orjson
import pyarrow.parquet as pq

from conductor.errors import ConductorError
from conductor.replay.tables import DATASETS, REPLAY_ENV, SPLITS, TRAIN_FRACTION, default_replay_dir


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay real recorded model outputs: query sets, pools, a server",
                       description="Work offline from the shared replay tables (real responses of real models "
                                   "to GSM8K and MMLU-Pro): write a query set, write a pool file whose workers "
                                   "are the recorded models, and serve their recorded responses.")
    actions = p.add_subparsers(dest="replay_command", metavar="ACTION", required=True)

    q = actions.add_parser("queries", help="write a query set: one query per recorded question",
                           description="query_id = question_id, prompt = the question exactly as the models saw "
                                       f"it. Splits are fixed by a hash of the question id ({TRAIN_FRACTION:.0%} "
                                       "train); learn on train, report on test.")
    _common(q)
    q.add_argument("--split", choices=SPLITS, default="all")
    q.add_argument("--out", type=Path, required=True, help="Parquet file to write (e.g. data/replay/gsm8k.parquet)")
    q.set_defaults(func=queries)

    pp = actions.add_parser("pool", help="write a pool file whose workers are the recorded models",
                            description="One llm worker per recorded model (priced from prices.csv, expected "
                                        "accuracy from the train split), plus the function workers vote and "
                                        "extract, and a replay: block naming the table. Written under data/; "
                                        "never commit it.")
    _common(pp)
    pp.add_argument("--out", type=Path, required=True, help="pool file to write (e.g. data/pools/replay-gsm8k.yaml)")
    pp.add_argument("--models", nargs="+", metavar="MODEL", help="only these recorded models (default: all)")
    pp.add_argument("--api-base", default=None,
                    help="the workers' api_base (default: ${CONDUCTOR_REPLAY_URL:-http://127.0.0.1:8912/v1})")
    pp.set_defaults(func=pool)

    s = actions.add_parser("serve", help="serve a replay pool's recorded responses (OpenAI-compatible, loopback)",
                           description="Answer each request with the recorded response of its model to its "
                                       "question; anything not recorded gets HTTP 422 'not recorded: ...'.")
    from conductor.replay.main import add_arguments, run

    add_arguments(s)
    s.set_defaults(func=run)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", choices=tuple(DATASETS), required=True)
    p.add_argument("--replay-dir", type=Path, default=None,
                   help=f"folder of the replay tables (default: ${REPLAY_ENV}, else ../shared/replay)")


def queries(args: argparse.Namespace) -> int:
    from conductor.queries import load_queries
    from conductor.replay.build import query_table

    table = query_table(args.replay_dir or default_replay_dir(), args.dataset, args.split)
    _writable(args.out)
    pq.write_table(table, args.out)
    table = load_queries(args.out)  # read back through the check every consumer uses
    splits = Counter(orjson.loads(m)["split"] for m in table.column("metadata").to_pylist())
    print(f"{args.out}  {table.num_rows} queries ({args.dataset}, task {DATASETS[args.dataset]}; "
          + ", ".join(f"{k} {v}" for k, v in sorted(splits.items())) + ")")
    return 0


def pool(args: argparse.Namespace) -> int:
    from conductor.pool import load_pool
    from conductor.replay.build import DEFAULT_URL, pool_document, write_pool

    doc = pool_document(args.replay_dir or default_replay_dir(), args.dataset, args.models,
                        args.api_base or DEFAULT_URL)
    _writable(args.out)
    write_pool(args.out, doc)
    loaded = load_pool(args.out)  # the file must load as any pool does
    n = sum(1 for w in loaded.workers if w.kind == "llm")
    print(f"{args.out}  {n} recorded models + vote, extract; table {doc['replay']['table']}")
    print(f"serve it with: conductor replay serve --pool {args.out}")
    return 0


def _writable(path: Path) -> None:
    if path.exists() and path.is_dir():
        raise ConductorError(f"--out {path}: is a folder; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConductorError(f"--out {path}: cannot create its folder ({e.strerror or e})") from None
