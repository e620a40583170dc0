"""Enrichment benchmark: a 5-field job over N synthetic rows (default 100,000)
against the simulated pool on loopback, in direct mode.

Prints one table, every figure measured in this run:
  1. the structured job (5 typed fields, schema sent, every reply parsed,
     validated and typed): records/s over run_job's own wall time, and peak
     memory of `conductor job run` in a child process (ru_maxrss);
  2. the same job without fields (plain-text records, no schema, no
     validation): records/s and peak memory;
  3. the overhead of structure as ratios, 1 over 2: of run_job's wall time
     (which includes the sim's own work on the same cores and whatever else
     the machine runs) and of the conductor process's CPU time (user +
     system, ru_utime + ru_stime; steadier on a shared machine);
  4. validation and typing alone, in process on the same number of replies
     (drawn by the sim's own generator, no HTTP): microseconds per record, its
     share of run 1, and the peak of Python allocations (tracemalloc).

The sim answers without latency, so the figures measure conductor, not a
provider. Run from the repository root:
    .venv/bin/python bench/enrich.py [--rows 100000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import orjson  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import yaml  # noqa: E402

from conductor.argtypes import int_in  # noqa: E402
from conductor.enrich import load_job, render_queries  # noqa: E402
from conductor.sim import start_sim  # noqa: E402

MODEL = "bench-extract"
UNITS = ["thousand", "million", "billion"]
SECTORS = ["retail", "logistics", "software", "mining", "insurance", "utilities", "media", "biotech"]


def write_input(path: Path, n: int) -> Path:
    """n short company reports with gold amount and unit; every prompt differs."""
    rng = random.Random(7)
    ids, texts, amounts, units = [], [], [], []
    for i in range(n):
        amount = round(rng.uniform(1, 999), 1)
        unit = UNITS[i % 3]
        year = 2010 + i % 15
        sector = SECTORS[i % len(SECTORS)]
        ids.append(f"r{i:07d}")
        texts.append(f"Company {i} ({sector}) reported revenue of {amount} {unit} dollars for fiscal {year}, "
                     f"closing the period on {year}-12-31 with {rng.randint(10, 9000)} employees; "
                     f"management called the year {'strong' if i % 2 else 'difficult'}.")
        amounts.append(amount)
        units.append(unit)
    pq.write_table(pa.table({"row_id": ids, "text": texts, "gold_amount": amounts, "gold_unit": units}), path)
    return path


def write_jobs(root: Path, url: str, concurrency: int) -> tuple[Path, Path]:
    (root / "pool.yaml").write_text(yaml.safe_dump({
        "providers": {"sim": {"max_concurrency": concurrency, "timeout_s": 60}},
        "workers": [{"id": MODEL, "model": f"openai/{MODEL}", "provider": "sim", "api_base": url,
                     "description": "simulated extractor", "params": {"temperature": 0, "max_tokens": 512},
                     "price": {"input_per_mtok": 0.1, "output_per_mtok": 0.2},
                     "simulate": {"skill": {"record": 0.8}, "latency_ms": 0}}]}))
    base = {"input": {"path": "input.parquet", "id": "row_id"},
            "prompt": "Extract the company's figures from this report.\n\nReport: {{ text }}",
            "pool": "pool.yaml", "mode": "direct", "worker": MODEL, "budget_usd": 1000.0}
    structured = {"name": "bench_structured", **base, "fields": {
        "company": {"type": "string", "description": "the company's name", "required": True},
        "revenue": {"type": "number", "description": "revenue as stated", "required": True},
        "unit": {"type": "enum", "values": UNITS, "required": True},
        "fiscal_year": {"type": "integer"},
        "period_end": {"type": "date"}},
        "references": {"revenue": {"column": "gold_amount", "score": "numeric", "rel_tol": 0.001},
                       "unit": {"column": "gold_unit", "score": "exact"}},
        "quality": {"min_valid_share": 0.9}}
    plain = {"name": "bench_plain", **base}
    paths = []
    for doc in (structured, plain):
        p = root / f"{doc['name']}.yaml"
        p.write_text(yaml.safe_dump(doc, sort_keys=False))
        paths.append(p)
    return paths[0], paths[1]


def run_job_child(job: Path, data: Path) -> dict:
    """`conductor job run` in a child process: wall time and the kernel's peak RSS."""
    code = ("import resource, sys; from conductor.cli import main; rc = main(sys.argv[1:]); "
            "u = resource.getrusage(resource.RUSAGE_SELF); "
            "print('PEAK_KB', u.ru_maxrss); print('CPU_S', u.ru_utime + u.ru_stime); sys.exit(rc)")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, "job", "run", str(job), "--data-dir", str(data)],
                       cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{job.name} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    peak_kb = int(next(x for x in r.stdout.splitlines() if x.startswith("PEAK_KB")).split()[1])
    cpu_s = float(next(x for x in r.stdout.splitlines() if x.startswith("CPU_S")).split()[1])
    summary = orjson.loads(next((data / "runs").glob("*/summary.json")).read_bytes())
    rows, run_s = summary["rows"], summary["wall_time_s"]
    return {"rows": rows, "valid": summary["valid"], "statuses": summary["statuses"], "process_s": seconds,
            "run_s": run_s, "records_s": rows / run_s, "peak_mb": peak_kb / 1024, "cpu_s": cpu_s}


