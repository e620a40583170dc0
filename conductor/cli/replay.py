"""`conductor replay`: query sets, pool files and a server from recorded model outputs
(the shared replay tables, or any table at any path), and a converter from wide tables."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections import Counter
from pathlib import Path

from conductor import argtypes
from conductor.errors import ConductorError
from conductor.grading import TASKS  # the tasks a replay table may name: the graders'
from conductor.replay.datasets import DATASETS, DEFAULT_DIR_HELP, SPLITS, TRAIN_FRACTION


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="replay real recorded model outputs: query sets, pools, a server",
                       description="Work offline from recorded model outputs (the shared GSM8K and MMLU-Pro "
                                   "tables, or any table of your own with --table): write a query set, write a "
                                   "pool file whose workers are the recorded models, serve their recorded "
                                   "responses; convert a wide table (one column per model) first.")
    actions = p.add_subparsers(dest="replay_command", metavar="ACTION", required=True)

    q = actions.add_parser("queries", help="write a query set: one query per recorded question",
                           description="query_id = question_id, prompt = the question exactly as the models saw "
                                       "it, task = the question's task. Splits are fixed by a hash of the question "
                                       f"id ({TRAIN_FRACTION:.0%} train); learn on train, report on test.")
    _common(q)
    q.add_argument("--split", choices=SPLITS, default="all")
    q.add_argument("--out", type=argtypes.path, required=True, help="Parquet file to write (e.g. data/replay/gsm8k.parquet)")
    q.set_defaults(func=queries)

    pp = actions.add_parser("pool", help="write a pool file whose workers are the recorded models",
                            description="One llm worker per recorded model (priced from the price table, or from "
                                        "the recorded cost_usd; expected accuracy per task from the train split), "
                                        "plus the function workers vote and extract, and a replay: block naming "
                                        "the table. Written under data/; never commit it.")
    _common(pp)
    pp.add_argument("--out", type=argtypes.path, required=True, help="pool file to write (e.g. data/pools/replay-gsm8k.yaml)")
    pp.add_argument("--models", nargs="+", metavar="MODEL", help="only these recorded models (default: all)")
    pp.add_argument("--prices", type=argtypes.path, default=None,
                    help="price table, CSV with model,input_usd_per_mtok,output_usd_per_mtok (default: prices.csv "
                         "in the replay folder). Models whose rows record cost_usd need no list price")
    pp.add_argument("--api-base", default=None,
                    help="the workers' api_base (default: ${CONDUCTOR_REPLAY_URL:-http://127.0.0.1:8912/v1})")
    pp.set_defaults(func=pool)

    s = actions.add_parser("serve", help="serve a replay pool's recorded responses (OpenAI-compatible, loopback)",
                           description="Answer each request with the recorded response of its model to its "
                                       "question; anything not recorded gets HTTP 422 'not recorded: ...'.")
    from conductor.replay.main import add_arguments, run

    add_arguments(s)
    s.set_defaults(func=run)

    c = actions.add_parser("convert", help="turn a wide table (one column per model, as RouterBench ships) "
                                           "into a replay table",
                           description="Reads a wide table (Parquet, CSV or JSON lines) with one row per prompt "
                                       "and, per model M, a score column M, a response column M<response-suffix> "
                                       "and a cost column M<cost-suffix>; writes the long replay table (one row "
                                       "per prompt and model: question_id, question, reference, model, response, "
                                       "correct, score, cost_usd, and task/category when given). The defaults "
                                       "follow RouterBench.")
    c.add_argument("--wide", type=argtypes.path, required=True, help="the wide table")
    c.add_argument("--out", type=argtypes.path, required=True, help="Parquet file to write (the replay table)")
    c.add_argument("--id-column", default="sample_id", help="question id column (default: sample_id)")
    c.add_argument("--prompt-column", default="prompt", help="question column (default: prompt)")
    c.add_argument("--reference-column", default=None,
                   help="gold answer column (default: none; RouterBench has none, so `correct` comes from the "
                        "score and the graders cannot re-grade the rows)")
    c.add_argument("--category-column", default="eval_name",
                   help="copied to `category` and matched by --task-map (default: eval_name; '' for none)")
    c.add_argument("--response-suffix", default="|model_response", help="default: '|model_response'")
    c.add_argument("--cost-suffix", default="|total_cost", help="default: '|total_cost' ('' for no costs)")
    c.add_argument("--models", nargs="+", metavar="MODEL", help="only these models (default: every column with a "
                                                                 "response column beside it)")
    c.add_argument("--threshold", type=float, default=None,
                   help="correct = score >= THRESHOLD (above 0, at most 1); required when scores lie strictly "
                        "between 0 and 1")
    c.add_argument("--task", choices=TASKS, default=None, help="the task of the rows --task-map leaves (all rows without --task-map)")
    c.add_argument("--task-map", action="append", default=[], metavar="PREFIX=TASK",
                   help="rows whose category starts with PREFIX get TASK (repeatable; the longest prefix wins), "
                        "e.g. --task-map grade-school-math=math --task-map mmlu=choice")
    c.set_defaults(func=convert)


def _common(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--table", type=argtypes.path, default=None,
                       help="the recorded table: a Parquet file at any path, one row per (question, model)")
    which.add_argument("--dataset", choices=tuple(DATASETS), default=None,
                       help="a shared table of the replay folder (gsm8k, mmlu_pro): a shortcut for --table")
    p.add_argument("--name", default=None,
                   help="the dataset's name in pool descriptions, run ids and reports (default: the file stem)")
    p.add_argument("--task", choices=TASKS, default=None,
                   help="task of rows that name none in a 'task' column (default for gsm8k: math, mmlu_pro: choice)")
    p.add_argument("--replay-dir", type=argtypes.path, default=None,
                   help=f"folder of the shared tables and prices.csv (default: {DEFAULT_DIR_HELP})")


def _spec(args: argparse.Namespace):
    from conductor.replay.tables import table_spec

    return table_spec(table=args.table, dataset=args.dataset, name=args.name, task=args.task,
                      prices=getattr(args, "prices", None), replay_dir=args.replay_dir)


def queries(args: argparse.Namespace) -> int:
    import orjson
    import pyarrow.parquet as pq

    from conductor.queries import load_queries, validate
    from conductor.replay.build import query_table, task_counts
    from conductor.store import replacing

    spec = _spec(args)
    _not_yaml(args.out, "a query set")
    _writable(args.out, **{"--table": spec.path})
    table = query_table(spec, args.split)
    validate(table, f"written from {spec.path}")  # before writing: a bad table must not replace a good file
    with _writing(args.out):
        with replacing(args.out) as tmp:
            pq.write_table(table, tmp)
    table = load_queries(args.out)  # read back through the check every consumer uses
    splits = Counter(orjson.loads(m)["split"] for m in table.column("metadata").to_pylist())
    print(f"{args.out}  {table.num_rows} queries ({spec.name}, {task_counts(table)}; "
          + ", ".join(f"{k} {v}" for k, v in sorted(splits.items())) + ")")
    _shared_note(spec.path)
    return 0


def pool(args: argparse.Namespace) -> int:
    from conductor.pool import load_pool
    from conductor.replay.build import DEFAULT_URL, pool_document, write_pool

    spec = _spec(args)
    _writable(args.out, **{"--table": spec.path, "--prices": spec.prices})
    if args.out.suffix.lower() == ".parquet":  # a pool file is YAML: likely the table's name given twice
        raise ConductorError(f"--out {args.out}: a pool file is YAML; give a .yaml name "
                             f"(e.g. data/pools/replay-{spec.name}.yaml)")
    doc = pool_document(spec, args.models, args.api_base or DEFAULT_URL)
    write_pool(args.out, doc)
    loaded = load_pool(args.out)  # the file must load as any pool does
    n = sum(1 for w in loaded.workers if w.kind == "llm")
    r = doc["replay"]
    print(f"{args.out}  {n} recorded models + vote, extract; {r['dataset']}, task {r['task']}; "
          f"table {r['table']}; costs: {r['costs']}")
    if "left out" in r["skills"]:  # rows with no `correct` label: no evidence, not counted as wrong
        print(f"skills: {r['skills']}")
    _shared_note(spec.path)
    print(f"serve it with: conductor replay serve --pool {args.out}")
    return 0


def convert(args: argparse.Namespace) -> int:
    from conductor.replay.convert import WideLayout, convert_wide, dropped_models, parse_task_map, read_wide
    from conductor.store import replacing

    layout = WideLayout(id_column=args.id_column, prompt_column=args.prompt_column,
                        reference_column=args.reference_column, category_column=args.category_column or None,
                        response_suffix=args.response_suffix, cost_suffix=args.cost_suffix or None)
    _not_yaml(args.out, "a replay table")
    _writable(args.out, **{"--wide": args.wide})
    wide = read_wide(args.wide)
    long = convert_wide(args.wide, layout, models=args.models, threshold=args.threshold, task=args.task,
                        task_map=parse_task_map(args.task_map), wide=wide)
    with _writing(args.out):
        with replacing(args.out) as tmp:
            long.write_parquet(tmp, compression="zstd")
    models = long.get_column("model").n_unique()
    questions = long.get_column("question_id").n_unique()
    costed = long.height - long.get_column("cost_usd").null_count()
    print(f"{args.out}  {long.height} rows: {questions} questions x {models} models; cost_usd on {costed} rows; "
          f"reference {'from ' + args.reference_column if args.reference_column else 'none (correct from the score)'}")
    dropped = [] if args.models else dropped_models(wide.columns, layout)
    if dropped:
        print(f"not converted, a cost column but no response column M{layout.response_suffix}: {', '.join(dropped)} "
              f"(name theirs so, or pick models with --models)")
    unscored = long.get_column("correct").null_count()
    if unscored:  # a response without a score: no label, left out of every figure by the labels
        print(f"{unscored} row(s) with a response but no score: correct is empty (no label) there")
    untasked = _untasked(long)
    if untasked:  # `replay pool` would refuse them: said here, where the fix is one flag
        print(untasked)
    print(f"next: conductor replay pool --table {args.out} --out data/pools/replay-{args.out.stem}.yaml")
    return 0


def _shared_note(path: Path) -> None:
    """Says which ids share a question text (with one reference and task: others are refused),
    since the replay server, seeing only the text, answers all of them with the first id's rows."""
    import polars as pl

    from conductor.replay.tables import read_columns, shared_texts

    groups = shared_texts(read_columns(path, ["question_id", "question"]).cast(pl.String))
    if groups:
        shown = "; ".join(", ".join(g) for g in groups[:3]) + (f" and {len(groups) - 3} more" if len(groups) > 3 else "")
        print(f"note: {len(groups)} question text(s) recorded under more than one id ({shown}): the replay server "
              f"answers each text with its first id's recorded responses, for all its ids")


