"""Executor benchmark against the simulated pool on loopback, beside its peers.

Prints one table, every figure measured in this run:
  1. throughput at C in flight: the executor vs Curator's OpenAI back end, the openai
     SDK on aiohttp and bare `litellm.acompletion` (the peers run in child processes,
     Curator and the SDK each in its own virtual environment, see bench/peers.py)
  2. a server enforcing R requests per minute (60 s window), the pool set to R:
     429s, wall / ideal, none lost; and a server enforcing R/60 per one-second window
  3. a server failing 30% of requests with 429 (Retry-After 1 s) or 5xx: every call
     completes, none lost or duplicated; wall vs Curator's through the same faults
  4. a rerun served from the cache: calls to the server, wall time as a share of the first run
  5. peak memory of a full run of N steps (plan, execute, write outputs), in a child process

Run from the repository root:  .venv/bin/python bench/executor.py [--quick]
The peers' environments are created on first use under --peers-dir (default
/tmp/conductor-peers; minutes, from PyPI), never in the project's environment.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
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

from conductor import argtypes  # noqa: E402
from conductor.argtypes import int_in, number_in  # noqa: E402
from conductor.execute.cache import Cache  # noqa: E402
from conductor.execute.engine import ExecOptions, Executor, PlanJob  # noqa: E402
from conductor.execute.journal import Journal  # noqa: E402
from conductor.plans import Plan, Step  # noqa: E402
from conductor.pool import parse_pool  # noqa: E402
from conductor.sim import start_sim  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402

MODEL = "bench"
COUNT = 10 ** 8  # the most calls or steps a flag may ask for


def server_pool(path: Path) -> Path:
    """The simulated model: 50 ms mean latency (sd 5 ms), as in issue 14's comparison."""
    path.write_text(yaml.safe_dump({"workers": [
        {"id": MODEL, "model": f"openai/{MODEL}", "simulate": {"latency_ms": {"mean": 50, "sd": 5}}}]}))
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


def journal_rows(work: Path) -> list[dict]:
    import orjson

    return [orjson.loads(line) for line in (work / "plans.jsonl").read_bytes().splitlines()]


# ---- the five measurements -------------------------------------------------

def throughput(sim, tmp: Path, n: int, concurrency: int, peer_root: Path, names: list[str]) -> dict:
    """Each tool sends n distinct requests at `concurrency` in flight; calls per second."""
    pool = client_pool(sim.url, concurrency)
    run_executor(pool, 200, tmp / "warm", 9_000_000)  # imports and connections, as the peers warm theirs
    out: dict = {}
    offset = 10_000_000
    elapsed, _ = run_executor(pool, n, tmp / "tp", offset, cache_path=tmp / "tp.sqlite")
    out["conductor"] = n / elapsed
    for name in names:
        offset += n
        sim.reset()
        try:
            r = peers.run_peer(peers.ensure_venv(peer_root, name), name, sim.url, n, offset, concurrency)
            if r["completed"] != n:
                raise RuntimeError(f"{r['completed']} of {n} calls completed")
            out[name] = n / r["seconds"]
        except Exception as e:  # one peer's failure (no network for its venv, say) keeps the others' figures
            out[name] = not_measured(name, e)
    return out


def not_measured(peer: str, error: Exception) -> str:
    """The table's entry for a peer that could not run: a short reason; the whole error to stderr."""
    print(f"peer {peer} not measured: {error}", file=sys.stderr, flush=True)
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"not measured: {reason[:120]}"


def rate_limit(sim, tmp: Path, rpm: float, seconds: float, concurrency: int, window_s: float = 60.0) -> dict:
    """The server allows `rpm * window_s / 60` requests per sliding `window_s`; the pool is set to rpm."""
    sim.reset()
    sim.set_faults(MODEL, rpm=rpm * window_s / 60, rpm_window_s=window_s)
    n = int(rpm * seconds / 60)
    pool = client_pool(sim.url, concurrency, rpm=rpm)
    elapsed, work = run_executor(pool, n, tmp / f"rpm{window_s:g}", 20_000_000 + int(window_s) * 100_000)
    log = sim.log()
    sim.set_faults(MODEL, rpm=None, rpm_window_s=None)
    rows = journal_rows(work)
    ideal = n / (rpm / 60)
    return {"rpm": rpm, "window_s": window_s, "calls": n, "seconds": elapsed, "ideal_s": ideal,
            "wall_ideal": elapsed / ideal, "429s": log["by_status"].get("429", 0),
            "lost": n - sum(r["status"] == "ok" for r in rows)}


