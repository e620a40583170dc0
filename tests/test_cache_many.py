"""The response cache's bulk look-up (a cached rerun's path) finds exactly what
one look-up per key finds, on a real SQLite file."""

from __future__ import annotations

import orjson
import pytest

from conductor.execute import cache as cache_mod
from conductor.execute.cache import Cache, Entry


@pytest.mark.parametrize("json_each", [True, False])
def test_get_many_finds_what_get_finds(tmp_path, monkeypatch, json_each):
    monkeypatch.setattr(cache_mod, "_JSON_EACH", json_each)  # both query forms (old SQLite lacks json_each)
    c = Cache(tmp_path / "c.sqlite")
    for i in range(1200):
        c.put(f"k{i}", "m", Entry(f"answer {i}", i, 2, False, True, 0.001 * i, 0.05, None, 1))
    c.flush()
    # an entry written before `logprob` and `attempts` existed
    old = {"text": "old", "prompt_tokens": 1, "completion_tokens": 1, "usage_estimated": False,
           "simulated": False, "cost_usd": None, "latency_s": 0.1}
    c._db.execute("INSERT INTO responses VALUES (?, ?, ?, ?)", ("old", "m", orjson.dumps(old), 0.0))
    keys = [f"k{i}" for i in range(0, 2400, 2)] + ["k1", "k1", "missing", "old"]
    got = c.get_many(keys)
    assert set(got) == {k for k in keys if c.get(k) is not None}
    assert all(got[k] == c.get(k) for k in got)
    assert got["old"].attempts == 1 and got["old"].logprob is None and got["old"].text == "old"
    assert "missing" not in got and got["k1"].text == "answer 1"
    c.close()
