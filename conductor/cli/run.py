"""`conductor run`: plan, execute, grade and store a query set in one command."""

from __future__ import annotations

import argparse
import sys

from conductor import argtypes
from conductor.cli import options
from conductor.errors import ConductorError
from conductor.planners import PLANNERS
from conductor.execute.shared.objects import store_url


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="plan and run a query set against a worker pool",
                       description="Plan every query, run the plans against the pool, grade, and store "
                                   "plans, traces, results and rewards under DATA_DIR/runs/RUN_ID. "
                                   "Rerunning the same command resumes an interrupted run. Exit status: 0 done, "
                                   "2 bad input or configuration (this command called no worker), 3 some plans (or the LLM "
                                   "planner's calls) stopped by a budget, 4 more than --max-failed-share of plans "
                                   "failed, or LLM planning failed after its calls, 5 a storage error "
                                   "(free space and rerun), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM): rerun to resume.")
    p.add_argument("queries", type=argtypes.path, help="Parquet query set (query_id, prompt, [task, reference, metadata])")
    options.pool(p)
    p.add_argument("--samples", "-k", type=int, default=1,
                   help="plans per query, 1 to 4096 (K>1 for RL rollouts; default 1)")
    options.run_id(p, "name of the run (default: derived from the inputs, so a rerun resumes)")
    options.data_dir(p)
    p.add_argument("--store", metavar="s3://BUCKET/PREFIX",
                   help="also keep the run on object storage (default: $CONDUCTOR_STORE): tables after every "
                        "stage, the journal while it runs; a run missing from --data-dir is fetched from it, "
                        "so a killed worker's run resumes on any machine")
    p.add_argument("--planner", choices=PLANNERS, default="embedded",
                   help="embedded (the default): templates scored by the pool's skills and prices (no model); "
                        "vllm: a local model on vLLM's offline engine, whole batches per call; "
                        "llm: any chat model through litellm, called like a worker (limits, budget, cache)")
    p.add_argument("--planner-model", metavar="MODEL",
                   help="vllm: model path or name; llm: litellm model string (e.g. openai/gpt-4o), or "
                        "use --planner-option worker=<id> for a pool worker of kind planner")
    p.add_argument("--planner-option", action="append", default=[], metavar="KEY=VALUE",
                   help="planner setting, repeatable (e.g. cost_weight=20, mode=free, dtype=float16, "
                        "structured=on, api_base=http://127.0.0.1:8000/v1)")
    options.max_steps(p)
    p.add_argument("--max-depth", type=int, default=1,
                   help="re-planning levels: a step given to a planner worker runs a new workflow one level "
                        "deeper, and no deeper than this (0: no re-planning; default 1)")
    options.seed(p, "random seed of the planners' sampling and of retry jitter, 0 or more; another seed is "
                    "another run (default 0)")
    p.add_argument("--budget", type=float, help="USD cap for this run, on top of the pool's provider budgets")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the response cache")
    p.add_argument("--refresh", action="store_true", help="ignore cached responses; store the fresh ones")
    options.cost_penalty(p)
    options.quiet(p)
    p.add_argument("--max-failed-share", type=argtypes.number_in(0.0, 1.0), metavar="SHARE",
                   help="exit 4 when more than this share of plans failed (default 0.05, or "
                        "$CONDUCTOR_MAX_FAILED_SHARE); a rerun retries transient failures")
    p.add_argument("--retry-failed", action="store_true",
                   help="rerun every failed plan, also those whose failure is final (401/403/404, bad requests)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from conductor.cli.render import run_summary
    from conductor.failures import failed_plans, format_failures, max_failed_share, retried_by_rerun
    from conductor.rewards import RewardScheme
    from conductor.runner import RunConfig, run_all

    planner_options = options.parse_options(args.planner_option)
    if args.planner_model:
        if args.planner == "embedded":
            raise ConductorError("--planner-model needs --planner vllm or --planner llm "
                                 "(the embedded planner uses no model)")
        planner_options["model"] = args.planner_model
    if args.planner == "vllm" and "model" not in planner_options:
        raise ConductorError("--planner vllm needs --planner-model (a model path or name vLLM can load)")
    threshold = max_failed_share(args.max_failed_share)
    cfg = RunConfig(
        queries=args.queries, pool=args.pool, data_dir=args.data_dir, run_id=args.run_id,
        samples=args.samples, planner=args.planner, planner_options=planner_options, seed=args.seed,
        max_steps=args.max_steps, max_depth=args.max_depth, cache=not args.no_cache, refresh=args.refresh,
        budget_usd=args.budget, retry_failed=args.retry_failed,
        rewards=RewardScheme(cost_penalty=args.cost_penalty), progress=not args.quiet,
        store=store_url(args.store), max_failed_share=threshold,
    )
    summary = run_all(cfg)
    print(run_summary(summary))
    for note in summary.get("notes") or ():  # a setting of this command that differs from the run's (runner)
        print(f"\nconductor: note: run {summary['run_id']}: {note}", file=sys.stderr)
    if summary.get("resumed") and (args.refresh or args.no_cache):
        flag = " ".join(f for f, on in (("--refresh", args.refresh), ("--no-cache", args.no_cache)) if on)
        print(f"\nconductor: note: run {summary['run_id']} existed, so this command resumed it: {flag} applies only "
              f"to the calls it sent, and plans finished before keep their answers. To ask every call again, "
              f"start a new run: --run-id NEW {flag}.", file=sys.stderr)
    if summary.get("failures"):
        print("\nfailures by worker and kind:\n" + format_failures(summary["failures"], retried=args.retry_failed))
    if summary.get("invalid_plans"):
        print("\ninvalid plans (no step ran), most common reasons:\n" + "\n".join(
            f"  {g['plans']} plan(s): {g['error']}" for g in summary["invalid_plans"]))
    if summary["exit_code"] == 4:  # decided, and kept in the summary, by the run (runner.exit_code)
        failed, total = failed_plans(summary["statuses"])
        invalid = summary["statuses"].get("invalid_plan", 0)
        # a rerun does not plan again (the plans are kept), so it cannot mend an invalid plan
        unplanned = (f" {invalid} of them are invalid plans, which a rerun does not plan again: --retry-failed asks "
                     f"the LLM planner again for those whose planning call failed; for the others, fix the cause "
                     f"and start a new run (another --run-id)." if invalid else "")
        groups = summary.get("failures") or []
        if any(g.get("journal_deleted") for g in groups):
            then = ("Fix the cause above and start a new run (another --run-id): this run's work folder was "
                    "deleted, so rerunning the same command executes nothing again.")
        elif groups and not any(retried_by_rerun(g) or g["failure"] == "budget" for g in groups):
            # a scheduler told to rerun the same command would loop on exit 4 for ever
            then = ("Fix the cause above, then rerun with --retry-failed: these failures are final (or were "
                    "retried on 3 reruns already), and a rerun without it retries none of them.")
        else:
            then = ("Fix the cause above and rerun the same command: finished steps are kept, and transient "
                    "failures are retried (each plan on up to 3 reruns; then --retry-failed).")
        # exit 3 is not given when exit 4 is: a wrapper reading only this line must still learn of a budget
        blocked = summary["statuses"].get("budget_exhausted", 0)
        budget = (f"; {blocked} more were stopped by a budget: raise it too (pool file or --budget)"
                  if blocked else "")
        print(f"\nconductor: {failed} of {total} plans failed ({failed / total:.1%}, more than "
              f"{threshold:.1%}){budget}. {then}{unplanned}", file=sys.stderr)
        return 4
    if summary["exit_code"] == 3:
        blocked = summary["statuses"].get("budget_exhausted", 0)
        print(f"\nconductor: {blocked} plan(s) stopped by a budget. Raise it (pool file or --budget) and rerun "
              f"the same command: finished work is kept and only those plans run.", file=sys.stderr)
        return 3
    return 0
