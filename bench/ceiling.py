"""Can any fixed cascade or vote reach a target at all? The most accurate ones under a cost
bound on one split, searched with hindsight on that split: a ceiling for what choosing on
train can find, never a way to choose (that would be tuning on test).

    python bench/ceiling.py                                   # mmlu_pro, test split, <= 15%, within 1 point
    python bench/ceiling.py --work data/bench-policy/gsm8k --share 0.25 --delta 0

Run after `bench/policy.py` for the dataset: it reads the work folder's train and test
query sets, its pool and the sweep run (each worker's mean cost per query on train, as the
pipeline priced it), and the recorded table. Each worker's answers are the recorded
responses graded by `conductor.grading`, as the replay server and `eval` grade them.

Searched: cascades of 1-3 first workers and up to 3 escalations among the cheap workers
and the best single (the next escalation runs while the answers so far disagree, then
while they have no majority; the answer is the last step's), and majority votes of 3-5
cheap workers (a tie goes to the first listed). Cheap: the workers that cost at most the
bound alone, the --cheap most accurate on train. The best single is chosen on train.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from conductor.grading import extract_answer, grade  # noqa: E402


def answers(table: Path, queries: list[dict], task: str) -> tuple[dict, dict]:
    """Per worker, per query id: the extracted answer and whether it is correct."""
    by_prompt = {q["prompt"]: q for q in queries}
    ans: dict[str, dict[str, str | None]] = defaultdict(dict)
    ok: dict[str, dict[str, bool]] = defaultdict(dict)
    for r in pq.read_table(table, columns=["question", "model", "response"]).to_pylist():
        q = by_prompt.get(r["question"])
        if q is not None:
            ans[r["model"]][q["query_id"]] = extract_answer(r["response"], task)
            ok[r["model"]][q["query_id"]] = grade(task, r["response"], q["reference"]).correct
    return ans, ok


def sweep_costs(work: Path) -> dict[str, float]:
    """Each worker's mean cost per query on train, from the sweep's single-worker plans."""
    from conductor.policy.training import TrainConfig, collect
    from conductor.pool import load_pool
    from conductor.runner import planning_pool

    cfg = TrainConfig(pool=work / "pool.yaml", runs=["sweep"], data_dir=work / "data")
    costs: dict[str, list[float]] = defaultdict(list)
    for e in collect(cfg, planning_pool(load_pool(cfg.pool))).examples:
        action = e.actions[e.chosen]
        if action.shape == "single":
            costs[action.workers[0]].append(e.cost)
    return {w: sum(c) / len(c) for w, c in costs.items()}


def cascade(ids, ans, ok, first, escalation):
    """Accuracy and mean cost-units (worker calls by name) of one cascade over `ids`."""
    correct, calls = 0, Counter()
    for q in ids:
        asked = list(first)
        for e in escalation:
            counts = Counter(ans[w].get(q) for w in asked)
            settled = len(counts) == 1 if len(asked) == len(first) else counts.most_common(1)[0][1] * 2 > len(asked)
            if settled:
                break
            asked.append(e)
        calls.update(asked)
        correct += ok[asked[-1]].get(q, False)
    return correct / len(ids), calls


def vote(ids, ans, ok, group):
    correct = 0
    for q in ids:
        said = [ans[w].get(q) for w in group]
        counts = Counter(a for a in said if a is not None)
        if not counts:
            continue
        top = counts.most_common(1)[0][1]
        pick = next(a for a in said if a is not None and counts[a] == top)
        correct += ok[next(w for w in group if ans[w].get(q) == pick)].get(q, False)
    return correct / len(ids), Counter({w: len(ids) for w in group})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=REPO / "data" / "bench-policy" / "mmlu_pro")
    ap.add_argument("--table", type=Path, default=None, help="recorded table (default: the shared replay table)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--share", type=float, default=0.15, help="cost bound, a share of the best single's cost")
    ap.add_argument("--delta", type=float, default=-0.01, help="accuracy needed: the best single's + delta")
    ap.add_argument("--cheap", type=int, default=7)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    dataset = args.work.name
    table = args.table or REPO.parent / "shared" / "replay" / f"{dataset}.parquet"
    for need in (args.work / f"{dataset}-train.parquet", args.work / f"{dataset}-{args.split}.parquet", table):
        if not need.exists():
            sys.exit(f"{need} is missing: run bench/policy.py --datasets {dataset} first (or give --work/--table)")
    train_q = pq.read_table(args.work / f"{dataset}-train.parquet").to_pylist()
    split_q = pq.read_table(args.work / f"{dataset}-{args.split}.parquet").to_pylist()
    task = split_q[0]["task"]
    cost = sweep_costs(args.work)
    t_ans, t_ok = answers(table, train_q, task)
    ans, ok = answers(table, split_q, task)
    t_ids, ids = [q["query_id"] for q in train_q], [q["query_id"] for q in split_q]
    workers = sorted(w for w in cost if w in ans)
    train_acc = {w: sum(t_ok[w].get(q, False) for q in t_ids) / len(t_ids) for w in workers}
    best = max(workers, key=lambda w: (train_acc[w], -cost[w]))
    best_acc = sum(ok[best].get(q, False) for q in ids) / len(ids)
    bound, need = args.share * cost[best], best_acc + args.delta
    cheap = sorted((w for w in workers if w != best and cost[w] <= bound), key=lambda w: -train_acc[w])[:args.cheap]
    print(f"{dataset}, {args.split} split ({len(ids)} queries): best single on train {best}, "
          f"{best_acc:.4f} on {args.split} at ${cost[best]:.6f}; needs {need:.4f} at <= ${bound:.6f} "
          f"({args.share:.0%}); cheap workers: {', '.join(cheap)}")

    found = []
    def keep(name, acc, calls):
        usd = sum(n * cost[w] for w, n in calls.items()) / len(ids)
        if usd <= bound:
            found.append((acc, usd, name))

    for k in (2, 3):
        for first in itertools.combinations(cheap, k):
            rest = [w for w in cheap + [best] if w not in first]
            for n in (1, 2, 3):
                for esc in itertools.permutations(rest, n):
                    keep(f"cascade:{'+'.join(first)}>{'>'.join(esc)}", *cascade(ids, ans, ok, first, esc))
    for k in (3, 4, 5):
        for lead in cheap:
            for others in itertools.combinations([w for w in cheap if w != lead], k - 1):
                keep(f"vote:{'+'.join((lead, *others))}", *vote(ids, ans, ok, (lead, *others)))
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
