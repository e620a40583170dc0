"""Export a run's rollouts for RL trainers: TRL (GRPO) and verl, as Parquet and JSONL.

For every plan: the prompt a planner LLM is (or would be) asked, as chat
messages; the plan it wrote, as the assistant's completion; the reward and
the group advantage; the completion's log-probability (LLM planners) or the
policy's propensity (embedded planner); the plan's cost. For the embedded
planner, which reads no prompt, the prompt is the one `conductor.planners.prompt`
renders for an LLM conductor over the same pool, and the completion is the plan
JSON it chose: exactly the pair a conductor LLM would be trained to produce.

Layouts (both files of a layout hold the same rows):
- trl: one row per plan. `prompt` and `completion` in TRL's conversational
  prompt-completion format, `reward`, `advantage`, and the columns a reward
  function may want (`reference`, `task`, ...).
- verl: one row per query, in verl's RL dataset layout (`data_source`,
  `prompt`, `ability`, `reward_model` {style, ground_truth}, `extra_info`),
  with the K rollouts as parallel lists (`responses`, `rewards`, `advantages`, ...).

A sweep's unused slots (plans marked "sweep slot not used": the query has fewer
candidate actions than the sweep's K) are left out of both layouts: they are
no rollouts. export.json counts them (`unused_sweep_slots`). export.json is
written last (`_write_set`): a folder without it holds an incomplete export.

Rewards are the run's (the rewards table). With `cost_penalty`, they are
recomputed from the same grades, 1 / 0.5 / 0 minus cost_penalty x USD, with the
plan's full cost (answers served from the cache charged what they first cost),
and the advantages with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from conductor.errors import ConductorError
from conductor.planners import prompt as prompts
from conductor.planners.base import UNUSED_SLOT, Query
from conductor.pool import load_pool
from conductor.queries import load_queries
from conductor.rewards import RewardScheme, group_advantages
from conductor.store import RunDir, replacing

FORMATS = ("trl", "verl")
FORMAT_VERSION = 1
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))

TRL = pa.schema([
    ("prompt", MESSAGES), ("completion", MESSAGES),
    ("reward", pa.float64()), ("advantage", pa.float64()),
    ("logprob", pa.float64()), ("propensity", pa.float64()), ("cost_usd", pa.float64()),
    ("correct", pa.bool_()), ("parsed", pa.bool_()), ("status", pa.string()),
    ("task", pa.string()), ("reference", pa.string()),
    ("query_id", pa.string()), ("plan_id", pa.string()), ("sample", pa.int32()),
    ("run_id", pa.string()), ("planner", pa.string()), ("template_version", pa.string()),
])

VERL = pa.schema([
    ("data_source", pa.string()), ("prompt", MESSAGES), ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string()), ("query_id", pa.string()),
                              ("run_id", pa.string()), ("planner", pa.string())])),
    ("responses", pa.list_(pa.string())), ("rewards", pa.list_(pa.float64())),
    ("advantages", pa.list_(pa.float64())), ("logprobs", pa.list_(pa.float64())),
    ("propensities", pa.list_(pa.float64())), ("costs_usd", pa.list_(pa.float64())),
    ("plan_ids", pa.list_(pa.string())),
])

SCHEMAS = {"trl": TRL, "verl": VERL}


@dataclass
class Export:
    parquet: Path
    jsonl: Path
    meta: Path
    rows: int
    plans: int
    unused: int = 0  # a sweep's unused slots, left out


def export_run(data_dir: Path, run_id: str, fmt: str, out: Path, *, pool_path: Path | None = None,
               cost_penalty: float | None = None, max_steps: int | None = None) -> Export:
    if fmt not in FORMATS:
        raise ConductorError(f"--format {fmt!r}: choose from {', '.join(FORMATS)}")
    if cost_penalty is not None and not 0 <= cost_penalty < math.inf:
        raise ConductorError(f"--cost-penalty must be a finite number, at least 0 (got {cost_penalty})")
    if Path(out).exists() and not Path(out).is_dir():
        raise ConductorError(f"--out {out}: is a file; give a folder (it gets train.parquet, train.jsonl and "
                             f"export.json)")
    run = RunDir(data_dir, run_id)
    if not run.exists():
        raise ConductorError(f"run {run_id}: not found under {run.data_dir / 'runs'}")
    for name in ("plans", "rewards", "traces"):
        if not run.table(name).exists():
            raise ConductorError(f"run {run_id}: no {name}.parquet (status {run.read_manifest().get('status')}); "
                                 f"finish the run first")
    inputs = run.read_manifest()["inputs"]
    pool_file = Path(pool_path or inputs["pool"])
    if pool_path is not None and not pool_file.exists():
        raise ConductorError(f"--pool {pool_file}: not found")
    if not pool_file.exists():
        raise ConductorError(f"run {run_id}: its pool file {pool_file} is gone; pass --pool (the prompt lists "
                             f"the pool's workers)")
    qfile = Path(inputs["queries"])
    if not qfile.exists():
        raise ConductorError(f"run {run_id}: its query set {qfile} is gone; the prompt needs the query text")
    pool = load_pool(pool_file)
    steps = max_steps or int(inputs.get("max_steps") or 5)
    queries = {r["query_id"]: r for r in load_queries(qfile).to_pylist()}
    plans = _plans(run)
    unused = sum(_unused_slot(p) for p in plans)
    plans = [p for p in plans if not _unused_slot(p)]
    if cost_penalty is not None:
        _rescore(plans, RewardScheme(cost_penalty=cost_penalty))
    rendered: dict[str, list[dict[str, str]]] = {}
    rows, routed = [], set()
    for p in plans:
        q = queries[p["query_id"]]
        msgs = _logged_prompt(p)
        if msgs is None:  # rendered over `pool`: the plan's workers must be among those it lists
            msgs = _render(p, q, pool, steps, rendered)
            routed.update(p["workers"] or ())
        rows.append({
            "prompt": msgs,
            "completion": [{"role": "assistant", "content": p["raw_text"] or ""}],
            "reward": p["reward"], "advantage": p["advantage"], "logprob": p["logprob"],
            "propensity": p["propensity"], "cost_usd": p["cost_full"], "correct": p["correct"],
            "parsed": p["parsed"], "status": p["status"], "task": q["task"], "reference": q["reference"],
            "query_id": p["query_id"], "plan_id": p["plan_id"], "sample": p["sample"], "run_id": run_id,
            "planner": p["planner"], "template_version": p["template_version"],
            "_index": p["query_index"], "_metadata": q["metadata"],
        })
    missing = sorted(w for w in routed if not pool.has(w))
    if missing:
        raise ConductorError(f"run {run_id}: its plans route steps to {', '.join(missing)}, which pool {pool_file} "
                             f"lacks, so the prompts would not list workers their completions use; pass a --pool "
                             f"with every worker the run used (the run used {inputs['pool']})")
    table_rows = rows if fmt == "trl" else _verl_rows(rows, inputs, qfile)
    for r in table_rows:
        r.pop("_index", None)
        r.pop("_metadata", None)
    out = Path(out)
    table = pa.Table.from_pylist(table_rows, schema=SCHEMAS[fmt])
    paths = Export(out / "train.parquet", out / "train.jsonl", out / "export.json", table.num_rows, len(plans),
                   unused)
    meta = {"format": fmt, "format_version": FORMAT_VERSION, "run_id": run_id, "rows": table.num_rows,
            "plans": len(plans), "unused_sweep_slots": unused, "queries": len({p["query_id"] for p in plans}),
            "reward": ("the run's rewards table" if cost_penalty is None else
                       f"recomputed: 1 correct, 0.5 parsed but wrong, 0 otherwise, minus {cost_penalty:g} x USD"),
            "columns": table.schema.names, "pool": str(pool_file), "query_set": str(qfile)}
    _write_set(paths, table, meta)
    return paths


def _write_set(paths: Export, table: pa.Table, meta: dict[str, Any]) -> None:
    """Write the three files so that a reader never mixes two exports. Each file is
    replaced atomically, but not the set: so export.json and the previous data files
    are removed first, and export.json is written last. A kill at any point leaves
    either the previous complete set or a part of the new one without export.json:
    export.json present means its train.parquet and train.jsonl are complete and its own."""
    out = paths.parquet.parent
    out.mkdir(parents=True, exist_ok=True)
    for f in (paths.meta, paths.parquet, paths.jsonl):  # export.json first: the set is incomplete from here
        f.unlink(missing_ok=True)
        for tmp in out.glob(f".{f.name}.*.tmp"):  # left by a killed export
            tmp.unlink(missing_ok=True)
    _write(paths.parquet, lambda tmp: pq.write_table(table, tmp, compression="zstd"))
    _write(paths.jsonl, lambda tmp: tmp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in table.to_pylist())))
    _write(paths.meta, lambda tmp: tmp.write_bytes(orjson.dumps(meta, option=orjson.OPT_INDENT_2)))


def _plans(run: RunDir) -> list[dict[str, Any]]:
    """Plans joined with their rewards and their full cost, in query then sample order."""
    con = duckdb.connect(":memory:")
    try:
        cur = con.execute("""
            SELECT p.plan_id, p.query_id, p.query_index, p.sample, p.planner, p.template_version,
                   p.planner_prompt, p.raw_text, p.info_json, p.logprob, p.propensity,
                   p.valid, p.error AS plan_error, p.workers,
                   r.status, r.parsed, r.correct, r.reward, r.advantage, r.cost_usd,
                   coalesce(t.cost, r.cost_usd) AS cost_full
            FROM read_parquet(?) p JOIN read_parquet(?) r USING (plan_id)
            LEFT JOIN (SELECT plan_id, sum(coalesce(original_cost_usd, cost_usd)) AS cost
                       FROM read_parquet(?) GROUP BY plan_id) t USING (plan_id)
            ORDER BY p.query_index, p.sample""",
                          [str(run.table("plans")), str(run.table("rewards")), str(run.table("traces"))])
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]
    finally:
        con.close()


def _unused_slot(p: dict[str, Any]) -> bool:
    """A sweep's filler plan: the query had fewer candidates than K; no rollout."""
    return not p["valid"] and (p["plan_error"] or "").startswith(UNUSED_SLOT)


