"""Can any fixed cascade or vote reach a target at all? The most accurate ones under a cost
bound on one split, searched with hindsight on that split: a ceiling for what choosing on
train can find, never a way to choose (that would be tuning on test).

    python bench/ceiling.py                                   # mmlu_pro, test split, <= 15%, within 1 point
    python bench/ceiling.py --work data/bench-policy/gsm8k --share 0.25 --delta 0

Run after `bench/policy.py` for the dataset: it reads the work folder's pool, its query
set of the split, the sweep run on train (each worker's mean cost and accuracy per query,
and the best single, as training measures them) and the recorded table. Each worker's
answers on the split are its recorded responses, graded by `conductor.grading` as the
replay server and `eval` grade them.

Searched: the policy's own cascade and vote actions (`conductor.policy.actions.Action`):
cascades of 2-3 first workers escalating to one or two workers among the cheap ones and
the best single, and votes of 3-5 cheap workers through the `vote` function worker. Each
action runs as the executor runs its plan on the recorded responses
(`conductor.replay.offline`). Cheap: the workers that cost at most the bound alone, the
--cheap most accurate on train.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from conductor import argtypes  # noqa: E402
from conductor.policy.actions import Action  # noqa: E402
from conductor.pool import load_pool  # noqa: E402
from conductor.replay.datasets import default_replay_dir  # noqa: E402
from conductor.replay.offline import Recorded  # noqa: E402


def on_train(work: Path, pool, task: str) -> tuple[dict[str, float], dict[str, float], str]:
    """From the sweep run on train, measured as training measures it: each worker's mean
    cost and accuracy per query, and the best single worker (`learner.best_singles`)."""
    from conductor.policy.learner import action_means, best_singles
    from conductor.policy.training import TrainConfig, collect
    from conductor.runner import planning_pool

    cfg = TrainConfig(pool=work / "pool.yaml", runs=["sweep"], data_dir=work / "data")
    examples = collect(cfg, planning_pool(pool)).examples
    single = len("single:")
    acc, cost = (action_means(examples, f)[task] for f in ("correct", "cost"))
    return ({a[single:]: v for a, v in cost.items() if a.startswith("single:")},
            {a[single:]: v for a, v in acc.items() if a.startswith("single:")},
            best_singles(examples)[task][0][single:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=argtypes.path, default=REPO / "data" / "bench-policy" / "mmlu_pro")
    ap.add_argument("--table", type=argtypes.path, default=None,
                    help="recorded table (default: the shared one in $CONDUCTOR_REPLAY_DIR, else ../shared/replay)")
    ap.add_argument("--split", default="test", choices=("all", "train", "test"))
    ap.add_argument("--share", type=argtypes.number_in(0.001, 1000.0), default=0.15,
                    help="cost bound, a share of the best single's cost")
    ap.add_argument("--delta", type=argtypes.number_in(-1.0, 1.0), default=-0.01,
                    help="accuracy needed: the best single's + delta")
    ap.add_argument("--cheap", type=argtypes.int_in(1, 1000), default=7, help="cheap workers searched")
    ap.add_argument("--top", type=argtypes.int_in(1, 10 ** 6), default=8, help="actions listed")
    args = ap.parse_args()
    if not args.work.is_dir():
        ap.error(f"--work {args.work}: no such folder; run bench/policy.py --datasets {args.work.name} first, "
                 f"or give its dataset folder")
    if args.table is not None and not args.table.is_file():
        ap.error(f"--table {args.table}: no such file")
    dataset = args.work.name
    table = args.table or default_replay_dir() / f"{dataset}.parquet"
    for need in (args.work / "pool.yaml", args.work / f"{dataset}-{args.split}.parquet", table):
        if not need.exists():
            sys.exit(f"{need} is missing: run bench/policy.py --datasets {dataset} first (or give --work/--table)")
    split_q = pq.read_table(args.work / f"{dataset}-{args.split}.parquet").to_pylist()
    task = split_q[0]["task"]
    pool = load_pool(args.work / "pool.yaml")
    cost, train_acc, best = on_train(args.work, pool, task)
    replayed = Recorded(table, pool, {q["query_id"]: q["reference"] for q in split_q}, task)
    text, ok = replayed.text, replayed.ok
    ids = [q["query_id"] for q in split_q]
    best_acc = sum(ok[best].get(q, False) for q in ids) / len(ids)
    bound, need = args.share * cost[best], best_acc + args.delta
    cheap = sorted((w for w in cost if w in text and w != best and cost[w] <= bound), key=lambda w: -train_acc[w])[:args.cheap]
    print(f"{dataset}, {args.split} split ({len(ids)} queries): best single on train {best}, "
          f"{best_acc:.4f} on {args.split} at ${cost[best]:.6f}; needs {need:.4f} at <= ${bound:.6f} "
          f"({args.share:.0%}); cheap workers: {', '.join(cheap)}")

    actions = [Action("cascade", first, None, esc) for k in (2, 3) for first in itertools.combinations(cheap, k)
               for n in (1, 2) for esc in itertools.permutations([w for w in cheap + [best] if w not in first], n)]
    actions += [Action("ensemble", (lead, *others), "vote") for k in (3, 4, 5) for lead in cheap
                for others in itertools.combinations([w for w in cheap if w != lead], k - 1)]
    found = []
    for action in actions:
        if sum(cost[w] for w in action.solvers) > bound:
            continue  # its first calls alone are over the bound
        played = replayed.play(action, ids).values()
        acc = sum(correct for correct, _, _ in played) / len(ids)
        calls = sum((c for _, _, c in played), Counter())
        usd = sum(n * cost[w] for w, n in calls.items()) / len(ids)
        if usd <= bound:
            found.append((acc, usd, action.key))
    found.sort(reverse=True)
    print(f"\n{len(found)} cascades and votes within the bound; the most accurate on {args.split}:\n")
    print("| accuracy | gap to the need | USD / query | share | action |\n|---:|---:|---:|---:|---|")
    for acc, usd, name in found[:args.top]:
        print(f"| {acc:.4f} | {acc - need:+.4f} | ${usd:.6f} | {usd / cost[best]:.1%} | `{name}` |")
    reached = bool(found) and found[0][0] >= need - 1e-12
    print(f"\nceiling: {'reached' if reached else 'NOT reached'} by a fixed cascade or vote chosen with hindsight "
          f"on {args.split} (best {found[0][0]:.4f} against {need:.4f})" if found else "\nnothing within the bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
