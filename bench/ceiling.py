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
action runs as the executor runs its plan on the recorded responses: a step's condition
through the executor's `condition_holds`, the answer from the last step that ran. Cheap:
the workers that cost at most the bound alone, the --cheap most accurate on train.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from conductor.execute.engine import condition_holds  # noqa: E402
from conductor.functions import vote  # noqa: E402
from conductor.grading import answers_agree, grade  # noqa: E402
from conductor.plans import validate_plan  # noqa: E402
from conductor.pool import load_pool  # noqa: E402
from conductor.policy.actions import Action  # noqa: E402


def recorded(table: Path, pool, queries: list[dict], task: str) -> tuple[dict, dict]:
    """Per worker id, per query id: the recorded response and whether our grader marks it correct."""
    from conductor.replay.tables import replay_workers

    worker_of = {model: wid for wid, model in replay_workers(pool).items()}
    # By question id, the first row per model, as `eval` builds its table (two questions can share a text).
    by_id = {q["query_id"]: q for q in queries}
    text: dict[str, dict[str, str]] = defaultdict(dict)
    ok: dict[str, dict[str, bool]] = defaultdict(dict)
    for r in pq.read_table(table, columns=["question_id", "model", "response"]).to_pylist():
        q, wid = by_id.get(r["question_id"]), worker_of.get(r["model"])
        if q is not None and wid is not None and r["response"] is not None and q["query_id"] not in text[wid]:
            text[wid][q["query_id"]] = r["response"]
            ok[wid][q["query_id"]] = grade(task, r["response"], q["reference"]).correct
    return text, ok


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


class Replayed:
    """Actions run on the recorded responses with the executor's and vote's own rules."""

    def __init__(self, pool, text: dict, ok: dict, references: dict[str, str], task: str):
        self.pool, self.text, self.ok, self.references, self.task = pool, text, ok, references, task
        self.agree = functools.lru_cache(maxsize=None)(lambda a, b: answers_agree(task, a, b))

    def run(self, action: Action, ids: list[str]) -> tuple[float, Counter]:
        """Accuracy over `ids` and how many calls each worker got."""
        steps = action.steps("solve")
        plan = validate_plan(steps, self.pool, max_steps=len(steps))
        correct, calls = 0, Counter()
        for q in ids:
            outputs: dict[int, str] = {}
            for i, step in enumerate(plan.steps):
                if step.when is not None and not condition_holds(step.when, outputs, self.task, self.agree)[0]:
                    continue
                if step.worker == "vote":
                    try:
                        outputs[i] = vote([outputs[j] for j in step.access if j in outputs], self.task)
                    except ValueError:  # no answer to vote on: the plan fails, wrong
                        break
                    continue
                if q not in self.text[step.worker]:
                    break  # never recorded: the step fails, the plan is wrong (as `eval` counts it)
                calls[step.worker] += 1
                outputs[i] = self.text[step.worker][q]
            else:
                last = max(outputs, default=None)
                if last is not None:
                    worker = plan.steps[last].worker
                    correct += (grade(self.task, outputs[last], self.references[q]).correct if worker == "vote"
                                else self.ok[worker][q])
        return correct / len(ids), calls


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
    for need in (args.work / "pool.yaml", args.work / f"{dataset}-{args.split}.parquet", table):
        if not need.exists():
            sys.exit(f"{need} is missing: run bench/policy.py --datasets {dataset} first (or give --work/--table)")
    split_q = pq.read_table(args.work / f"{dataset}-{args.split}.parquet").to_pylist()
    task = split_q[0]["task"]
    pool = load_pool(args.work / "pool.yaml")
    cost, train_acc, best = on_train(args.work, pool, task)
    text, ok = recorded(table, pool, split_q, task)
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
    replayed = Replayed(pool, text, ok, {q["query_id"]: q["reference"] for q in split_q}, task)
    found = []
    for action in actions:
        if sum(cost[w] for w in action.solvers) > bound:
            continue  # its first calls alone are over the bound
        acc, calls = replayed.run(action, ids)
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
