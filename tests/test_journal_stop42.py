"""A resume checks every finished plan for step lines deleted by hand (they run again, answered from
the run cache). These journals reach the edges of that check's per-plan record (more than 64 steps,
a plan finished by a second command, values edited by hand, unfinished and invalid plans): what a
resume decides there is pinned, for whoever makes the record lighter (review40b 5)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from conductor.execute.journal import load_state


def _step(pid: str, path: str, seq, status: str = "ok", attempts: int = 1) -> dict:
    return {"run_id": "r", "plan_id": pid, "step_path": path, "status": status, "attempts": attempts,
            "cache_hit": False, "provider": "sim", "cost_usd": 0.001, "request_key": f"{pid}/{path}/{seq}",
            "response_text": f"answer {path}", "sub_plan": None, "_seq": seq}


def _plan(pid: str, status: str, calls, seq, failure: str | None = None) -> dict:
    return {"run_id": "r", "plan_id": pid, "status": status, "calls": calls, "cache_hits": 0,
            "error": None if status == "ok" else "it failed", "failure": failure, "_seq": seq}


def _journal(tmp_path: Path, plans: list[dict], steps: list[dict], n_steps: dict[str, int]) -> Path:
    """A run folder as the runner leaves it: the journal in work/, the plans' step counts in plans.parquet."""
    work = tmp_path / "run" / "work"
    work.mkdir(parents=True)
    (work / "plans.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in plans))
    (work / "steps.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in steps))
    pq.write_table(pa.table({"plan_id": list(n_steps), "n_steps": list(n_steps.values())}),
                   tmp_path / "run" / "plans.parquet")
    return work


def _long_plan(missing: set[int]) -> tuple[list[dict], list[dict]]:
    steps = [_step("p", str(i), 100 + i) for i in range(70) if i not in missing]
    return [_plan("p", "ok", 70, 1000)], steps


def test_a_plan_of_seventy_steps_is_checked_past_its_64th(tmp_path):
    plans, steps = _long_plan(set())
    s = load_state(_journal(tmp_path / "a", plans, steps, {"p": 70}))
    assert s.finished == {"p"} and s.gaps == {} and s.outputs == {}

    plans, steps = _long_plan({66})
    s = load_state(_journal(tmp_path / "b", plans, steps, {"p": 70}))
    assert s.gaps == {"p": frozenset({"66"})} and s.finished == set()
    assert sorted(s.outputs["p"], key=int) == [str(i) for i in range(70) if i != 66]

    plans, steps = _long_plan({3, 69})
    s = load_state(_journal(tmp_path / "c", plans, steps, {"p": 70}))
    assert s.gaps == {"p": frozenset({"3", "69"})}


def test_a_plan_finished_by_a_second_command_counts_that_commands_calls_only(tmp_path):
    first = [_step("p", "0", 10), _plan("p", "budget_exhausted", 1, 11, failure="budget")]
    # the second command answered step 1; its line counts that one call
    s = load_state(_journal(tmp_path / "a", [first[1], _plan("p", "ok", 1, 21)], [first[0], _step("p", "1", 20)],
                            {"p": 2}))
    assert s.finished == {"p"} and s.gaps == {}
    # step 1's line deleted by hand
    s = load_state(_journal(tmp_path / "b", [first[1], _plan("p", "ok", 1, 21)], [first[0]], {"p": 2}))
    assert s.gaps == {"p": frozenset({"1"})} and s.outputs == {"p": {"0": "answer 0"}}
    # a line saying two calls: step 0's was written before the first command's plan line, so one is missing
    s = load_state(_journal(tmp_path / "c", [first[1], _plan("p", "ok", 2, 21)], [first[0], _step("p", "1", 20)],
                            {"p": 2}))
    assert s.gaps == {"p": frozenset()} and s.outputs == {"p": {"0": "answer 0", "1": "answer 1"}}


def test_a_plan_with_two_final_lines_is_checked_against_the_latest(tmp_path):
    plans = [_plan("p", "error", 1, 11, failure="other"), _plan("p", "ok", 1, 21)]
    steps = [_step("p", "0", 10, status="error"), _step("p", "0", 20)]
    s = load_state(_journal(tmp_path / "a", plans, steps, {"p": 1}))
    assert s.finished == {"p"} and s.gaps == {}
    plans[1]["calls"] = 2  # the failed try was the earlier command's: one call of this line has no line
    s = load_state(_journal(tmp_path / "b", plans, steps, {"p": 1}))
    assert s.gaps == {"p": frozenset()}


def test_values_edited_by_hand_are_compared_as_before(tmp_path):
    top = (1 << 64) - 1  # the largest integer orjson reads as one (larger ones are floats)
    cases = {  # plan line's _seq and calls, step line's _seq -> a gap found?
        "float seq, step inside": (21.5, 1, 20, False),
        "float seq, step after": (21.5, 1, 22, True),
        "largest seq, step inside": (top, 1, top - 1, False),
        "past the largest (read as a float), step inside": (float(top + 1), 1, top, False),
        "negative seq": (-5, 1, 20, True),
        "negative calls": (21, -1, 20, False),
        "float calls": (21, 1.0, 20, False),
        "float calls, step after": (21, 1.0, 22, True),
    }
    for i, (name, (seq, calls, step_seq, gap)) in enumerate(cases.items()):
        s = load_state(_journal(tmp_path / str(i), [_plan("p", "ok", calls, seq)], [_step("p", "0", step_seq)],
                                {"p": 1}))
        assert s.gaps == ({"p": frozenset()} if gap else {}), name
        assert s.finished == (set() if gap else {"p"}), name


def test_unfinished_and_invalid_plans_are_not_checked(tmp_path):
    plans = [_plan("a", "ok", 1, 11), _plan("b", "budget_exhausted", 2, 12, failure="budget"),
             _plan("c", "invalid_plan", 0, 13), _plan("d", "ok", 1, 14), _plan("d", "budget_exhausted", 1, 16,
                                                                            failure="budget")]
    steps = [_step("a", "0", 10), _step("b", "0", 9), _step("d", "0", 15)]
    s = load_state(_journal(tmp_path, plans, steps, {"a": 1, "b": 3, "c": 2, "d": 2}))
    assert s.finished == {"a", "c"} and s.invalid == {"c"} and s.gaps == {}
    assert s.outputs == {"b": {"0": "answer 0"}, "d": {"0": "answer 0"}}
    assert s.steps_logged == 3 and len(s.paid) == 3 and round(s.spent["sim"], 6) == 0.003


def test_retry_failed_leaves_an_error_plan_unchecked_and_restores_its_answers(tmp_path):
    plans = [_plan("p", "error", 2, 11, failure="other"), _plan("q", "ok", 1, 12)]
    steps = [_step("p", "0", 9), _step("p", "1", 10, status="error"), _step("q", "0", 8)]
    work = _journal(tmp_path, plans, steps, {"p": 2, "q": 1})
    s = load_state(work)
    assert s.finished == {"p", "q"} and s.gaps == {}
    s = load_state(work, retry_failed=True)
    assert s.finished == {"q"} and s.gaps == {} and s.outputs == {"p": {"0": "answer 0"}}
