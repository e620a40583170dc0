"""Plans per second: one batched vLLM call for the whole query set against one call per query.

    python bench/planner.py                      # tiny random Qwen2 built in a temp dir
    python bench/planner.py --model /path/to/model --dtype bfloat16 --queries 500

Both runs use the same loaded engine, the same queries and the same sampling
settings; a short warm-up call runs first so neither pays for compilation.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: conductor, tests.tinymodel
from conductor.argtypes import int_in  # noqa: E402

TASKS = ["math", "choice", "exact", None]
POOL = {"workers": [
    {"id": "qwen-small", "model": "openai/qwen-small", "description": "Fast small model, good at arithmetic."},
    {"id": "llama-large", "model": "openai/llama-large", "description": "Strong general model, slower."},
    {"id": "mistral-mid", "model": "openai/mistral-mid", "description": "Mid-size model for multiple choice."},
    {"id": "vote", "kind": "function", "function": "vote"},
]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", help="model directory or name (default: build a tiny random Qwen2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--queries", type=int_in(1, 10 ** 6), default=500)
    ap.add_argument("--samples", type=int_in(1, 4096), default=4)
    ap.add_argument("--mode", choices=["structured", "free"], default="structured")
    ap.add_argument("--instruction-chars", type=int_in(1, 100_000), default=80)
    ap.add_argument("--max-tokens", type=int_in(1, 10 ** 6), default=None,
                    help="default: the schema's bound (structured), 64 (free)")
    ap.add_argument("--max-model-len", type=int_in(1, 10 ** 7), default=4096)
    ap.add_argument("--no-logprobs", action="store_true", help="do not record cumulative log-probabilities")
    ap.add_argument("--single-limit", type=int_in(1, 10 ** 6), default=None,
                    help="time only this many one-call-per-query plans and scale up (default: all)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                    help="extra vllm.LLM argument, e.g. max_num_seqs=512 (repeatable)")
    args = ap.parse_args(argv)
    engine_kwargs = {}
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--engine-arg {item!r}: expected KEY=VALUE")
        try:
            engine_kwargs[key] = json.loads(value)
        except ValueError:
            engine_kwargs[key] = value

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from conductor.planners import prompt as P
    from conductor.planners.base import Query
    from conductor.planners.vllm import VLLMPlanner, VLLMPlannerConfig
    from conductor.plans import parse_plan
    from conductor.errors import PlanError
    from conductor.pool import parse_pool

    pool = parse_pool(POOL)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tests.tinymodel import build_tiny_qwen2

            corpus = [P.system_prompt(pool, m, instruction_chars=args.instruction_chars) for m in P.MODES]
            model = str(build_tiny_qwen2(Path(tmp) / "tiny-qwen2", extra_text=corpus))
        max_tokens = args.max_tokens if args.max_tokens or args.mode == "structured" else 64
        planner = VLLMPlanner(VLLMPlannerConfig(
            model=model, dtype=args.dtype, gpu_memory_utilization=0.2, max_model_len=args.max_model_len,
            mode=args.mode, instruction_chars=args.instruction_chars, max_tokens=max_tokens,
            logprobs=not args.no_logprobs, engine_kwargs=engine_kwargs))
        queries = [Query(f"q{i}", f"Question {i}: what is {i} plus {3 * i}?", TASKS[i % 4], index=i)
                   for i in range(args.queries)]
        try:
            planner.engine()
            planner.plan(queries[:4], pool, args.samples)  # warm-up

            start = time.perf_counter()
            batched = planner.plan(queries, pool, args.samples)
            t_batch = time.perf_counter() - start

            single_qs = queries[: args.single_limit or len(queries)]
            start = time.perf_counter()
            single = [planner.plan([q], pool, args.samples)[0] for q in single_qs]
            t_single = time.perf_counter() - start
        finally:
            planner.close()

    def valid(drafts: list[list]) -> float:
        ok = total = 0
        for ds in drafts:
            for d in ds:
                total += 1
                try:
                    parse_plan(d.text, pool)
                    ok += 1
                except PlanError:
                    pass
        return 100.0 * ok / max(total, 1)

    n_batch = sum(len(d) for d in batched)
    n_single = sum(len(d) for d in single)
    rate_batch, rate_single = n_batch / t_batch, n_single / t_single
    tokens = sum(d.completion_tokens or 0 for ds in batched for d in ds)
    print(f"\nmodel: {model if args.model else 'tiny random Qwen2 (built here)'}   mode: {args.mode}   "
          f"engine load: {planner.load_seconds:.1f} s")
    print(f"{'run':<18}{'calls':>7}{'queries':>9}{'plans':>8}{'seconds':>10}{'plans/s':>10}{'valid %':>9}")
    print(f"{'one batched call':<18}{1:>7}{len(queries):>9}{n_batch:>8}{t_batch:>10.2f}{rate_batch:>10.1f}"
          f"{valid(batched):>9.1f}")
    print(f"{'call per query':<18}{len(single_qs):>7}{len(single_qs):>9}{n_single:>8}{t_single:>10.2f}"
          f"{rate_single:>10.1f}{valid(single):>9.1f}")
    print(f"\nbatched / per-query plans per second: {rate_batch / rate_single:.1f}x   "
          f"(batched completion tokens/s: {tokens / t_batch:.0f})")
    print("command:", shlex.join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
