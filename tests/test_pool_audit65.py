"""Pool-file and CLI findings of audit65 (F5, F9, F11): what a user reads when a pool file is
not what they meant, and what `conductor run --help` tells them."""

from __future__ import annotations

import re

import pytest

from conductor.errors import PoolError
from conductor.pool import load_pool
from tests.conftest import SAMPLE, cli

PRICE = "{input_per_mtok: 1, output_per_mtok: 2}"


def _runs(data_dir) -> list:
    runs = data_dir / "runs"
    return sorted(runs.iterdir()) if runs.exists() else []


def test_a_worker_without_provider_outside_every_listed_provider_is_refused(tmp_path, sample_queries):
    """F5: its calls ran on the model's prefix (`openai`), with default limits, outside the file's
    budgets, and no summary line said so: the same as the misspelled provider the README refuses."""
    pool = tmp_path / "pool.yaml"
    pool.write_text(f"providers:\n  sim: {{budget_usd: 5}}\n  sim-large: {{budget_usd: 5}}\nworkers:\n"
                    f"  - {{id: small, model: openai/sim-small, api_base: 'http://127.0.0.1:9/v1', price: {PRICE}}}\n"
                    f"  - {{id: mid, provider: sim, model: openai/sim-mid, price: {PRICE}}}\n")
    r = cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"pool file {pool}: workers[0] (small).provider: required" in r.stderr, r.stderr
    assert "(sim, sim-large)" in r.stderr and "'openai'" in r.stderr and "no budget" in r.stderr
    assert _runs(tmp_path / "data") == []
    # As the message says: listing the prefix's provider allows it, and a function worker calls nothing.
    pool.write_text(f"providers:\n  sim: {{budget_usd: 5}}\n  openai: {{}}\nworkers:\n"
                    f"  - {{id: small, model: openai/sim-small, price: {PRICE}}}\n"
                    "  - {id: vote, kind: function}\n")
    loaded = load_pool(pool)
    assert loaded.worker("small").provider == "openai" and loaded.worker("vote").provider == "local"


def test_an_empty_pool_file_asks_for_workers_only(tmp_path):
    """F11: it was told it needed 'workers' and 'providers', and providers are optional."""
    pool = tmp_path / "pool.yaml"
    pool.write_text("# nothing yet\n")
    with pytest.raises(PoolError) as e:
        load_pool(pool)
    assert str(e.value) == (f"pool file {pool}: the file is empty: it needs a workers: list "
                            f"(providers:, version:, governor: and replay: are optional)")


def test_a_key_given_twice_is_located_as_other_pool_messages_locate_it(tmp_path):
    """F11: `workers.0.price`, where every other message says `workers[0] (small).price`."""
    pool = tmp_path / "pool.yaml"
    pool.write_text("workers:\n  - id: small\n    model: openai/s\n"
                    f"    price: {PRICE}\n    price: {PRICE}\n"
                    "  - id: vote\n    kind: function\n    params: {a: 1, a: 2}\n")
    with pytest.raises(PoolError) as e:
        load_pool(pool)
    assert str(e.value) == f"pool file {pool}:5: workers[0] (small).price: given twice (lines 4 and 5); keep one"
    pool.write_text("workers:\n  - [1, {a: 1, a: 2}]\n")  # an item with no id: its index alone
    with pytest.raises(PoolError, match=re.escape(r":2: workers[0][1].a: given twice")):
        load_pool(pool)


def test_an_empty_price_names_the_usual_keys(tmp_path):
    pool = tmp_path / "pool.yaml"
    pool.write_text("workers:\n  - {id: w, model: openai/m, price: {}}\n")
    with pytest.raises(PoolError) as e:
        load_pool(pool)
    assert "workers[0] (w).price: give input_per_mtok and output_per_mtok (USD per million tokens), " \
           "or input_per_token and output_per_token" in str(e.value)


def test_sim_with_nothing_to_serve_names_the_pool_file(tmp_path):
    """F11: `conductor sim` said "the pool has no llm or planner worker ..." without saying which pool."""
    pool = tmp_path / "pool.yaml"
    pool.write_text("workers:\n  - {id: vote, kind: function}\n  - {id: c, model: anthropic/claude}\n")
    r = cli("sim", "--pool", pool, "--queries", SAMPLE, "--port", "0")
    assert r.returncode == 2
    assert f"pool file {pool}: the pool has no llm or planner worker with an 'openai/<name>' model" in r.stderr


def _option_help(text: str, flag: str) -> str:
    """The help paragraph of one option in argparse's output, on one line."""
    m = re.search(rf"^  {re.escape(flag)}\b(.*?)(?=^  -|\Z)", text, re.M | re.S)
    assert m, f"{flag} not in the help"
    return " ".join(m.group(1).split())


@pytest.mark.parametrize("flag, default", [
    ("--samples", "default 1"), ("--max-depth", "default 1"), ("--cost-penalty", "default 0"),
    ("--planner", "embedded (the default)"), ("--seed", "default 0"),
])
def test_run_help_gives_each_default_the_readme_states(flag, default):
    """F9: `run --help` gave no default for these, and no help at all for --seed."""
    r = cli("run", "--help")
    assert r.returncode == 0
    assert default in _option_help(r.stdout, flag)


def test_a_planner_worker_without_a_model_needs_no_provider(tmp_path):
    """The pool's `kind: planner` worker without a model is the run's own planner (its provider is
    the planner's): the providers: rule must not refuse the pool the vLLM re-planning test uses."""
    f = tmp_path / "pool.yaml"
    f.write_text("providers:\n  sim: {}\nworkers:\n  - {id: fast, provider: sim, model: openai/fast}\n"
                 "  - {id: conductor, kind: planner, description: plans a sub-workflow}\n")
    assert [w.id for w in load_pool(f).workers] == ["fast", "conductor"]
