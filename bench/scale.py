"""Scaling benchmark: several worker processes against one provider limit.

Starts the simulated pool (enforcing R requests per minute on its side), a real
redis-server on a free 127.0.0.1 port, and W worker processes, each with its own
data folder as W machines would have. Prints, every figure measured in this run:
  1. shared governor: aggregate sustained rate / R, 429s, calls lost or duplicated
  2. the same calls with the in-process governor in each worker: the same figures
  3. a shared budget that runs out mid-run: spend from the sim's request log x prices vs the budget
  4. a second identical job on another process, served from the shared cache: requests to the sim

Run from the repository root:  .venv/bin/python bench/scale.py [--quick]
A worker is this file run as `bench/scale.py worker SPEC.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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

MODEL = "bench"
PRICE = {"input_per_mtok": 1.0, "output_per_mtok": 2.0}


def prompt(i: int) -> str:
    return f"Question {i}: what is {i} plus {i * 7 % 13}? Give the number."


# ---- the worker process ------------------------------------------------------

def pool_doc(spec: dict) -> dict:
    provider = {"max_concurrency": spec["concurrency"], "timeout_s": 30, "max_attempts": spec.get("attempts", 6)}
    if spec.get("rpm"):
        provider["rpm"] = spec["rpm"]
    if spec.get("budget") is not None:
        provider["budget_usd"] = spec["budget"]
    return {"governor": spec["governor"], "providers": {"sim": provider}, "workers": [{
        "id": MODEL, "model": f"openai/{MODEL}", "provider": "sim", "api_base": spec["url"], "price": PRICE,
        "params": {"temperature": 0, "max_tokens": 256}}]}


def worker(spec_path: str) -> None:
    """Run spec["n"] one-step plans from spec["offset"] through the executor; print a JSON summary."""
    from conductor.execute.cache import Cache
    from conductor.execute.engine import ExecOptions, Executor, PlanJob
    from conductor.execute.journal import Journal, load_state
    from conductor.plans import Plan, Step
    from conductor.pool import parse_pool
    from conductor.execute.shared.cache import open_cache

    spec = orjson.loads(Path(spec_path).read_bytes())
    pool = parse_pool(pool_doc(spec))
    data = Path(spec["data_dir"])
    work = data / "runs" / spec["run_id"] / "work"
    work.mkdir(parents=True, exist_ok=True)
    state = load_state(work)
    journal = Journal(work)
    cache = open_cache(data / "cache.sqlite", pool)
    ex = Executor(pool, journal, ExecOptions(run_id=spec["run_id"], backoff_base_s=0.2), cache=cache,
                  run_cache=Cache(work / "responses.sqlite"), spent=state.spent, paid=state.paid)
    jobs = (PlanJob(f"p{i}", f"b{i:07d}", i, 0, "math", prompt(i), Plan((Step(MODEL, prompt(i), ()),)))
            for i in range(spec["offset"], spec["offset"] + spec["n"]))
    if spec.get("barrier"):  # start together, as machines already up would: not staggered by imports
        Path(spec["barrier"], f"ready-{spec['run_id']}").touch()
        while not Path(spec["barrier"], "go").exists():
            time.sleep(0.05)
    t = time.perf_counter()
    asyncio.run(ex.run(jobs, state))
    elapsed = time.perf_counter() - t
    journal.close()
    cache.close()
    rows = {}
    for line in (work / "plans.jsonl").read_bytes().splitlines():
        r = orjson.loads(line)
        rows[r["plan_id"]] = r  # the newest line per plan
    statuses: dict[str, int] = {}
    for r in rows.values():
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    errors = sorted({(r.get("error") or "")[:160] for r in rows.values() if r["status"] != "ok"})[:3]
    print(orjson.dumps({"elapsed_s": elapsed, "plans": len(rows), "statuses": statuses,
                        "ok_ids": sorted(r["query_id"] for r in rows.values() if r["status"] == "ok"),
                        "cache_hits": sum(r.get("cache_hits") or 0 for r in rows.values()),
                        "errors": errors}).decode())


def spawn(spec: dict, tmp: Path) -> subprocess.Popen:
    path = tmp / f"spec-{spec['run_id']}-{spec['offset']}.json"
    path.write_bytes(orjson.dumps(spec))
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "worker", str(path)],
                            stdout=subprocess.PIPE, cwd=REPO)


def run_workers(specs: list[dict], tmp: Path) -> list[dict]:
    barrier = Path(tempfile.mkdtemp(dir=tmp, prefix="barrier-"))
    specs = [{**s, "barrier": str(barrier)} for s in specs]
    procs = [spawn(s, tmp) for s in specs]
    while len(list(barrier.glob("ready-*"))) < len(specs):
        if any(p.poll() is not None for p in procs):
            break  # one failed to start: its error is reported below
        time.sleep(0.05)
    (barrier / "go").touch()
    out = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a worker failed with code {p.returncode}")
        out.append(orjson.loads(stdout.splitlines()[-1]))
    return out


# ---- the measurements --------------------------------------------------------

def specs_for(base: dict, workers: int, n: int, offset: int, tmp: Path, tag: str) -> list[dict]:
    per = n // workers
    return [{**base, "n": per, "offset": offset + k * per, "run_id": f"{tag}{k}",
             "data_dir": str(tmp / f"{tag}-machine{k}")} for k in range(workers)]


def rate_case(sim, tmp: Path, governor: str, tag: str, a, offset: int) -> dict:
    sim.reset()
    base = {"url": sim.url, "rpm": a.rpm, "concurrency": a.concurrency, "governor": governor}
    specs = specs_for(base, a.workers, a.calls, offset, tmp, tag)
    calls = sum(s["n"] for s in specs)  # a.calls rounded down to a multiple of the workers: the rest were "lost"
    outs = run_workers(specs, tmp)
    log = sim._call("GET", "/admin/log")
    times = sorted(log["accepted_times"].get(MODEL, []))
    rate = (len(times) - 1) / (times[-1] - times[0]) * 60 if len(times) > 1 else 0.0
    ok_ids = [i for o in outs for i in o["ok_ids"]]
    dup = sum(c - 1 for c in log["by_request_key"].values() if c > 1)  # 200s per client request id
    return {"calls": calls, "ok": len(ok_ids), "distinct_ok": len(set(ok_ids)),
            "lost": calls - len(set(ok_ids)), "sustained_rpm": rate, "ratio": rate / a.rpm,
            "429s": log["by_status"].get("429", 0), "answered_twice": dup,
            "wall_s": max(o["elapsed_s"] for o in outs), "errors": [e for o in outs for e in o["errors"]][:2]}


def budget_case(sim, tmp: Path, governor: str, a, offset: int) -> dict:
    sim.reset()
    base = {"url": sim.url, "concurrency": a.concurrency, "governor": governor, "budget": a.budget}
    outs = run_workers(specs_for(base, a.workers, a.budget_calls, offset, tmp, "budget"), tmp)
    log = sim._call("GET", "/admin/log")
    prompt_tokens, completion_tokens = log["billed_tokens"].get(MODEL, [0, 0])
    spend = prompt_tokens * PRICE["input_per_mtok"] / 1e6 + completion_tokens * PRICE["output_per_mtok"] / 1e6
    statuses: dict[str, int] = {}
    for o in outs:
        for k, v in o["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    return {"budget": a.budget, "spend": spend, "answered": log["by_status"].get("200", 0), "statuses": statuses,
            "errors": [e for o in outs for e in o["errors"]][:3]}


def cache_case(sim, tmp: Path, governor: str, a, offset: int) -> dict:
    base = {"url": sim.url, "concurrency": a.concurrency, "governor": governor}
    first = specs_for(base, 1, a.cache_calls, offset, tmp, "cachefirst")
    sim.reset()
    run_workers(first, tmp)
    sent_first = sim._call("GET", "/admin/log")["total"]
    sim.reset()
    second = specs_for(base, 1, a.cache_calls, offset, tmp, "cachesecond")  # another machine's folder
    out = run_workers(second, tmp)[0]
    return {"calls": a.cache_calls, "first_requests": sent_first,
            "second_requests": sim._call("GET", "/admin/log")["total"], "second_cache_hits": out["cache_hits"],
            "second_ok": out["statuses"].get("ok", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int_in(1, 256), default=4)
    ap.add_argument("--rpm", type=number_in(1.0, 1e6), default=3000)
    ap.add_argument("--calls", type=int_in(1, 10 ** 8), default=8000, help="split evenly among --workers")
    ap.add_argument("--concurrency", type=int_in(1, 10_000), default=32)
    ap.add_argument("--budget", type=number_in(1e-6, 1e6), default=0.05, help="USD")
    ap.add_argument("--budget-calls", type=int_in(1, 10 ** 8), default=4000, help="split evenly among --workers")
    ap.add_argument("--cache-calls", type=int_in(1, 10 ** 8), default=1000)
    ap.add_argument("--quick", action="store_true", help="small counts, a check that it runs (figures not meaningful)")
    ap.add_argument("--only", nargs="*", choices=["shared", "local", "budget", "cache"])
    a = ap.parse_args()
    if a.quick:
        a.calls, a.rpm, a.budget_calls, a.budget, a.cache_calls = 400, 600, 400, 0.02, 100
    for flag, n in (("--calls", a.calls), ("--budget-calls", a.budget_calls)):
        if n < a.workers:  # each worker sends n // workers
            ap.error(f"{flag} {n}: fewer than --workers {a.workers}, so a worker would have none")
    sections = a.only or ["shared", "local", "budget", "cache"]
    from conductor.execute.shared.servers import RedisServer
    from conductor.sim import start_sim

    with tempfile.TemporaryDirectory(prefix="conductor-scale-") as t:
        tmp = Path(t)
        (tmp / "pool.yaml").write_text(yaml.safe_dump({"workers": [
            {"id": MODEL, "model": f"openai/{MODEL}", "simulate": {"latency_ms": {"mean": 20, "sd": 5}}}]}))
        n = max(a.calls, a.budget_calls, a.cache_calls) * 4 + 10
        pq.write_table(pa.table({"query_id": [f"b{i:07d}" for i in range(n)], "prompt": [prompt(i) for i in range(n)],
                                 "task": ["math"] * n, "reference": [str(i + i * 7 % 13) for i in range(n)]}),
                       tmp / "q.parquet")
        out: dict = {}
        with start_sim(tmp / "pool.yaml", tmp / "q.parquet") as sim, RedisServer() as redis:
            sim.set_faults(MODEL, rpm=a.rpm)
            if "shared" in sections:
                out["shared"] = rate_case(sim, tmp, redis.url, "shared", a, 0)
                print("shared", {k: v for k, v in out["shared"].items()}, flush=True)
            if "local" in sections:
                out["local"] = rate_case(sim, tmp, "memory://", "local", a, a.calls)
                print("local", out["local"], flush=True)
            sim.set_faults(MODEL, rpm=None)
            if "budget" in sections:
                out["budget"] = budget_case(sim, tmp, redis.url, a, 2 * a.calls)
                print("budget", out["budget"], flush=True)
            if "cache" in sections:
                out["cache"] = cache_case(sim, tmp, redis.url, a, 2 * a.calls + a.budget_calls)
                print("cache", out["cache"], flush=True)
    print(table(out, a))


def table(out: dict, a) -> str:
    rows = [("measurement", "result")]
    for name, label in (("shared", "shared governor (Redis)"), ("local", "in-process governor in each")):
        if r := out.get(name):
            rows.append((f"{a.workers} processes, {r['calls']} calls, sim at {a.rpm:.0f} rpm: {label}",
                         f"{r['sustained_rpm']:.0f} rpm = {r['ratio']:.3f} R, {r['429s']} 429s, {r['lost']} lost, "
                         f"{r['answered_twice']} answered twice, {r['wall_s']:.0f} s"))
    if r := out.get("budget"):
        rows.append((f"{a.workers} processes, shared budget ${r['budget']:.4f}",
                     f"spent ${r['spend']:.4f} (sim log x prices) = {r['spend'] / r['budget']:.3f} of it; "
                     f"{r['answered']} answered; plans {r['statuses']}"))
    if r := out.get("cache"):
        rows.append((f"second identical job ({r['calls']} calls) on another process",
                     f"{r['second_requests']} requests to the sim (first run: {r['first_requests']}); "
                     f"{r['second_cache_hits']} cache hits"))
    w = max(len(x) for x, _ in rows)
    return "\n".join(f"{x.ljust(w)}  {y}" for x, y in rows)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        main()
