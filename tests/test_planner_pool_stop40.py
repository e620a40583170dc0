"""The pool an LLM planner given by --planner-model adds its worker to: it kept the workers and
providers and dropped the rest, so with re-planning (a pool worker of kind planner) the whole
execution ran on a pool without its shared governor: rate limits and budgets meant to hold across
processes held in this process alone (review39 9, stop 40)."""

from __future__ import annotations

import yaml

from conductor.planners import make_planner
from conductor.pool import load_pool
from tests import plannersim


def test_the_planners_pool_keeps_the_shared_governor_and_the_files_providers(tmp_path):
    url = "http://127.0.0.1:9/v1"  # never called: nothing here sends a request
    path = plannersim.pool_file(tmp_path / "pool.yaml", url, planner=plannersim.planner_worker(url),
                                providers={"sim": {"max_concurrency": 4}})
    spec = yaml.safe_load(path.read_text())
    spec["governor"] = "redis://127.0.0.1:6399/0"
    path.write_text(yaml.safe_dump(spec))
    pool = load_pool(path)
    planner = make_planner("llm", model="openai/gpt-4o-mini", api_base=url, api_key_env="PLANNER_KEY")
    extended = planner.extend_pool(pool)
    assert extended.governor == "redis://127.0.0.1:6399/0"
    assert extended.path == pool.path and extended.listed == pool.listed == ("sim",)
    assert [w.id for w in extended.workers][:-1] == [w.id for w in pool.workers]
    assert extended.providers["sim"] == pool.providers["sim"]


def test_a_planner_provider_is_checked_against_the_providers_the_file_lists(tmp_path):
    """A pool without providers: has providers made for its workers; they are not a list to match."""
    url = "http://127.0.0.1:9/v1"
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"workers": [{"id": "fast", "model": "openai/fast", "api_base": url}]}))
    pool = load_pool(path)
    assert pool.listed == () and set(pool.providers) == {"openai"}
    planner = make_planner("llm", model="openai/gpt-4o-mini", api_base=url, provider="elsewhere")
    assert planner.extend_pool(pool).providers["elsewhere"].max_concurrency == 16  # default limits
