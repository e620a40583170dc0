"""Executor benchmark against the simulated pool on loopback.

Prints one table, every figure measured in this run:
  1. throughput of the executor vs bare `litellm.acompletion` at the same concurrency (ratio)
  2. a server enforcing R requests per minute, the pool set to R: sustained rate and 429s
  3. a server failing 30% of requests with 429 or 5xx: every call completes, none lost or duplicated
  4. a rerun served from the cache: calls to the server, wall time as a ratio of the first run
  5. peak memory of a full run of N steps (plan, execute, write outputs), in a child process

Run from the repository root:  .venv/bin/python bench/executor.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import yaml  # noqa: E402

from conductor.execute.cache import Cache  # noqa: E402
from conductor.execute.call import litellm  # noqa: E402  (configured: quiet, no retries here)
from conductor.execute.engine import ExecOptions, Executor, PlanJob  # noqa: E402
from conductor.execute.journal import Journal  # noqa: E402
from conductor.plans import Plan, Step  # noqa: E402
from conductor.pool import parse_pool  # noqa: E402
from conductor.sim import start_sim  # noqa: E402

MODEL = "bench"


def server_pool(path: Path) -> Path:
    path.write_text(yaml.safe_dump({"workers": [
        {"id": MODEL, "model": f"openai/{MODEL}", "simulate": {"latency_ms": {"mean": 5, "sd": 1}}}]}))
    return path


def queries(path: Path, n: int) -> Path:
    """n distinct prompts the server knows, so every request is a different call."""
    ids = [f"b{i:07d}" for i in range(n)]
    prompts = [f"Question {i}: what is {i} plus {i * 7 % 13}? Give the number." for i in range(n)]
    refs = [str(i + i * 7 % 13) for i in range(n)]
    pq.write_table(pa.table({"query_id": ids, "prompt": prompts, "task": ["math"] * n, "reference": refs}), path)
    return path


def client_pool(url: str, concurrency: int, rpm: float | None = None, attempts: int = 6):
    provider = {"max_concurrency": concurrency, "timeout_s": 30, "max_attempts": attempts}
    if rpm:
        provider["rpm"] = rpm
    return parse_pool({"providers": {"sim": provider}, "workers": [{
        "id": MODEL, "model": f"openai/{MODEL}", "provider": "sim", "api_base": url,
        "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}, "params": {"temperature": 0, "max_tokens": 256}}]})


def jobs(n: int, offset: int = 0):
    for i in range(offset, offset + n):
        prompt = f"Question {i}: what is {i} plus {i * 7 % 13}? Give the number."
        yield PlanJob(f"p{i}", f"b{i:07d}", i, 0, "math", prompt, Plan((Step(MODEL, prompt, ()),)))


def run_executor(pool, n: int, work: Path, offset: int = 0, cache_path: Path | None = None, max_attempts=None):
    work.mkdir(parents=True, exist_ok=True)
    journal = Journal(work)
    cache = Cache(cache_path) if cache_path else None
    ex = Executor(pool, journal, ExecOptions(run_id=work.name, backoff_base_s=0.2), cache=cache,
                  run_cache=Cache(work / "responses.sqlite"))
    t = time.perf_counter()
    asyncio.run(ex.run(jobs(n, offset)))
    elapsed = time.perf_counter() - t
    journal.close()
    if cache:
        cache.close()
    return elapsed, work


async def _bare(url: str, n: int, concurrency: int, offset: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        prompt = f"Question {i}: what is {i} plus {i * 7 % 13}? Give the number."
        async with sem:
            await litellm.acompletion(model=f"openai/{MODEL}", api_base=url, api_key="no-key",
                                      messages=[{"role": "user", "content": prompt}], temperature=0,
                                      max_tokens=256, num_retries=0, max_retries=0, timeout=30)

    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(offset, offset + n)))
    return time.perf_counter() - t


def journal_rows(work: Path) -> list[dict]:
    import orjson

    return [orjson.loads(line) for line in (work / "plans.jsonl").read_bytes().splitlines()]


# ---- the five measurements -------------------------------------------------

def throughput(sim, tmp: Path, n: int, concurrency: int, rounds: int) -> dict:
    pool = client_pool(sim.url, concurrency)
    bare, ours = [], []
    offset = 10_000_000
    asyncio.run(_bare(sim.url, 200, concurrency, offset))  # warm up both paths' imports and pools
    for r in range(rounds):  # alternate, so drift on the machine hits both alike
        offset += 2 * n
        bare.append(n / asyncio.run(_bare(sim.url, n, concurrency, offset)))
        elapsed, _ = run_executor(pool, n, tmp / f"tp{r}", offset + n, cache_path=tmp / f"tp{r}.sqlite")
        ours.append(n / elapsed)
    b, o = statistics.median(bare), statistics.median(ours)
    return {"bare_calls_s": b, "executor_calls_s": o, "ratio": o / b}


def rate_limit(sim, tmp: Path, rpm: float, seconds: float, concurrency: int) -> dict:
    sim.reset()
    sim.set_faults(MODEL, rpm=rpm)
    n = int(rpm * seconds / 60)
    pool = client_pool(sim.url, concurrency, rpm=rpm)
    elapsed, _ = run_executor(pool, n, tmp / "rpm", 20_000_000)
    log = sim.log()
    sim.set_faults(MODEL, rpm=None)
    times = sorted(log["accepted_times"][MODEL])
    rate = (len(times) - 1) / (times[-1] - times[0]) * 60
    return {"rpm": rpm, "calls": len(times), "seconds": elapsed, "sustained_rpm": rate,
            "ratio": rate / rpm, "429s": log["by_status"].get("429", 0)}


def faults(sim, tmp: Path, n: int, concurrency: int) -> dict:
    sim.reset()
    sim.set_faults(MODEL, error_rate=0.15, rate_limit_rate=0.15, retry_after_ms=100)
    pool = client_pool(sim.url, concurrency, attempts=20)
    elapsed, work = run_executor(pool, n, tmp / "faults", 30_000_000)
    log = sim.log()
    sim.set_faults(MODEL, error_rate=None, rate_limit_rate=None, retry_after_ms=None)
    rows = journal_rows(work)
    ok = sum(r["status"] == "ok" for r in rows)
    answered = log["by_request_key"]
    return {"calls": n, "completed": ok, "lost": n - len({r["plan_id"] for r in rows}),
            "duplicated": sum(c - 1 for c in answered.values() if c > 1) + len(rows) - len({r["plan_id"] for r in rows}),
            "requests": log["total"], "failed_requests": log["total"] - sum(answered.values()),
            "seconds": elapsed}


def cache_rerun(sim, tmp: Path, n: int, concurrency: int) -> dict:
    sim.set_faults(MODEL, latency_ms=20, latency_sd_ms=5)
    pool = client_pool(sim.url, concurrency)
    cache = tmp / "rerun-cache.sqlite"
    first, _ = run_executor(pool, n, tmp / "first", 40_000_000, cache_path=cache)
    sim.reset()
    second, _ = run_executor(pool, n, tmp / "second", 40_000_000, cache_path=cache)
    sim.set_faults(MODEL, latency_ms=None, latency_sd_ms=None)
    return {"calls": n, "first_s": first, "rerun_s": second, "ratio": second / first,
            "server_calls_on_rerun": sim.log()["total"]}


def memory(sim, tmp: Path, steps: int, concurrency: int) -> dict:
    """A full `conductor run` (plan, execute, grade, write) in a child process; peak RSS from the kernel."""
    qs = queries(tmp / "memory.parquet", steps)
    pool = tmp / "memory-pool.yaml"
    pool.write_text(yaml.safe_dump({"providers": {"sim": {"max_concurrency": concurrency, "timeout_s": 30}},
                                    "workers": [{"id": MODEL, "model": f"openai/{MODEL}", "provider": "sim",
                                                 "api_base": sim.url,
                                                 "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}]}))
    sim.reset()
    code = ("import resource, sys; from conductor.cli import main; rc = main(sys.argv[1:]); "
            "print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, "run", str(qs), "--pool", str(pool), "--data-dir",
                        str(tmp / "memdata"), "--quiet", "--no-cache"], cwd=REPO, capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"memory run failed:\n{r.stderr[-3000:]}")
    peak_kb = int(next(x for x in r.stdout.splitlines() if x.startswith("PEAK_KB")).split()[1])
    traces = next((tmp / "memdata" / "runs").iterdir()) / "traces.parquet"
    return {"steps": pq.ParquetFile(traces).metadata.num_rows, "peak_mb": peak_kb / 1024, "seconds": elapsed,
            "server_calls": sim.log()["by_status"].get("200", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run (figures not comparable)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--calls", type=int, default=3000, help="calls per throughput round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rpm", type=float, default=1200)
    ap.add_argument("--rpm-seconds", type=float, default=90, help="longer than the server's 60 s window")
    ap.add_argument("--fault-calls", type=int, default=1000)
    ap.add_argument("--cache-calls", type=int, default=2000)
    ap.add_argument("--memory-steps", type=int, default=200_000)
    ap.add_argument("--only", nargs="*", choices=["throughput", "rpm", "faults", "cache", "memory"])
    a = ap.parse_args()
    if a.quick:
        a.calls, a.rounds, a.rpm_seconds, a.fault_calls, a.cache_calls, a.memory_steps = 500, 1, 20, 200, 300, 5000
    sections = a.only or ["throughput", "rpm", "faults", "cache", "memory"]
    tmp = Path(tempfile.mkdtemp(prefix="conductor-bench-"))
    out: dict[str, dict] = {}
    try:
        qs = queries(tmp / "known.parquet", 10)
        with start_sim(server_pool(tmp / "server.yaml"), [qs]) as sim:
            if "throughput" in sections:
                out["throughput"] = throughput(sim, tmp, a.calls, a.concurrency, a.rounds)
                print("throughput", out["throughput"], flush=True)
            if "rpm" in sections:
                out["rpm"] = rate_limit(sim, tmp, a.rpm, a.rpm_seconds, a.concurrency)
                print("rpm", out["rpm"], flush=True)
            if "faults" in sections:
                out["faults"] = faults(sim, tmp, a.fault_calls, a.concurrency)
                print("faults", out["faults"], flush=True)
            if "cache" in sections:
                out["cache"] = cache_rerun(sim, tmp, a.cache_calls, a.concurrency)
                print("cache", out["cache"], flush=True)
            if "memory" in sections:
                out["memory"] = memory(sim, tmp, a.memory_steps, a.concurrency)
                print("memory", out["memory"], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(table(out, a))


def table(out: dict, a) -> str:
    rows = [("measurement", "figure", "target", "met")]
    if t := out.get("throughput"):
        rows.append((f"1. throughput at {a.concurrency} in flight, executor / bare litellm",
                     f"{t['executor_calls_s']:.0f} / {t['bare_calls_s']:.0f} calls/s = {t['ratio']:.2f}",
                     ">= 0.90", t["ratio"] >= 0.9))
    if r := out.get("rpm"):
        rows.append((f"2. server and pool at {r['rpm']:.0f} rpm, {r['calls']} calls over {r['seconds']:.0f} s",
                     f"{r['sustained_rpm']:.0f} rpm = {r['ratio']:.3f} R, {r['429s']} 429s",
                     ">= 0.95 R, 0 429s", r["ratio"] >= 0.95 and r["429s"] == 0))
    if f := out.get("faults"):
        rows.append((f"3. 30% of requests fail (429/5xx), {f['calls']} calls",
                     f"{f['completed']} completed, {f['lost']} lost, {f['duplicated']} duplicated, "
                     f"{f['failed_requests']} failed requests retried",
                     "all complete, 0 lost, 0 dup", f["completed"] == f["calls"] and not f["lost"] and not f["duplicated"]))
    if c := out.get("cache"):
        rows.append((f"4. rerun from cache, {c['calls']} calls",
                     f"{c['server_calls_on_rerun']} server calls, {c['rerun_s']:.2f} s / {c['first_s']:.2f} s = {c['ratio']:.3f}",
                     "0 calls, <= 0.05", c["server_calls_on_rerun"] == 0 and c["ratio"] <= 0.05))
    if m := out.get("memory"):
        rows.append((f"5. peak memory, full run of {m['steps']:,} steps ({m['seconds']:.0f} s)",
                     f"{m['peak_mb']:.0f} MB", "< 1536 MB", m["peak_mb"] < 1536))
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines) + f"\n\ncommand: {' '.join([Path(sys.executable).name, *sys.argv])}"


if __name__ == "__main__":
    main()
