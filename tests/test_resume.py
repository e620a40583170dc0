"""A run killed with SIGKILL at any moment continues where it was when the same
command is run again: no finished call is sent twice, and the outputs are the
rows of an uninterrupted run."""

from __future__ import annotations


import orjson
import pyarrow.parquet as pq
import pytest

from tests.conftest import kill_when_journaled, run_cli, write_pool

# slow: runs killed mid-flight and resumed, through the CLI
pytestmark = pytest.mark.slow

TRACE_COLS = ["plan_id", "step_path", "worker", "status", "instruction", "response_text",
              "prompt_tokens", "completion_tokens", "request_key"]
RESULT_COLS = ["plan_id", "query_index", "sample", "status", "final_answer"]
REWARD_COLS = ["plan_id", "answer", "correct", "reward", "advantage"]


def _outputs(run_dir):
    results = pq.read_table(run_dir / "results.parquet")
    # When two sampled plans send the same request at once, one pays and the other
    # shares the answer; which one is a matter of timing, so cost is compared per query.
    cost = {}
    for r in results.select(["query_id", "cost_usd", "calls"]).to_pylist():
        c = cost.setdefault(r["query_id"], [0.0, 0])
        c[0] += r["cost_usd"]
        c[1] += r["calls"]
    return {
        "traces": pq.read_table(run_dir / "traces.parquet", columns=TRACE_COLS).to_pylist(),
        "results": results.select(RESULT_COLS).to_pylist(),
        "rewards": pq.read_table(run_dir / "rewards.parquet", columns=REWARD_COLS).to_pylist(),
        "plans": pq.read_table(run_dir / "plans.parquet").drop(["run_id"]).to_pylist(),
        "cost_per_query": {q: (round(c, 12), n) for q, (c, n) in cost.items()},
    }


def _journal_keys(run_dir):
    path = run_dir / "work" / "steps.jsonl"
    if not path.exists():
        return set()
    keys = set()
    for line in path.read_bytes().splitlines():
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # the torn last line
        if row["status"] == "ok" and row["attempts"]:
            keys.add(row["request_key"])
    return keys


