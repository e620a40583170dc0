"""`conductor run`: plan, execute, grade and store a query set in one command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from conductor.errors import ConductorError
from conductor.failures import failed_plans, format_failures, max_failed_share, too_many_failed
from conductor.planners import PLANNERS
from conductor.rewards import RewardScheme
from conductor.runner import RunConfig, run_all


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="plan and run a query set against a worker pool",
                       description="Plan every query, run the plans against the pool, grade, and store "
                                   "plans, traces, results and rewards under DATA_DIR/runs/RUN_ID. "
                                   "Rerunning the same command resumes an interrupted run.")
    p.add_argument("queries", type=Path, help="Parquet query set (query_id, prompt, [task, reference, metadata])")
    p.add_argument("--pool", type=Path, required=True, help="pool file (YAML)")
    p.add_argument("--samples", "-k", type=int, default=1, help="plans per query (K>1 for RL rollouts)")
    p.add_argument("--run-id", help="name of the run (default: derived from the inputs, so a rerun resumes)")
    p.add_argument("--data-dir", type=Path, default=Path("data"), help="where runs, cache and catalog live")
    p.add_argument("--planner", choices=PLANNERS, default="embedded",
                   help="embedded: templates scored by the pool's skills and prices (no model); "
                        "vllm: a local model on vLLM's offline engine, whole batches per call; "
                        "llm: any chat model through litellm, called like a worker (limits, budget, cache)")
    p.add_argument("--planner-model", metavar="MODEL",
                   help="vllm: model path or name; llm: litellm model string (e.g. openai/gpt-4o), or "
                        "use --planner-option worker=<id> for a pool worker of kind planner")
    p.add_argument("--planner-option", action="append", default=[], metavar="KEY=VALUE",
                   help="planner setting, repeatable (e.g. cost_weight=20, mode=free, dtype=float16, "
                        "structured=on, api_base=http://127.0.0.1:8000/v1)")
    p.add_argument("--max-steps", type=int, default=5, help="most steps a plan may have")
    p.add_argument("--max-depth", type=int, default=1,
                   help="re-planning levels: a step given to a planner worker runs a new workflow one level "
                        "deeper, and no deeper than this (0: no re-planning)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, help="USD cap for this run, on top of the pool's provider budgets")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the response cache")
    p.add_argument("--refresh", action="store_true", help="ignore cached responses; store the fresh ones")
    p.add_argument("--cost-penalty", type=float, default=0.0, help="reward points subtracted per USD")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--max-failed-share", type=float, metavar="SHARE",
                   help="exit 4 when more than this share of plans failed (default 0.05, or "
                        "$CONDUCTOR_MAX_FAILED_SHARE); a rerun retries transient failures")
    p.add_argument("--retry-failed", action="store_true",
                   help="rerun every failed plan, also those whose failure is final (401/403/404, bad requests)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    options = parse_options(args.planner_option)
    if args.planner_model:
        if args.planner == "embedded":
            raise ConductorError("--planner-model needs --planner vllm or --planner llm "
                                 "(the embedded planner uses no model)")
        options["model"] = args.planner_model
    if args.planner == "vllm" and "model" not in options:
        raise ConductorError("--planner vllm needs --planner-model (a model path or name vLLM can load)")
    cfg = RunConfig(
        queries=args.queries, pool=args.pool, data_dir=args.data_dir, run_id=args.run_id,
        samples=args.samples, planner=args.planner, planner_options=options, seed=args.seed,
        max_steps=args.max_steps, max_depth=args.max_depth, cache=not args.no_cache, refresh=args.refresh,
        budget_usd=args.budget, retry_failed=args.retry_failed,
        rewards=RewardScheme(cost_penalty=args.cost_penalty), progress=not args.quiet,
    )
    threshold = max_failed_share(args.max_failed_share)
    summary = run_all(cfg)
    print(format_summary(summary))
    if summary.get("failures"):
        print("\nfailures by worker and kind:\n" + format_failures(summary["failures"]))
    if too_many_failed(summary["statuses"], threshold):
        failed, total = failed_plans(summary["statuses"])
        print(f"\nconductor: {failed} of {total} plans failed ({failed / total:.1%}, more than "
              f"{threshold:.1%}). Fix the cause above and rerun the same command: finished steps are kept, and "
              f"transient failures are retried.", file=sys.stderr)
        return 4
    blocked = summary["statuses"].get("budget_exhausted", 0)
    if blocked:
        print(f"\n{blocked} plan(s) stopped by a budget. Raise it (pool file or --budget) and rerun the "
              f"same command: finished work is kept and only those plans run.")
        return 3
    return 0


def parse_options(items: list[str]) -> dict:
    import yaml

    out = {}
    for item in items:
        if "=" not in item:
            raise ConductorError(f"--planner-option {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out


def format_summary(s: dict) -> str:
    def money(x):
        return "unknown" if x is None else f"${x:.6f}"

    def num(x, fmt="{:.1f}"):
        return "n/a" if x is None else fmt.format(x)

    rows = [
        ("run", s["run_id"] + ("  (resumed)" if s.get("resumed") else "")),
        ("queries", s["queries"]),
        ("plans", s["plans"]),
        ("valid plans", f"{s['valid_plans']} ({s['valid_plans'] / max(s['plans'], 1):.1%})"),
        ("plan statuses", ", ".join(f"{k} {v}" for k, v in sorted(s["statuses"].items()))),
        ("calls", f"{s['calls']}  (cache hits {s['cache_hits']})"),
        ("accuracy", "n/a (nothing graded)" if s["accuracy"] is None else f"{s['accuracy']:.3f} over {s['graded']} graded plans"),
        ("cost", f"{money(s['cost_usd'])} total, {money(s['cost_per_query_usd'])} per query"
                 + (f" (planning {money(s['planning_cost_usd'])})" if s.get("planning_cost_usd") else "")
                 + (f"  ({s['plans_without_price']} plan(s) with unknown price)" if s["plans_without_price"] else "")),
        ("tokens per query", num(s["tokens_per_query"])),
        ("wall time", num(s["wall_time_s"], "{:.1f} s")),
    ]
    for cap in s.get("spend", []):
        if cap["limit_usd"] is not None:
            rows.append((f"budget {cap['cap']}", f"${cap['spent_usd']:.6f} of ${cap['limit_usd']:.6f}"))
    rows += [("outputs", s["outputs"]), ("catalog", s.get("catalog", ""))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
