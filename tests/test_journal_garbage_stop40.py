"""A damaged line in a run's journal (`work/*.jsonl`) is refused with the `sed` that deletes it and
what the rerun then does. Followed, that advice must hold (audit67 F1): a finished plan whose step
line is gone ran again from nothing, so its paid step left the outputs and the totals (the plan `ok`
with 0 calls and $0). Now what the line recorded comes back from the run's own response cache, paid
once: outputs and totals equal an intact run's, and the server sees no request."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from tests import plannersim
from tests.conftest import run_cli
from tests.plannersim import psim  # noqa: F401  (the simulated server, with planner models too)

# slow: a dozen whole runs through the CLI
pytestmark = pytest.mark.slow

TIMING = {"wall_time_s", "started_at", "ended_at", "latency_s"}
ADVICE = re.compile(r"\(sed -i '(\d+)d' '([^']+)'\) and rerun: (.*)$", re.S)


@pytest.fixture
def server(psim):  # noqa: F811
    psim.clear_faults()
    psim.reset()
    return psim


def _intact(tmp_path_factory, psim, name, queries, *options, planner=None):  # noqa: F811
    """A run made without damage: its command and data folder (copied by each test)."""
    d = tmp_path_factory.mktemp(name)
    pool = plannersim.pool_file(d / "pool.yaml", psim.url, planner=planner)
    args = ["run", queries, "--pool", pool, *options, "--quiet"]
    r = run_cli(*args, "--data-dir", d / "data")
    assert r.returncode == 0, r.stderr
    return args, d / "data"


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, psim, sample_queries):  # noqa: F811
    """Twelve queries of every task, planned by the embedded planner (plans of one or two steps)."""
    q = tmp_path_factory.mktemp("q") / "q12.parquet"
    pq.write_table(pq.read_table(sample_queries).slice(0, 12), q)
    return _intact(tmp_path_factory, psim, "embedded", q)


@pytest.fixture(scope="module")
def replanned(tmp_path_factory, psim):  # noqa: F811
    """Math questions, every step after the first handing the rest of the work to a planner worker."""
    q = plannersim.math_queries(tmp_path_factory.mktemp("mq") / "math.parquet", 8)
    return _intact(tmp_path_factory, psim, "replanned", q, "--planner", "llm", "--planner-option", "worker=conductor",
                   planner=plannersim.planner_worker(psim.url, model="sim-replanner"))


def _copy(intact, tmp_path) -> tuple[list, Path, Path]:
    """The intact run's data folder without the shared response cache: what a rerun gets back can
    only come from the run's own cache (work/responses.sqlite)."""
    args, data = intact
    shutil.copytree(data, tmp_path / "data")
    for f in (tmp_path / "data").glob("cache.sqlite*"):
        f.unlink()
    return args, tmp_path / "data", next((tmp_path / "data" / "runs").iterdir())