def _rescore(plans: list[dict[str, Any]], scheme: RewardScheme) -> None:
    groups: dict[str, list[dict[str, Any]]] = {}
    for p in plans:
        if p["correct"] is None:
            p["reward"] = None
        else:
            base = (scheme.correct if p["correct"] else
                    scheme.wrong if p["parsed"] and p["status"] == "ok" else scheme.unparsed)
            p["reward"] = base - scheme.cost_penalty * (p["cost_full"] or 0.0)
        groups.setdefault(p["query_id"], []).append(p)
    for g in groups.values():
        for p, a in zip(g, group_advantages([p["reward"] for p in g], scheme.eps)):
            p["advantage"] = a


def _logged_prompt(p: dict[str, Any]) -> list[dict[str, str]] | None:
    """The chat messages an LLM planner logged, or None (embedded planner; vLLM's templated string)."""
    if p["planner_prompt"]:
        try:
            msgs = orjson.loads(p["planner_prompt"])
            if isinstance(msgs, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in msgs):
                return [{"role": m["role"], "content": m["content"]} for m in msgs]
        except orjson.JSONDecodeError:
            pass  # a chat-templated string (vLLM): render the messages it was made from
    return None


def _render(p: dict[str, Any], q: dict[str, Any], pool, max_steps: int,
            rendered: dict[str, list[dict[str, str]]]) -> list[dict[str, str]]:
    """The messages a conductor LLM over `pool` is given for this query (cached per query and mode)."""
    info = orjson.loads(p["info_json"]) if p["info_json"] else {}
    mode = info.get("mode") if info.get("mode") in prompts.MODES else "structured"
    key = f"{q['query_id']}\0{mode}"
    if key not in rendered:
        query = Query(query_id=q["query_id"], prompt=q["prompt"], task=q["task"])
        rendered[key] = prompts.messages(query, pool, mode, max_steps)
    return rendered[key]


