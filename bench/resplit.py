"""Is a policy's result on the test split the luck of one split? Train and test it on many
random halves of a recorded table, in memory, and count how often it meets the targets.

    python bench/resplit.py                                   # mmlu_pro, segment by category, 10 halves
    python bench/resplit.py --splits 20 --folds 1 5 --floors -0.01 0
    python bench/resplit.py --within train --floors --budgets 0.15 0.5      # the budgets only
    python bench/resplit.py --floors --budgets 0.15 --ship-margins 0 0.5 1  # how sure before shipping
    python bench/resplit.py --within train --floors --budgets 0.15 --shrinks 0  # groups without shrinkage

Per split (the table's own train/test split first, then --splits random halves, each a
salted hash of the question id): every candidate action of the pool is played on every
question of the table's recorded answers by the executor's rules
(`conductor.replay.offline`), which is what the sweep of `bench/policy.py` logs on train;
the workers' skills that shape the action set are measured on that split's train half
only; then per selection rule (`--folds`: 1 holds back a quarter of train once, K >= 2
holds back every train query once in K parts) and per objective (each of --floors, then
each of --budgets), `conductor.policy.training.fit_policy`
trains exactly as `conductor policy train` does, and the shipped policy is scored on the
test half against the best single chosen on the train half, by the same grader.

`--within train` draws the halves from the table's train split alone, so settings can be
chosen by how often they meet the targets there without reading any test outcome.

The first row should reproduce `bench/policy.py`'s figures for the same learner and objective
(the pipeline's are through the replay server); the random halves say how far one
split's verdict carries.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

TARGETS = {"mmlu_pro": ["-0.01:0.15", "0:0.5"], "gsm8k": ["0:0.25"]}


def main(argv: list[str] | None = None) -> int:
    from conductor import argtypes
    from conductor.policy.training import TrainConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--dataset", default="mmlu_pro", choices=sorted(TARGETS))
    ap.add_argument("--replay-dir", type=argtypes.path, default=None,
                    help="folder of the shared tables (default: $CONDUCTOR_REPLAY_DIR, else ../shared/replay)")
    ap.add_argument("--splits", type=argtypes.int_in(0, 10_000), default=10,
                    help="random halves besides the table's own split")
    ap.add_argument("--learner", default="segment", choices=("segment", "table", "fixed"),
                    help="the per-query learner (vw is too slow to fit this many times)")
    ap.add_argument("--group-by", default="category", metavar="FIELD")
    ap.add_argument("--folds", nargs="+", type=argtypes.int_in(1, 1000), default=[1, 5],
                    help="selection rules to compare: 1 (a held-back quarter) or K parts (default: 1 5)")
    ap.add_argument("--floors", nargs="*", type=argtypes.number_in(-0.99, 0.99), default=[-0.01, 0.0])
    ap.add_argument("--budgets", nargs="*", type=argtypes.number_in(0.001, 1000.0), default=[],
                    help="cost caps, shares of the best single's cost (objectives besides the floors)")
    ap.add_argument("--ship-margins", nargs="+", type=argtypes.number_in(0.0, 1000.0),
                    default=[TrainConfig.ship_margin], metavar="SE",
                    help="ship rules to compare: the learned policy ships only if better than the fixed action "
                         "by this many paired SEs on the held-back queries (default: `policy train`'s)")
    ap.add_argument("--shrinks", nargs="+", type=argtypes.number_in(0.0, 1e9), default=None, metavar="K",
                    help="the segment learner's weights of the task-wide logs to cross-fit (default: its own; "
                         "0 alone: each group chooses on its own logs)")
    ap.add_argument("--within", choices=("train", "test"), default=None,
                    help="draw the halves from one split of the table only: `train` chooses settings without "
                         "ever reading the test split's outcomes")
    ap.add_argument("--out", type=argtypes.path, default=None, help="also write the Markdown here")
    args = ap.parse_args(argv)
    if args.shrinks is not None and args.learner != "segment":
        ap.error("--shrinks is the segment learner's (--learner segment)")
    if args.out is not None and not args.out.parent.is_dir():
        ap.error(f"--out {args.out}: no folder {args.out.parent} to write it in")
    if not args.floors and not args.budgets:
        ap.error("nothing to train: give --floors or --budgets")

    from conductor.replay.datasets import default_replay_dir

    replay_dir = args.replay_dir or default_replay_dir()
    if not (Path(replay_dir) / f"{args.dataset}.parquet").is_file():
        print(f"shared replay table {args.dataset}.parquet not found in {replay_dir}; "
              f"pass --replay-dir DIR or set $CONDUCTOR_REPLAY_DIR", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    game = Game(args.dataset, Path(replay_dir), args.group_by if args.learner == "segment" else None, args.within)
    print(f"{args.dataset}: {len(game.queries)} questions, {len(game.pool.workers)} workers "
          f"({time.monotonic() - t0:.0f} s to load and grade)", flush=True)
    targets = TARGETS[args.dataset]
    rows = []
    for s in range(-1 if args.within is None else 0, args.splits):
        name = "the table's split" if s < 0 else f"half {s}"
        train_ids = game.train_ids(None if s < 0 else f"resplit-{s}")
        for folds in args.folds:
            for objective, target in objectives(args):
                r = game.score(train_ids, args.learner, target, folds)
                r.update(split=name, folds=folds, objective=objective)
                r["met"] = [t for t in targets if meets(r["shipped"], t)]
                rows.append(r)
                print(f"  {name}, folds {folds}, {objective}: ships {r['ships']} "
                      f"{cell(r['shipped'])}; learned {cell(r['learned'])}; fixed {cell(r['fixed'])}; "
                      f"meets {', '.join(r['met']) or 'nothing'}", flush=True)
    text = report(rows, args, targets, time.monotonic() - t0)
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
    return 0


def objectives(args) -> list[tuple[str, dict]]:
    """(label, TrainConfig fields) per objective: the floors, then the budgets, each under
    every ship margin (named in the label only when there are several)."""
    shrinks = {} if args.shrinks is None else {"shrinks": tuple(args.shrinks)}
    goals = ([(f"floor {f:+g}", {"floor": f, **shrinks}) for f in args.floors]
             + [(f"budget {b:.0%}", {"budget": b, **shrinks}) for b in args.budgets])
    several = len(args.ship_margins) > 1
    return [(label + (f", margin {m:g} SE" if several else ""), {**fields, "ship_margin": m})
            for label, fields in goals for m in args.ship_margins]


class Game:
    """Every action's outcome on every question of one recorded table, computed once."""

    def __init__(self, dataset: str, replay_dir: Path, group_by: str | None, within: str | None = None):
        import orjson

        from conductor.policy.features import FeatureSettings, context
        from conductor.pool import load_pool
        from conductor.replay.build import pool_document, query_table, write_pool
        from conductor.replay.offline import Recorded
        from conductor.replay.tables import read_table, replay_workers, table_spec
        from conductor.runner import planning_pool

        spec = table_spec(dataset=dataset, replay_dir=replay_dir)
        with tempfile.TemporaryDirectory() as tmp:  # the server's address is never contacted
            self.pool = planning_pool(load_pool(write_pool(Path(tmp) / "pool.yaml", pool_document(spec))))
        self.queries = query_table(spec, within or "all").to_pylist()
        self.task = self.queries[0]["task"]
        if any(q["task"] != self.task for q in self.queries):
            raise SystemExit("one task per table here")
        self.features = FeatureSettings(group_by=group_by)
        self.context = {q["query_id"]: context(q["prompt"], q["task"], self.features, q["metadata"])
                        for q in self.queries}
        self.split = {q["query_id"]: orjson.loads(q["metadata"])["split"] for q in self.queries}
        self.recorded = Recorded(spec.path, self.pool, {q["query_id"]: q["reference"] for q in self.queries},
                                 self.task)
        # The recorded labels, as the pool's skills are measured (build.pool_document).
        worker_of = {m: wid for wid, m in replay_workers(self.pool).items()}
        labels = read_table(spec.path, ["question_id", "model", "correct"]).select("question_id", "model", "correct")
        self.labels = {(worker_of[m], q): bool(c) for q, m, c in labels.iter_rows() if m in worker_of}
        self.allowed = self.pool.servable_questions()
        self.played: dict[str, dict] = {}

    def train_ids(self, salt: str | None) -> set[str]:
        ids = [q["query_id"] for q in self.queries]
        if salt is None:
            return {q for q in ids if self.split[q] == "train"}
        return {q for q in ids
                if int.from_bytes(hashlib.sha256(f"{salt}:{q}".encode()).digest()[:8], "big") < 2 ** 63}

    def outcome(self, action) -> dict:
        if action.key not in self.played:
            self.played[action.key] = self.recorded.play(action, [q["query_id"] for q in self.queries])
        return self.played[action.key]

    def actions(self, train_ids: set[str]) -> list:
        """The pool's action set with skills (label accuracy) measured on this train half only."""
        from conductor.policy.actions import action_set

        workers = []
        for w in self.pool.workers:
            if w.kind == "llm":
                got = [self.labels[(w.id, q)] for q in train_ids if (w.id, q) in self.labels]
                w = replace(w, skills={self.task: sum(got) / len(got) if got else None})
            workers.append(w)
        return action_set(replace(self.pool, workers=workers), self.task)

    def score(self, train_ids: set[str], learner: str, target: dict, folds: int) -> dict:
        from conductor.policy.actions import servable
        from conductor.policy.learner import Logged, best_singles
        from conductor.policy.training import TrainConfig, fit_policy

        actions = self.actions(train_ids)
        cands = {q["query_id"]: servable(actions, self.allowed.get(q["prompt"])) for q in self.queries}
        examples = []
        for q in sorted(train_ids):
            for i, a in enumerate(cands[q]):
                correct, usd, _ = self.outcome(a)[q]
                examples.append(Logged(self.context[q], cands[q], i, 1 / len(cands[q]), 0.0, correct, usd, q))
        cfg = TrainConfig(pool=Path("-"), runs=[], learner=learner, folds=folds, **target,
                          features=self.features)
        fitted = fit_policy(cfg, examples)
        best = best_singles(examples)[self.task][0]
        test = [q["query_id"] for q in self.queries if q["query_id"] not in train_ids]

        def on_test(policy) -> dict[str, tuple[bool, float]]:
            out = {}
            for q in test:
                i = policy.greedy(self.context[q], cands[q])
                out[q] = self.outcome(cands[q][i])[q][:2] if i >= 0 else (False, 0.0)
            return out

        base = {q: self.outcome(next(a for a in actions if a.key == best))[q][:2] for q in test}
        learned, fixed = on_test(fitted.learner), on_test(fitted.fixed)
        ships = fitted.selection["shipped"]
        return {"best_single": best, "best": figures(base, base), "ships": ships,
                "learned": figures(learned, base), "fixed": figures(fixed, base),
                "shipped": figures(learned if ships == "learned" else fixed, base)}


