"""audit80 F6: with no llm worker of known price, the embedded planner ranks by skills alone and
`cost_weight` does nothing; the run now says so on stderr, once, as it says which workers are
counted at the dearest known price when only some are unpriced."""

from __future__ import annotations

import pytest
import yaml

from conductor.planners.embedded import EmbeddedPlanner
from conductor.pool import parse_pool
from tests.conftest import run_cli, serving
from tests.plannersim import math_queries

ALL_UNPRICED = "warning: no llm worker (fast, weak) has a price in the pool file or in litellm's cost map"


def _pool(*prices):
    workers = [{"id": n, "model": f"openai/{n}", **({"price": {"input_per_mtok": p, "output_per_mtok": p}}
                                                   if p is not None else {})}
               for n, p in zip(("fast", "weak"), prices)]
    return parse_pool({"workers": [*workers, {"id": "vote", "kind": "function"}]})


@pytest.mark.parametrize("prices, said", [((None, None), ALL_UNPRICED),
                                          ((1, None), "warning: weak: no price in the pool file nor in litellm's "
                                                      "cost map; the embedded planner counts it at the dearest"),
                                          ((1, 0), None)])
def test_each_unpriced_case_is_said_once(capsys, prices, said):
    planner, pool = EmbeddedPlanner(), _pool(*prices)
    planner.prices(pool)
    planner.prices(pool)
    err = capsys.readouterr().err
    if said is None:
        assert err == ""
    else:
        assert err.count(said) == 1 and err.count("warning:") == 1, err


def test_a_run_on_an_all_unpriced_pool_warns_once_and_runs(tmp_path):
    specs = {"fast": {"skill": 0.9, "latency_ms": {"mean": 2, "sd": 1}},
             "weak": {"skill": 0.6, "latency_ms": {"mean": 2, "sd": 1}}}
    queries = math_queries(tmp_path / "q4.parquet", 4)
    with serving(tmp_path, specs) as sim:
        pool = tmp_path / "pool.yaml"
        pool.write_text(yaml.safe_dump({"providers": {"sim": {"timeout_s": 10}}, "workers": [
            {"id": n, "model": f"openai/{n}", "provider": "sim", "api_base": sim.url} for n in specs]}))
        r = run_cli("run", queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet", "--no-cache")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count(ALL_UNPRICED) == 1 and "cost_weight has no effect" in r.stderr, r.stderr