def faults(sim, tmp: Path, n: int, concurrency: int, peer_root: Path, with_curator: bool) -> dict:
    """15% 5xx and 15% 429 (Retry-After: 1, retry-after-ms: 1000, the sim's default), 20 attempts each."""
    sim.reset()
    sim.set_faults(MODEL, error_rate=0.15, rate_limit_rate=0.15)
    pool = client_pool(sim.url, concurrency, attempts=20)
    elapsed, work = run_executor(pool, n, tmp / "faults", 30_000_000)
    log = sim.log()
    rows = journal_rows(work)
    answered = log["by_request_key"]
    out = {"calls": n, "completed": sum(r["status"] == "ok" for r in rows),
           "lost": n - len({r["plan_id"] for r in rows}),
           "duplicated": sum(c - 1 for c in answered.values() if c > 1) + len(rows) - len({r["plan_id"] for r in rows}),
           "requests": log["total"], "failed_requests": log["total"] - sum(answered.values()), "seconds": elapsed}
    if with_curator:
        sim.reset()
        try:
            r = peers.run_peer(peers.ensure_venv(peer_root, "curator"), "curator", sim.url, n, 31_000_000,
                               concurrency, retries=20)
            out["curator_seconds"], out["curator_completed"] = r["seconds"], r["completed"]
            out["curator_requests"] = sim.log()["total"]
        except Exception as e:  # the executor's figures above still count
            out["curator_error"] = not_measured("curator", e)
    sim.set_faults(MODEL, error_rate=None, rate_limit_rate=None)
    return out


def cache_rerun(sim, tmp: Path, n: int, concurrency: int) -> dict:
    pool = client_pool(sim.url, concurrency)
    cache = tmp / "rerun-cache.sqlite"
    first, _ = run_executor(pool, n, tmp / "first", 40_000_000, cache_path=cache)
    sim.reset()
    second, _ = run_executor(pool, n, tmp / "second", 40_000_000, cache_path=cache)
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


