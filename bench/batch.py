"""Batch-mode benchmark: N steps through the simulated server's OpenAI Batch API.

Each scenario runs N/2 two-step plans (solve, then check: two stages) in a child
process that drives the executor as `conductor run` does (conductor.execute.context),
with the provider in `mode: batch`, and prints one table:
  1. resume: the child is SIGKILLed once its first batch is submitted (journaled), and
     run again on the same work folder: steps completed, lost, batches the server
     created and how often each input was submitted, cost from the server's request
     log x prices against the online price (ratio 0.5)
  2. faults, retried online: batch_expire (a share of every batch left undone, the
     batch ends "expired") and per-line 500s; the failed lines go online
  3. the same faults, retried in new batches

Run from the repository root:  .venv/bin/python bench/batch.py [--steps 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import orjson  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import yaml  # noqa: E402

from conductor.argtypes import int_in, number_in  # noqa: E402

PRICE_IN, PRICE_OUT = 1.0e-6, 2.0e-6  # USD per token, the pool's online price
CHECK = "Check the answer above. If it is right, restate it; if not, solve it. End with 'Answer: <number>'."


def prompt(i: int) -> str:
    return f"Question {i}: what is {i} plus {i * 7 % 13}? Give the number."


def queries(path: Path, n: int) -> Path:
    """n distinct prompts the server knows, so every request is a different call."""
    pq.write_table(pa.table({"query_id": [f"b{i:07d}" for i in range(n)], "prompt": [prompt(i) for i in range(n)],
                             "task": ["math"] * n, "reference": [str(i + i * 7 % 13) for i in range(n)]}), path)
    return path


def client_pool(url: str, retry: str, poll_s: float):
    from conductor.pool import parse_pool

    return parse_pool({"providers": {"sim": {
        "mode": "batch", "batch_poll_s": poll_s, "batch_collect_s": 1.0, "batch_retry": retry, "max_attempts": 10,
        "timeout_s": 60, "max_concurrency": 64}},
        "workers": [{"id": name, "model": f"openai/{name}", "provider": "sim", "api_base": url,
                     "price": {"input_per_mtok": PRICE_IN * 1e6, "output_per_mtok": PRICE_OUT * 1e6},
                     "params": {"temperature": 0, "max_tokens": 128}} for name in ("fast", "weak")]})


def child(args: argparse.Namespace) -> None:
    """One attempt at the run (a rerun on the same folder resumes it), as `conductor run` executes."""
    from conductor.execute.context import ExecutionContext
    from conductor.execute.engine import ExecOptions, PlanJob
    from conductor.execute.journal import load_state
    from conductor.plans import Plan, Step

    work = Path(args.work)
    state = load_state(work)
    pool = client_pool(args.url, args.retry, args.poll_s)

    def jobs():
        for i in range(args.plans):
            p = prompt(i)
            yield PlanJob(f"p{i}", f"b{i:07d}", i, 0, "math", p,
                          Plan((Step("fast", p, ()), Step("weak", CHECK, (0,)))))

    with ExecutionContext(work, pool, ExecOptions(run_id="batch-bench"), state=state) as ex:
        asyncio.run(ex.run(jobs(), state))
    print("PEAK_MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, flush=True)


def run_child(url: str, work: Path, plans: int, retry: str, poll_s: float,
              kill_after_batches: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "child", "--url", url, "--work", str(work), "--plans", str(plans),
           "--retry", retry, "--poll-s", str(poll_s)]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    killed = False
    if kill_after_batches is not None:
        journal = work / "batches.jsonl"
        while proc.poll() is None:
            if journal.exists() and journal.read_bytes().count(b'"event":"submitted"') >= kill_after_batches:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.01)
    out, err = proc.communicate()
    if not killed and proc.returncode != 0:
        raise SystemExit(f"the child run failed ({proc.returncode}):\n{err.decode()[-3000:]}")
    peak = [float(x.split()[1]) for x in out.decode().splitlines() if x.startswith("PEAK_MB")]
    return {"seconds": time.perf_counter() - t, "killed": killed, "peak_mb": peak[0] if peak else None}


def journal(work: Path) -> tuple[list[dict], list[dict]]:
    steps = [orjson.loads(x) for x in (work / "steps.jsonl").read_bytes().splitlines()]
    plans = [orjson.loads(x) for x in (work / "plans.jsonl").read_bytes().splitlines()]
    return steps, plans


def figures(sim_log: dict, work: Path, n_plans: int) -> dict:
    steps, plans = journal(work)
    ok = {(s["plan_id"], s["step_path"]) for s in steps if s["status"] == "ok"}
    paid = [s for s in steps if s["attempts"] and not s["cache_hit"]]
    run_cost = sum(s["cost_usd"] or 0.0 for s in paid)

    def usd(tokens: dict) -> float:
        return sum(p * PRICE_IN + c * PRICE_OUT for p, c in tokens.values())

    batch_online_price = usd(sim_log["batch_billed_tokens"])
    online = usd(sim_log["billed_tokens"])
    return {
        "steps": 2 * n_plans, "completed": len(ok), "lost": 2 * n_plans - len(ok),
        "plans_ok": sum(p["status"] == "ok" for p in plans),
        "retried_steps": sum(1 for s in paid if s["attempts"] > 1),
        "batches_created": sim_log["batches_created"],
        "most_submissions_of_one_input": max(sim_log["batch_submissions"].values(), default=0),
        "batch_lines": sim_log["batch_lines"], "online_requests": sim_log["total"],
        "run_cost": run_cost,
        # what the server processed, at the online price and at the run's prices (batch lines at half)
        "server_at_online_price": batch_online_price + online,
        "server_at_run_prices": batch_online_price / 2 + online,
        "cost_ratio": run_cost / (batch_online_price + online) if batch_online_price + online else None,
    }


def scenario(sim, tmp: Path, name: str, plans: int, retry: str, poll_s: float, kill: bool = False,
             **faults: float) -> dict:
    sim.reset()
    sim.clear_faults()
    if faults:
        sim.set_faults(**faults)
    work = tmp / name
    runs = []
    if kill:
        runs.append(run_child(sim.url, work, plans, retry, poll_s, kill_after_batches=1))
        if not runs[-1]["killed"]:
            raise SystemExit("the run finished before its first batch was journaled; raise --delay-s")
    runs.append(run_child(sim.url, work, plans, retry, poll_s))
    out = figures(sim.log(), work, plans)
    out["seconds"] = sum(r["seconds"] for r in runs)
    out["peak_mb"] = max((r["peak_mb"] or 0) for r in runs)
    out["killed"] = kill
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("child")
    c.add_argument("--url", required=True)
    c.add_argument("--work", required=True)
    c.add_argument("--plans", type=int_in(1, 10 ** 8), required=True)
    c.add_argument("--retry", default="online", choices=("online", "batch"))
    c.add_argument("--poll-s", type=number_in(0.01, 3600.0), default=0.5)
    ap.add_argument("--steps", type=int_in(2, 10 ** 8), default=10_000, help="steps per scenario (two per plan)")
    ap.add_argument("--delay-s", type=number_in(0.0, 3600.0), default=5.0,
                    help="the sim's time to finish a batch, resume scenario")
    ap.add_argument("--expire", type=number_in(0.0, 1.0), default=0.1, help="share of each batch left undone (expired)")
    ap.add_argument("--line-errors", type=number_in(0.0, 1.0), default=0.05, help="share of batch lines answered 500")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args()
    if args.cmd == "child":
        return child(args)

    from conductor.sim import start_sim

    plans = args.steps // 2
    with tempfile.TemporaryDirectory(prefix="conductor-batch-bench-") as d:
        tmp = Path(d)
        (tmp / "server.yaml").write_text(yaml.safe_dump({"workers": [
            {"id": n, "model": f"openai/{n}", "simulate": {"skill": s, "latency_ms": {"mean": 5, "sd": 1}}}
            for n, s in (("fast", 0.9), ("weak", 0.5))]}))
        with start_sim(tmp / "server.yaml", [queries(tmp / "q.parquet", plans)]) as sim:
            results = {
                "resume": scenario(sim, tmp, "resume", plans, "online", 0.5, kill=True, batch_delay_s=args.delay_s),
                "faults, retried online": scenario(sim, tmp, "faults-online", plans, "online", 0.5,
                                                   batch_expire=args.expire, batch_line_error_rate=args.line_errors),
                "faults, retried in batches": scenario(sim, tmp, "faults-batch", plans, "batch", 0.5,
                                                       batch_expire=args.expire,
                                                       batch_line_error_rate=args.line_errors),
            }
    print(f"batch mode, {args.steps:,} steps per scenario ({plans:,} two-step plans), simulated OpenAI Batch API")
    rows = [("steps completed", lambda r: f"{r['completed']:,} of {r['steps']:,}"),
            ("lost", lambda r: f"{r['lost']}"),
            ("plans ok", lambda r: f"{r['plans_ok']:,}"),
            ("SIGKILL after the first submission", lambda r: "yes, then rerun" if r["killed"] else "no"),
            ("batches created by the server", lambda r: f"{r['batches_created']}"),
            ("most submissions of one input file", lambda r: f"{r['most_submissions_of_one_input']}"),
            ("batch lines by outcome", lambda r: ", ".join(f"{k} {v:,}" for k, v in sorted(r["batch_lines"].items()))),
            ("online requests (retries)", lambda r: f"{r['online_requests']:,}"),
            ("steps retried", lambda r: f"{r['retried_steps']:,}"),
            ("run's cost (journal)", lambda r: f"${r['run_cost']:.7f}"),
            ("server log x online price", lambda r: f"${r['server_at_online_price']:.7f}"),
            ("server log x run prices (batch at half)", lambda r: f"${r['server_at_run_prices']:.7f}"),
            ("cost / online price", lambda r: f"{r['cost_ratio']:.4f}"),
            ("wall (all attempts)", lambda r: f"{r['seconds']:.1f} s"),
            ("peak RSS of the executor", lambda r: f"{r['peak_mb']:.0f} MB")]
    names = list(results)
    width = max(len(n) for n, _ in rows) + 2
    cols = [max(len(n), *(len(fmt(results[n])) for _, fmt in rows)) + 2 for n in names]
    print("".ljust(width) + "".join(n.ljust(w) for n, w in zip(names, cols)))
    for label, fmt in rows:
        print(label.ljust(width) + "".join(fmt(results[n]).ljust(w) for n, w in zip(names, cols)))
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