def _lines(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


def _damage(path: Path, n: int) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    lines[n - 1] = b'{"plan_id": "garb\n'
    path.write_bytes(b"".join(lines))


def _refused_then_followed(args, data, path: Path, n: int) -> str:
    """Damage line n, check the refusal names it, run the `sed` it gives; returns what it says follows."""
    _damage(path, n)
    r = run_cli(*args, "--data-dir", data)
    assert r.returncode == 2 and f"{path}, line {n}: not a journal line" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    advice = ADVICE.search(r.stderr.strip())
    assert advice and advice.group(1) == str(n) and advice.group(2) == str(path), r.stderr
    subprocess.run(shlex.split(f"sed -i '{n}d' '{path}'"), check=True)
    return " ".join(advice.group(3).split())


def _outputs(run: Path) -> tuple[list, list, dict]:
    """What a user reads of a run: results, traces (but times) and the summary's totals."""
    def rows(name):
        return [{k: round(v, 9) if isinstance(v, float) else v for k, v in r.items() if k not in TIMING}
                for r in pq.read_table(run / f"{name}.parquet").to_pylist()]
    s = json.loads((run / "summary.json").read_text())
    totals = {k: s[k] for k in ("statuses", "calls", "cache_hits", "lost_in_flight", "failed_plans")}
    totals.update({k: round(s[k], 9) for k in ("cost_usd", "planning_cost_usd")})
    totals["spent"] = [(c["cap"], round(c["spent_usd"], 9)) for c in s["spend"]]
    return rows("results"), rows("traces"), totals


def _rerun_equals_intact(args, data, run, intact, server, *extra) -> None:
    server.reset()
    r = run_cli(*args, *extra, "--data-dir", data)
    assert r.returncode == 0, r.stderr
    assert server.log()["total"] == 0  # nothing sent: no step paid twice
    ref = next((intact[1] / "runs").iterdir())
    got, want = _outputs(run), _outputs(ref)
    assert got[2] == want[2]  # calls, cost, spend, nothing lost in flight
    assert got[0] == want[0]
    assert got[1] == want[1]


def test_a_deleted_step_line_of_a_finished_plan_runs_that_step_again_from_the_run_cache(server, tmp_path, embedded):
    args, data, run = _copy(embedded, tmp_path)
    steps = run / "work" / "steps.jsonl"
    rows = _lines(steps)
    n = next(i for i, r in enumerate(rows, 1) if r["attempts"] and r["cost_usd"])  # a paid step
    plan = rows[n - 1]["plan_id"]
    assert any(p["plan_id"] == plan and p["status"] == "ok" for p in _lines(run / "work" / "plans.jsonl"))
    said = _refused_then_followed(args, data, steps, n)
    assert said.startswith("the step it recorded runs again, taken from the response caches if it had been "
                           "answered (not paid again), and its plan with it if that had finished"), said
    _rerun_equals_intact(args, data, run, embedded, server)
    ref = next((embedded[1] / "runs").iterdir())
    mine = [r for r in _outputs(run)[1] if r["plan_id"] == plan]
    assert mine == [r for r in _outputs(ref)[1] if r["plan_id"] == plan] and mine[0]["attempts"] == 1
    # and once whole again, the journal sends no plan to run again
    plans = len(_lines(run / "work" / "plans.jsonl"))
    assert run_cli(*args, "--data-dir", data).returncode == 0
    assert len(_lines(run / "work" / "plans.jsonl")) == plans and server.log()["total"] == 0


def test_a_deleted_line_of_a_step_a_later_command_restored(server, tmp_path, embedded):
    """The plan was stopped by a budget after its first step; the next command restored that step
    from its line and finished the plan (its plan line counts no call of that step)."""
    args, data = embedded[0], tmp_path / "data"
    r = run_cli(*args, "--budget", "0.002", "--data-dir", data)
    assert r.returncode == 3, r.stderr
    run = next((data / "runs").iterdir())
    steps = run / "work" / "steps.jsonl"
    stopped = {p["plan_id"] for p in _lines(run / "work" / "plans.jsonl") if p["status"] == "budget_exhausted"}
    n = next((i for i, s in enumerate(_lines(steps), 1)
              if s["plan_id"] in stopped and s["status"] == "ok" and s["attempts"]), None)
    assert n is not None, "no plan was stopped after a paid step: lower the budget"
    assert run_cli(*args, "--budget", "1", "--data-dir", data).returncode == 0
    _refused_then_followed(args + ["--budget", "1"], data, steps, n)
    _rerun_equals_intact(args, data, run, embedded, server, "--budget", "1")


def test_a_deleted_plan_line_runs_that_plan_again_from_its_step_lines(server, tmp_path, embedded):
    args, data, run = _copy(embedded, tmp_path)
    said = _refused_then_followed(args, data, run / "work" / "plans.jsonl", 2)
    assert said.startswith("the plan it recorded runs again unless another line records it (then the latest of "
                           "those stands): its answered steps are taken from steps.jsonl, not paid again"), said
    _rerun_equals_intact(args, data, run, embedded, server)


def test_a_deleted_settlement_line_is_no_call_lost_in_flight(server, tmp_path, embedded):
    """Each call's reservation line is settled by a second line once answered; without that second
    line, the answered call was counted on every later command as lost in flight (maybe billed)."""
    args, data, run = _copy(embedded, tmp_path)
    path = run / "work" / "reservations.jsonl"
    n = next(i for i, r in enumerate(_lines(path), 1) if r.get("settled"))
    said = _refused_then_followed(args, data, path, n)
    assert said.startswith("nothing runs again. If the line recorded a call sent and never answered"), said
    _rerun_equals_intact(args, data, run, embedded, server)


@pytest.mark.parametrize("which", ["a sub-plan's step", "a re-planning step's planning call", "a re-planning step"])
def test_a_deleted_line_inside_a_re_planning_step_is_restored_too(server, tmp_path, replanned, which):
    """Steps of a sub-plan are not counted by their plan's line: every step the sub-plan holds must
    have a line, and the planning call that wrote the sub-plan too."""
    args, data, run = _copy(replanned, tmp_path)
    steps = run / "work" / "steps.jsonl"
    pattern = {"a sub-plan's step": r"\d+\.\d+", "a re-planning step's planning call": r"\d+\.plan",
               "a re-planning step": r"[1-9]"}[which]
    n = next(i for i, s in enumerate(_lines(steps), 1) if re.fullmatch(pattern, s["step_path"])
             and (s["sub_plan"] if which == "a re-planning step" else s["attempts"]))
    _refused_then_followed(args, data, steps, n)
    _rerun_equals_intact(args, data, run, replanned, server)


def test_a_deleted_line_of_the_llm_planners_journal_is_said_to_move_its_cost_to_lost_in_flight(
        server, tmp_path, replanned):
    """Planning is not run again once the plans are written: the refusal says where the call's cost goes."""
    args, data, run = _copy(replanned, tmp_path)
    path = run / "work" / "planner" / "steps.jsonl"
    cost = _lines(path)[0]["cost_usd"]
    said = _refused_then_followed(args, data, path, 1)
    assert said.startswith("the planning call it recorded is asked again, from the planner's response cache (not "
                           "paid again), if planning had not finished; if it had, nothing runs again, and that "
                           "call's cost moves from the planning cost to the lost-in-flight line"), said
    assert run_cli(*args, "--data-dir", data).returncode == 0 and server.log()["total"] == 0
    got, want = _outputs(run), _outputs(next((replanned[1] / "runs").iterdir()))
    assert got[:2] == want[:2]
    assert got[2]["planning_cost_usd"] == pytest.approx(want[2]["planning_cost_usd"] - cost, abs=1e-9)
    assert got[2]["lost_in_flight"]["calls"] == 1 and got[2]["lost_in_flight"]["reserved_usd"] == pytest.approx(cost)
    assert got[2]["spent"] == want[2]["spent"]  # budgets count it all the same


def test_a_clock_stepped_back_between_commands_never_orders_new_lines_before_old_ones(tmp_path):
    """The gap check orders a plan's lines by `_seq`: with the wall clock alone, a clock stepped
    back between two commands made an intact finished plan look short of step lines (run again,
    and a failed step sent and paid again) (review40b 4)."""
    import time

    from conductor.execute.journal import PLANS_FILE, STEPS_FILE, Journal

    work = tmp_path / "work"
    work.mkdir()
    ahead = time.time_ns() + 3600 * 10**9  # the last command ran with a clock an hour ahead
    (work / STEPS_FILE).write_bytes(orjson.dumps({"plan_id": "p", "step_path": "0", "_seq": ahead}) + b"\n")
    (work / PLANS_FILE).write_bytes(orjson.dumps({"plan_id": "p", "_seq": ahead - 5}) + b"\n")
    journal = Journal(work)
    journal.step({"plan_id": "q", "step_path": "0"})
    journal.plan({"plan_id": "q"})
    journal.close()
    steps = [orjson.loads(line) for line in (work / STEPS_FILE).read_bytes().splitlines()]
    plans = [orjson.loads(line) for line in (work / PLANS_FILE).read_bytes().splitlines()]
    assert ahead < steps[-1]["_seq"] < plans[-1]["_seq"]