def _verl_rows(rows: list[dict[str, Any]], inputs: dict[str, Any], qfile: Path) -> list[dict[str, Any]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["query_id"], []).append(r)
    out = []
    for qid, g in groups.items():
        first = g[0]
        meta = orjson.loads(first["_metadata"]) if first["_metadata"] else {}
        source = meta.get("dataset") if isinstance(meta, dict) and meta.get("dataset") else qfile.stem
        split = meta.get("split") if isinstance(meta, dict) and isinstance(meta.get("split"), str) else "train"
        out.append({
            "data_source": f"conductor/{source}",
            "prompt": first["prompt"],
            "ability": first["task"] or "general",
            "reward_model": {"style": "rule", "ground_truth": first["reference"]},
            "extra_info": {"index": first["_index"], "split": split, "query_id": qid, "run_id": first["run_id"],
                           "planner": first["planner"]},
            "responses": [r["completion"][0]["content"] for r in g],
            "rewards": [r["reward"] for r in g],
            "advantages": [r["advantage"] for r in g],
            "logprobs": [r["logprob"] for r in g],
            "propensities": [r["propensity"] for r in g],
            "costs_usd": [r["cost_usd"] for r in g],
            "plan_ids": [r["plan_id"] for r in g],
        })
    return out


def _write(path: Path, write) -> None:
    with replacing(path) as tmp:
        write(tmp)