def _untasked(long) -> str | None:
    """Rows --task-map gave no task to (no --task for the rest): what the next command needs."""
    import polars as pl

    if "task" not in long.columns or not long.get_column("task").null_count():
        return None
    rows = long.filter(pl.col("task").is_null())
    cats = (rows.get_column("category").cast(pl.String).fill_null("").unique(maintain_order=True).to_list()
            if "category" in rows.columns else [])
    shown = (f" (categories {', '.join(repr(c) for c in cats[:5])}{f' and {len(cats) - 5} more' if len(cats) > 5 else ''})"
             if cats else "")
    return (f"{rows.height} of {long.height} row(s) matched no --task-map prefix and have no task{shown}: "
            f"give them one with --task here, or --task on each `conductor replay` command that reads the table")


def _not_yaml(path: Path, what: str) -> None:
    """A query set or replay table is Parquet: a .yaml --out is likely the pool's name, given in the
    wrong place (`replay pool` refuses the mirror case)."""
    if path.suffix.lower() in (".yaml", ".yml"):
        raise ConductorError(f"--out {path}: {what} is Parquet, and a .yaml name is a pool file's; give a "
                             f".parquet name (e.g. {path.with_suffix('.parquet')})")


@contextlib.contextmanager
def _writing(path: Path):
    """A write to --out that fails (/proc/x.parquet, a read-only place) is an error naming it."""
    try:
        yield
    except OSError as e:
        raise ConductorError(f"--out {path}: cannot write it ({e.strerror or e})") from None


def _writable(path: Path, **inputs: Path | None) -> None:
    """A file --out may write: not a folder, and never one of the command's inputs (flag -> path),
    which would be lost."""
    if path.exists() and path.is_dir():
        raise ConductorError(f"--out {path}: is a folder; give a file name")
    for flag, src in inputs.items():
        if src is not None and path.exists() and Path(src).exists() and os.path.samefile(path, src):
            raise ConductorError(f"--out {path}: is the same file as {flag} {src}; it would be overwritten, "
                                 f"write to another file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConductorError(f"--out {path}: cannot create its folder ({e.strerror or e})") from None
