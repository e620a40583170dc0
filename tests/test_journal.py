"""The run journal survives a kill mid-line and restores what a resume needs."""

import orjson

from conductor.execute.journal import Journal, load_state


def _step(plan, path, status="ok", cost=0.01, provider="p", cache_hit=False):
    return {"plan_id": plan, "step_path": path, "status": status, "cost_usd": cost, "provider": provider,
            "cache_hit": cache_hit, "response_text": f"out {plan} {path}"}


def test_state_restores_unfinished_plans_and_spend(tmp_path):
    j = Journal(tmp_path)
    j.step(_step("a", "0"))
    j.step(_step("a", "1"))
    j.plan({"plan_id": "a", "status": "ok"})
    j.step(_step("b", "0"))
    j.step(_step("b", "1", status="budget_exhausted", cost=None))
    j.plan({"plan_id": "b", "status": "budget_exhausted"})
    j.step(_step("c", "0", cost=0.5, cache_hit=True))
    j.close()
    s = load_state(tmp_path)
    assert s.finished == {"a"}  # b was stopped by the budget: it runs again
    assert s.outputs == {"b": {"0": "out b 0"}, "c": {"0": "out c 0"}}
    assert abs(s.spent["p"] - 0.03) < 1e-12  # cache hits cost nothing


def test_torn_last_line_is_cut_and_appending_continues(tmp_path):
    j = Journal(tmp_path)
    j.step(_step("a", "0"))
    j.close()
    with open(tmp_path / "steps.jsonl", "ab") as f:
        f.write(b'{"plan_id": "a", "step_pa')  # the process died here
    assert load_state(tmp_path).steps_logged == 1
    j = Journal(tmp_path)
    j.step(_step("a", "1"))
    j.close()
    lines = (tmp_path / "steps.jsonl").read_bytes().splitlines()
    assert [orjson.loads(x)["step_path"] for x in lines] == ["0", "1"]