@pytest.mark.parametrize("cache", ["default", "--no-cache"])
def test_sigkill_at_any_moment_then_the_same_command_finishes_the_run(tmp_path, fresh_sim, sample_queries, cache):
    fresh_sim.set_faults(latency_ms=25, latency_sd_ms=10)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url, providers={"sim": {"max_concurrency": 8}})
    extra = [] if cache == "default" else ["--no-cache"]
    args = ["run", str(sample_queries), "--pool", str(pool), "--samples", "2", "--quiet", *extra]

    # The reference: the same run, never interrupted, in its own folder.
    ref = run_cli(*args, "--data-dir", tmp_path / "ref", "--no-cache")
    assert ref.returncode == 0, ref.stderr
    expected = _outputs(next((tmp_path / "ref" / "runs").iterdir()))
    n_steps = len(expected["traces"])
    fresh_sim.reset()

    data = tmp_path / "data"
    # After each kill: which calls the journal holds as finished, and how often
    # the server had answered each request by then.
    checkpoints: list[tuple[set[str], dict[str, int]]] = []
    kills = 0
    for target in (n_steps // 5, n_steps // 2, (4 * n_steps) // 5):
        run_dir = kill_when_journaled(args, data, target)
        if run_dir is not None:
            kills += 1
            checkpoints.append((_journal_keys(run_dir), fresh_sim.log()["by_request_key"]))
    assert kills >= 2, "the run finished before it could be killed; make it slower"

    final = run_cli(*args, "--data-dir", data)
    assert final.returncode == 0, final.stderr
    assert "(resumed)" in final.stdout
    run_dir = next((data / "runs").iterdir())
    got = _outputs(run_dir)
    for name in ("plans", "traces", "results", "rewards", "cost_per_query"):
        assert got[name] == expected[name], name

    sent = fresh_sim.log()["by_request_key"]
    for finished, sent_then in checkpoints:
        assert finished
        again = [k for k in finished if sent.get(k) != sent_then.get(k)]
        assert again == [], f"{len(again)} call(s) finished before a kill were sent again after it"
    assert set(sent) == {t["request_key"] for t in got["traces"]}


@pytest.mark.parametrize("flag", ["--refresh", "--no-cache", "--refresh --no-cache"])
def test_refresh_on_a_run_that_exists_says_that_finished_plans_keep_their_answers(tmp_path, fresh_sim,
                                                                                  sample_queries, flag):
    """The run id does not depend on the cache flags, so the same command with --refresh resumes
    the finished run and sends nothing (audit38): a user refreshing after a provider changed a
    model must be told, not shown the old answers as if fresh."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    data = tmp_path / "data"
    assert run_cli("run", sample_queries, "--pool", pool, "--quiet", "--data-dir", data).returncode == 0
    fresh_sim.reset()
    again = run_cli("run", sample_queries, "--pool", pool, "--quiet", "--data-dir", data, *flag.split())
    assert again.returncode == 0, again.stderr
    assert fresh_sim.log()["total"] == 0
    assert f"{flag} applies only to the calls it sent" in again.stderr
    assert f"start a new run: --run-id NEW {flag}" in again.stderr
    fresh = run_cli("run", sample_queries, "--pool", pool, "--quiet", "--data-dir", data, *flag.split(), "--run-id",
                    "anew")
    assert fresh.returncode == 0 and "applies only" not in fresh.stderr
    assert fresh_sim.log()["total"] > 0  # a new run asks again


def test_an_answer_claimed_from_the_run_cache_is_not_counted_again_by_a_later_resume(tmp_path, fresh_sim,
                                                                                    sample_queries):
    """A process killed after the run cache kept an answer but before the journal logged it: the
    resume records it as the paid call it was. Its reservation stayed unsettled, so every later
    command on the run counted the same call again, as lost in flight."""
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    data = tmp_path / "data"
    args = ("run", sample_queries, "--pool", pool, "--quiet", "--no-cache", "--data-dir", data)
    assert run_cli(*args).returncode == 0
    work = next((data / "runs").iterdir()) / "work"
    steps = [orjson.loads(x) for x in (work / "steps.jsonl").read_bytes().splitlines()]
    cut = next(s for s in reversed(steps) if s.get("attempts"))  # the kill took its row, its settling, its plan
    (work / "steps.jsonl").write_bytes(b"".join(orjson.dumps(s) + b"\n" for s in steps if s is not cut))
    reservations = [orjson.loads(x) for x in (work / "reservations.jsonl").read_bytes().splitlines()]
    rid = next(r["id"] for r in reservations if r.get("key") == cut["request_key"])
    (work / "reservations.jsonl").write_bytes(b"".join(
        orjson.dumps(r) + b"\n" for r in reservations if not (r["id"] == rid and "settled" in r)))
    plans = [orjson.loads(x) for x in (work / "plans.jsonl").read_bytes().splitlines()]
    (work / "plans.jsonl").write_bytes(b"".join(
        orjson.dumps(p) + b"\n" for p in plans if p["plan_id"] != cut["plan_id"]))
    (next((data / "runs").iterdir()) / "results.parquet").unlink()
    cost = orjson.loads((work.parent / "summary.json").read_bytes())["cost_usd"]
    fresh_sim.reset()
    for i in range(2):  # the resume claims the answer; the next command must not count it again
        r = run_cli(*args)
        assert r.returncode == 0 and "lost in flight" not in r.stdout, (i, r.stdout + r.stderr)
        summary = orjson.loads((work.parent / "summary.json").read_bytes())
        assert summary["lost_in_flight"]["calls"] == 0
        assert summary["cost_usd"] == pytest.approx(cost)
    assert fresh_sim.log()["total"] == 0  # answered from the run cache, never sent again