PEERS = ["curator", "openai", "litellm"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run (figures not comparable)")
    ap.add_argument("--concurrency", type=int_in(1, 10_000), default=64)
    ap.add_argument("--calls", type=int_in(1, COUNT), default=5000, help="calls per tool in the throughput run")
    ap.add_argument("--peers", nargs="*", choices=PEERS, default=PEERS, help="peers to compare (default: all)")
    ap.add_argument("--peers-dir", type=argtypes.path, default=Path(tempfile.gettempdir()) / "conductor-peers",
                    help="where the peers' virtual environments live")
    ap.add_argument("--rpm", type=number_in(60.0, 1e6), default=3000,
                    help="at least 60: the 1 s window row needs one request a second")
    ap.add_argument("--rpm-seconds", type=number_in(1.0, 86_400.0), default=90,
                    help="length of the rate-limit runs; at 60 or less the 60 s window row is not tested")
    ap.add_argument("--fault-calls", type=int_in(1, COUNT), default=2000)
    ap.add_argument("--cache-calls", type=int_in(1, COUNT), default=5000)
    ap.add_argument("--memory-steps", type=int_in(1, COUNT), default=200_000)
    ap.add_argument("--profile", action="store_true",
                    help="also profile the executor's throughput run (cProfile) and print its top functions")
    ap.add_argument("--only", nargs="*", choices=["throughput", "rpm", "faults", "cache", "memory"])
    a = ap.parse_args()
    if a.quick:
        a.calls, a.rpm_seconds, a.fault_calls, a.cache_calls, a.memory_steps = 500, 20, 200, 300, 5000
    sections = a.only or ["throughput", "rpm", "faults", "cache", "memory"]
    tmp = Path(tempfile.mkdtemp(prefix="conductor-bench-"))
    out: dict[str, dict] = {}
    load = os.getloadavg()
    failed: dict[str, str] = {}

    def measure(key: str, fn, *args, **kwargs) -> None:
        """A section that fails is named after the table; the sections after it still run, on a
        server cleared of its faults (a section sets them off only when it ends well)."""
        try:
            out[key] = fn(*args, **kwargs)
            print(key, out[key], flush=True)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - SystemExit: a section's own refusal
            failed[key] = (str(e).strip() or type(e).__name__).splitlines()[-1][:300]
            print(f"{key} failed: {e}", file=sys.stderr, flush=True)
            sim.clear_faults()

    try:
        qs = queries(tmp / "known.parquet", 10)
        with start_sim(server_pool(tmp / "server.yaml"), [qs]) as sim:
            if "throughput" in sections:
                measure("throughput", throughput, sim, tmp, a.calls, a.concurrency, a.peers_dir, a.peers)
                if a.profile:
                    print(profile(sim, tmp, a.calls, a.concurrency), flush=True)
            if "rpm" in sections:
                measure("rpm", rate_limit, sim, tmp, a.rpm, a.rpm_seconds, a.concurrency)
                measure("rpm1s", rate_limit, sim, tmp, a.rpm, min(a.rpm_seconds, 20), a.concurrency, window_s=1.0)
            if "faults" in sections:
                measure("faults", faults, sim, tmp, a.fault_calls, a.concurrency, a.peers_dir, "curator" in a.peers)
            if "cache" in sections:
                measure("cache", cache_rerun, sim, tmp, a.cache_calls, a.concurrency)
            if "memory" in sections:
                measure("memory", memory, sim, tmp, a.memory_steps, a.concurrency)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(table(out, a))
    for key, error in failed.items():
        print(f"{key}: FAILED, not measured: {error}")
    end = os.getloadavg()
    print(f"load average (1 min) at start {load[0]:.1f}, at end {end[0]:.1f}, on {os.cpu_count()} cores")
    if failed:
        raise SystemExit(f"{len(failed)} section(s) failed: {', '.join(failed)}")


def profile(sim, tmp: Path, n: int, concurrency: int) -> str:
    """The executor's throughput run under cProfile: its top functions by own time."""
    import cProfile
    import io
    import pstats

    pool = client_pool(sim.url, concurrency)
    prof = cProfile.Profile()
    prof.enable()
    run_executor(pool, n, tmp / "prof", 50_000_000, cache_path=tmp / "prof.sqlite")
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
    return buf.getvalue()


def table(out: dict, a) -> str:
    rows = [("measurement", "figure", "target", "met")]
    if t := out.get("throughput"):
        ours = t["conductor"]
        figs = ", ".join(f"{k} {v}" if isinstance(v, str) else f"{k} {v:.0f}" for k, v in t.items())
        rows.append((f"1. throughput at {a.concurrency} in flight, calls/s", figs, "", ""))
        for peer, label, least in (("curator", "Curator (openai back end)", 1.0),
                                   ("openai", "openai SDK on aiohttp", None), ("litellm", "bare litellm", 2.0)):
            if peer not in t:
                continue
            if isinstance(t[peer], str):  # not measured: its reason
                rows.append((f"   conductor / {label}", f"{peer} {t[peer]}", "" if least is None else f">= {least}",
                             ""))
            else:
                ratio = ours / t[peer]
                rows.append((f"   conductor / {label}", f"{ratio:.2f}", "" if least is None else f">= {least}",
                             "" if least is None else ratio >= least))
    for key, what in (("rpm", "60 s window"), ("rpm1s", "1 s window")):
        if r := out.get(key):
            rows.append((f"2. server and pool at {r['rpm']:.0f} rpm ({what}), {r['calls']} calls",
                         f"{r['429s']} 429s, wall / ideal {r['seconds']:.1f} / {r['ideal_s']:.1f} s = "
                         f"{r['wall_ideal']:.3f}, {r['lost']} lost",
                         "0 429s, <= 1.03, 0 lost",
                         # a run no longer than the window never sends more than the window allows
                         f"429s not tested (run within one window); {r['wall_ideal'] <= 1.03 and not r['lost']}"
                         if r["ideal_s"] <= r["window_s"] else
                         r["429s"] == 0 and r["wall_ideal"] <= 1.03 and not r["lost"]))
    if f := out.get("faults"):
        ok = f["completed"] == f["calls"] and not f["lost"] and not f["duplicated"]
        rows.append((f"3. 30% of requests fail (429/5xx), {f['calls']} calls",
                     f"{f['completed']} completed, {f['lost']} lost, {f['duplicated']} duplicated, "
                     f"{f['failed_requests']} failed requests retried, {f['seconds']:.1f} s",
                     "all complete, 0 lost, 0 dup", ok))
        if "curator_error" in f:
            rows.append(("   wall, conductor / Curator", f"curator {f['curator_error']}", "<= 0.8", ""))
        if "curator_seconds" in f:
            ratio = f["seconds"] / f["curator_seconds"]
            rows.append(("   wall, conductor / Curator",
                         f"{f['seconds']:.1f} / {f['curator_seconds']:.1f} s = {ratio:.2f} "
                         f"(Curator completed {f['curator_completed']})", "<= 0.8", ratio <= 0.8))
    if c := out.get("cache"):
        rows.append((f"4. rerun from cache, {c['calls']} calls",
                     f"{c['server_calls_on_rerun']} server calls, {c['rerun_s']:.2f} s / {c['first_s']:.2f} s = {c['ratio']:.3f}",
                     "0 calls, <= 0.02", c["server_calls_on_rerun"] == 0 and c["ratio"] <= 0.02))
    if m := out.get("memory"):
        rows.append((f"5. peak memory, full run of {m['steps']:,} steps ({m['seconds']:.0f} s)",
                     f"{m['peak_mb']:.0f} MB", "< 1536 MB", m["peak_mb"] < 1536))
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines) + f"\n\ncommand: {' '.join([Path(sys.executable).name, *sys.argv])}"


if __name__ == "__main__":
    main()