def figures(got: dict[str, tuple[bool, float]], base: dict[str, tuple[bool, float]]) -> dict:
    """Accuracy and USD per query, and the paired accuracy difference from the best single
    with its standard error, and the cost as a share of the best single's."""
    from conductor.policy.training import paired_diff

    qs = sorted(got)
    m, se = paired_diff(got, base, 0)
    usd, base_usd = (sum(x[q][1] for q in qs) / len(qs) for x in (got, base))
    return {"accuracy": sum(got[q][0] for q in qs) / len(qs), "usd": usd, "diff": m, "se": se,
            "share": usd / base_usd if base_usd else math.inf}


def meets(f: dict, target: str) -> bool:
    delta, share = (float(x) for x in target.split(":"))
    return f["diff"] >= delta - 1e-12 and f["share"] <= share + 1e-12


def cell(f: dict) -> str:
    return f"{f['diff']:+.4f} ± {f['se']:.4f} at {f['share']:.1%}"


def report(rows: list[dict], args, targets: list[str], seconds: float) -> str:
    lines = [f"### {args.dataset}: learner {args.learner}"
             + (f" by {args.group_by}" if args.learner == "segment" else "")
             + (f", shrinks {' '.join(f'{k:g}' for k in args.shrinks)}" if args.shrinks is not None else "")
             + (f", {args.splits} random halves of the {args.within} split" if args.within
                else f", {args.splits} random halves and the table's split") + f" ({seconds:.0f} s)", "",
             "Shipped policy on each test half, against the best single chosen on its train half "
             "(accuracy difference ± paired SE, cost share).", "",
             "| split | folds | objective | ships | shipped | learned | fixed | meets |",
             "|---|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['split']} | {r['folds']} | {r['objective']} | {r['ships']} | "
                     f"{cell(r['shipped'])} | {cell(r['learned'])} | {cell(r['fixed'])} | {', '.join(r['met']) or '—'} |")
    lines += ["", "Over the random halves only (the table's own split left out); in brackets, how often the "
              "learned policy alone would meet it:", "",
              "| folds | objective | ships learned | mean difference | mean share | "
              + " | ".join(f"meets {t}" for t in targets) + " |",
              "|---:|---|---:|---:|---:|" + "---:|" * len(targets)]
    halves = sorted({r["split"] for r in rows if r["split"] != "the table's split"})
    any_met = {}
    for folds in args.folds:
        mine = [r for r in rows if r["folds"] == folds and r["split"] != "the table's split"]
        for objective, _ in objectives(args):
            rs = [r for r in mine if r["objective"] == objective]
            if not rs:
                continue
            n = len(rs)
            lines.append(f"| {folds} | {objective} | {sum(r['ships'] == 'learned' for r in rs)}/{n} | "
                         f"{sum(r['shipped']['diff'] for r in rs) / n:+.4f} | "
                         f"{sum(r['shipped']['share'] for r in rs) / n:.1%} | "
                         + " | ".join(f"{sum(t in r['met'] for r in rs)}/{n} "
                                      f"({sum(meets(r['learned'], t) for r in rs)}/{n})" for t in targets) + " |")
        any_met[folds] = {t: sum(any(t in r["met"] for r in mine if r["split"] == h) for h in halves)
                          for t in targets}
    for folds, met in any_met.items():
        lines.append(f"\nfolds {folds}: halves where some objective's shipped policy meets each target: "
                     + ", ".join(f"{t} {v}/{len(halves)}" for t, v in met.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