def validation_alone(job_path: Path, queries: pa.Table) -> dict:
    """Parse, validate and type the replies the sim would send, without HTTP or the executor."""
    from conductor.records import RecordChecker, typed_columns
    from conductor.sim.index import Known
    from conductor.sim.structured import StructuredRequest, record_reply

    job = load_job(job_path)
    rng = random.Random(1)
    replies = []
    for qid, prompt, ref in zip(*(queries.column(c).to_pylist() for c in ("query_id", "prompt", "reference"))):
        req = StructuredRequest(job.schema, False, [prompt])
        replies.append(record_reply(req, Known(qid, prompt, "record", ref), 0.8, rng, 0.0, lambda: rng)[0])
    checker = RecordChecker(job.check_schema)
    tracemalloc.start()
    t = time.perf_counter()
    recs = [checker.check(r)[0] for r in replies]
    cols = typed_columns(job.fields, recs)
    seconds = time.perf_counter() - t
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert all(len(c) == len(replies) for c in cols.values())
    return {"records": len(replies), "valid": sum(r is not None for r in recs), "seconds": seconds,
            "us_per_record": seconds / len(replies) * 1e6, "peak_mb": peak / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int_in(1, 10 ** 8), default=100_000)
    ap.add_argument("--concurrency", type=int_in(1, 10_000), default=64)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="conductor-bench-enrich-"))
    out: dict[str, dict] = {}
    try:
        write_input(tmp / "input.parquet", a.rows)
        structured, plain = write_jobs(tmp, "http://127.0.0.1:9/v1", a.concurrency)
        queries = render_queries(load_job(structured))
        pq.write_table(queries, tmp / "queries.parquet")
        with start_sim(tmp / "pool.yaml", tmp / "queries.parquet", latency_ms=0, startup_timeout_s=300) as sim:
            structured, plain = write_jobs(tmp, sim.url, a.concurrency)
            out["structured"] = run_job_child(structured, tmp / "data-structured")
            print("structured", out["structured"], flush=True)
            out["structured"]["server_calls"] = sim.log()["by_status"].get("200", 0)
            sim.reset()
            out["plain"] = run_job_child(plain, tmp / "data-plain")
            out["plain"]["server_calls"] = sim.log()["by_status"].get("200", 0)
            print("plain", out["plain"], flush=True)
        out["validation"] = validation_alone(structured, queries)
        print("validation", out["validation"], flush=True)
    finally:
        if a.keep:
            print("kept", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(table(out, a))


def table(out: dict, a) -> str:
    s, p, v = out["structured"], out["plain"], out["validation"]

    def speed(x: dict) -> str:
        return (f"{x['records_s']:,.0f} records/s ({x['run_s']:.1f} s in run_job, {x['process_s']:.1f} s with "
                f"start-up), {x['cpu_s']:.0f} CPU s, peak {x['peak_mb']:.0f} MB")

    rows = [("measurement", "figure"),
            (f"1. structured job, 5 fields, {s['rows']:,} rows ({s['valid']:,} valid, {s['server_calls']:,} calls)",
             speed(s)),
            (f"2. same job without fields (plain text), {p['rows']:,} rows ({p['server_calls']:,} calls)", speed(p)),
            ("3. overhead of schema, validation and typing: 1 / 2",
             f"{s['run_s'] / p['run_s']:.2f}x wall time, {s['cpu_s'] / p['cpu_s']:.2f}x CPU time of conductor, "
             f"{s['peak_mb'] / p['peak_mb']:.2f}x peak memory"),
            (f"4. validation and typing alone, {v['records']:,} replies in process",
             f"{v['us_per_record']:.0f} us/record = {v['seconds']:.2f} s, {v['seconds'] / s['run_s']:.1%} of run 1; "
             f"peak {v['peak_mb']:.0f} MB allocated")]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines) + (f"\n\nconcurrency {a.concurrency}, sim latency 0 ms; the sim runs on the same "
                               f"machine\ncommand: {' '.join([Path(sys.executable).name, *sys.argv])}")


if __name__ == "__main__":
    main()
