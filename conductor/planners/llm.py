"""A planner that is any chat model litellm reaches: a hosted frontier model, or a
vLLM (or other OpenAI-compatible) server.

It reads the same prompt as the vLLM planner (conductor.planners.prompt) and is
held to the same schema: `response_format` carries `plan_schema` as a JSON
schema where the model supports it (`structured`: auto asks litellm, on forces
it, off never); otherwise it writes the free mode's three lists, which
conductor.plans parses.

Its calls are ordinary executor calls (`Executor.call_worker`), so they share
everything the workers' calls get: the response cache, the provider's rate
limits and budget, the run's USD cap, retries, and a journal. The planner's
journal and run cache live in their own folder (the runner binds it to
`<run>/work/planner/`), so a killed planning stage resumes without paying twice,
and execute_stage counts what planning spent against the same budgets.

The model is a pool worker of kind "planner" (`worker=<id>`: its provider's
limits and budget apply), or a litellm model string (`model=...`), which adds
an implicit planner worker on its own provider with default limits (or on the
pool's provider of the same name). Sample k of a query sends `seed + k`, so K
samples are K distinct requests (and cache entries).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import orjson

from conductor.errors import ConductorError, PoolError
from conductor.execute.cache import Entry
from conductor.execute.context import ExecutionContext
from conductor.execute.engine import ExecOptions, PlanJob, StepFailed
from conductor.execute.journal import RETRY_TRANSIENT, TRANSIENT_KINDS, load_state, step_failures
from conductor.planners import prompt as prompts
from conductor.planners.base import PlanDraft, PlannerBackEnd, PlanningStopped, Query, option_checks, top_level_kinds
from conductor.planners.schema import FREE_MAX_TOKENS, max_plan_chars, plan_schema, shape_problem
from conductor.plans import DEFAULT_MAX_STEPS, Step
from conductor.pool import WORKER_KINDS, Pool, Worker, parse_pool, provider_from_model, unlisted
from conductor.progress import Progress
from conductor.yamlkeys import shown_value

IMPLICIT_WORKER = "conductor-planner"
SWITCHES = ("auto", "on", "off")
MODEL_ONLY = ("api_base", "provider", "api_key_env", "price")  # settings of the worker `model` adds
# Options that never change a plan (the NAME of the key's variable): left out of the run id, so
# adding or changing one resumes the run (runner.prepare).
OUTSIDE_RUN_ID = ("api_key_env",)
_whole, _number = option_checks("LLM planner")


@dataclass
class LLMPlannerConfig:
    model: str | None = None  # litellm model string (adds an implicit planner worker)
    worker: str | None = None  # or: id of a pool worker of kind "planner"
    api_base: str | None = None  # with `model`: an OpenAI-compatible endpoint
    provider: str | None = None  # with `model`: provider id (default: the model string's prefix)
    api_key_env: str | None = None  # with `model`, on a provider the pool lacks: NAME of the key's env variable
    price: dict[str, float] | None = None  # with `model`: {input_per_mtok, output_per_mtok}
    structured: str = "auto"  # response_format json_schema: auto | on | off
    strict: bool = True  # json_schema "strict" flag
    temperature: float | None = None  # None: the worker's params, else 1.0
    top_p: float | None = None
    max_tokens: int | None = None  # None: the worker's params, else the schema's bound / FREE_MAX_TOKENS
    logprobs: str = "auto"  # request log-probabilities: auto (where litellm says supported) | on | off
    seed: int | None = None  # sample k sends seed + k; None: the run's seed
    max_steps: int = DEFAULT_MAX_STEPS
    instruction_chars: int = prompts.DEFAULT_INSTRUCTION_CHARS
    kinds: tuple[str, ...] = WORKER_KINDS  # worker kinds a plan may use
    max_in_flight: int | None = None  # drafts planned at once; None: from the provider's concurrency

    def __post_init__(self) -> None:
        """Every option checked before the run folder is written: bad values went to the server
        as they were, and max_tokens=-100000 with a price credited the run's budget back."""
        self._check_model()
        _check_price(self.price)
        self._check_sampling()
        self._check_kinds()

    def _check_model(self) -> None:
        for name in ("model", "worker", "provider", "api_base"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConductorError(f"LLM planner: {name} must be text (got {shown_value(value)})")
        if self.api_key_env is not None and not isinstance(self.api_key_env, str):
            raise ConductorError("LLM planner: api_key_env must be the NAME of an environment variable "
                                 "(the value is not shown)")
        if self.model is not None and self.worker is not None:
            raise ConductorError("LLM planner: give either model (a litellm model string) or worker "
                                 "(a pool worker of kind planner), not both")
        if self.model is None and (given := [n for n in MODEL_ONLY if getattr(self, n) is not None]):
            several = len(given) > 1
            raise ConductorError(
                f"LLM planner: option{'s' * several} {', '.join(given)} appl{'y' if several else 'ies'} only with "
                f"a model string (--planner-model); a pool worker of kind planner takes its endpoint, key and "
                f"price from the pool file: set them on that worker and its provider there")

    def _check_sampling(self) -> None:
        for name in ("structured", "logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool):  # YAML reads on/off as booleans
                value = "on" if value else "off"
                setattr(self, name, value)
            if value not in SWITCHES:
                raise ConductorError(f"LLM planner: {name} must be one of {', '.join(SWITCHES)} "
                                     f"(got {shown_value(value)})")
        if not isinstance(self.strict, bool):
            raise ConductorError(f"LLM planner: strict must be true or false (got {shown_value(self.strict)})")
        if self.temperature is not None:
            _number("temperature", self.temperature, low=0.0, low_open=False, high=2.0)
        if self.top_p is not None:
            _number("top_p", self.top_p, low=0.0, low_open=True, high=1.0)
        _whole("max_tokens", self.max_tokens, least=1, optional=True)
        _whole("seed", self.seed, least=None, optional=True)
        if self.seed is not None and self.seed < 0:  # as `conductor run --seed` takes it
            raise ConductorError(f"LLM planner: seed must be 0 or more, as --seed (got {self.seed})")
        _whole("max_in_flight", self.max_in_flight, least=1, optional=True)
        _whole("instruction_chars", self.instruction_chars, least=1)

    def _check_kinds(self) -> None:
        if isinstance(self.kinds, str):
            self.kinds = tuple(k.strip() for k in self.kinds.split(",") if k.strip())
        if not isinstance(self.kinds, (list, tuple)) or not all(isinstance(k, str) for k in self.kinds):
            raise ConductorError(f"LLM planner: kinds must list worker kinds among {', '.join(WORKER_KINDS)} "
                                 f"(got {shown_value(self.kinds)})")
        self.kinds = tuple(self.kinds)
        bad = sorted(set(self.kinds) - set(WORKER_KINDS))
        if bad:
            raise ConductorError(f"LLM planner: unknown worker kind(s) {', '.join(bad)} in kinds")
        if problem := shape_problem(self.max_steps, self.kinds):
            raise ConductorError(f"LLM planner: {problem}")


PRICE_PAIRS = ({"input_per_mtok", "output_per_mtok"}, {"input_per_token", "output_per_token"})


def _check_price(price: Any) -> None:
    """The implicit worker's price, as the option is written: the pool file's own message named
    `workers[0] (conductor-planner)`, which the user never wrote."""
    if price is None:
        return
    like = "like price={input_per_mtok: 1, output_per_mtok: 2} (USD per million tokens)"
    if not isinstance(price, dict):
        raise ConductorError(f"LLM planner: option price must be a mapping {like}; got {shown_value(price)}")
    keys, allowed = set(price), set().union(*PRICE_PAIRS)
    if keys - allowed:
        raise ConductorError(f"LLM planner: option price: {sorted(keys - allowed)[0]}: unknown field (allowed: "
                             f"{', '.join(sorted(allowed))})")
    if all(keys & pair for pair in PRICE_PAIRS):
        raise ConductorError("LLM planner: option price: give prices per million tokens or per token, not both")
    if keys not in PRICE_PAIRS:
        pair = next((pair for pair in PRICE_PAIRS if keys & pair), PRICE_PAIRS[0])
        raise ConductorError(f"LLM planner: option price: {sorted(pair - keys)[0]} is required, {like}; "
                             f"got {shown_value(price)}")
    for name, value in price.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ConductorError(f"LLM planner: option price: {name} must be a number of USD, at least 0 "
                                 f"(got {shown_value(value)})")


@dataclass(frozen=True)
class Binding:
    """Run context for the planner's executor (set by the runner through `bind`)."""

    work_dir: Path | None = None  # journal and run cache; None: a temporary folder
    cache_path: Path | None = None  # the shared response cache; None: none
    run_id: str = "planning"
    seed: int = 0
    refresh: bool = False
    budget_usd: float | None = None
    progress: bool = False
    retry_failed: bool = False  # ask again the queries whose planning failed for good
    replans: bool = True  # False: the run allows no re-planning, and plans leave planner workers out


class LLMPlanner(PlannerBackEnd):
    name = "llm"
    plans_at_a_cost = True

    def __init__(self, config: LLMPlannerConfig | None = None):
        self.config = config or LLMPlannerConfig()
        self.binding = Binding()

    def bind(self, **context: Any) -> None:
        """Where the planner's journal, run cache and shared cache live, and the
        run's seed, budget and refresh setting (see `Binding`)."""
        self.binding = Binding(**context)

    def plan_kinds(self) -> tuple[str, ...]:
        """The worker kinds the run's own plans may use (sub-plans: replan.sub_kinds)."""
        return top_level_kinds(self.config.kinds, self.binding.replans)

    def replanner(self, pool: Pool, max_steps: int):
        from conductor.planners.replan import LLMReplanner

        return LLMReplanner(self, pool, max_steps)

    # ---- the model --------------------------------------------------------

    def resolve(self, pool: Pool) -> tuple[Worker, Pool]:
        """The planner's worker, and the pool its calls run in (with the implicit worker if any)."""
        c = self.config
        if c.worker is not None:
            if not pool.has(c.worker):
                raise ConductorError(f"LLM planner: worker {c.worker!r} is not in the pool "
                                     f"(known: {', '.join(pool.ids)})")
            w = pool.worker(c.worker)
            if w.kind != "planner" or not w.model:
                raise ConductorError(f"LLM planner: worker {c.worker} must be of kind planner and name a model "
                                     f"(it is of kind {w.kind}{'' if w.model else ', without a model'})")
            return w, pool
        if c.model is not None:
            return self._implicit(pool)
        own = [w for w in pool.workers if w.kind == "planner" and w.model]
        if len(own) == 1:
            return own[0], pool
        raise ConductorError(
            "LLM planner: name its model with --planner-model (a litellm model string) or a pool worker of "
            "kind planner with --planner-option worker=<id>"
            + (f" (the pool has several: {', '.join(w.id for w in own)})" if own else ""))

    def extend_pool(self, pool: Pool) -> Pool:
        """The pool with the planner's implicit worker, for executors that call it."""
        return self.resolve(pool)[1] if self.config.model is not None else pool

    def _implicit(self, pool: Pool) -> tuple[Worker, Pool]:
        """A planner worker for `model`, on the pool's provider of that name or a new one with default limits."""
        c = self.config
        model = c.model or ""
        wid = IMPLICIT_WORKER
        while pool.has(wid):
            wid += "_"
        pid = c.provider or provider_from_model(model)
        # A provider= the file does not list is refused as a worker's would be (a typo would plan with default
        # limits and outside every budget); without provider=, --planner-model's own prefix is the provider the
        # user named on the command line, with default limits unless the file lists it
        if c.provider is not None and (why := unlisted(pid, pool.listed, named=True, where="the pool file")):
            raise ConductorError(f"LLM planner: option provider: {why}")
        spec: dict[str, Any] = {"id": wid, "kind": "planner", "model": model, "provider": pid,
                                "description": "the run's planner"}
        if c.api_base:
            spec["api_base"] = c.api_base
        if c.price is not None:
            spec["price"] = c.price
        provider = {"api_key_env": c.api_key_env} if c.api_key_env else {}
        try:  # the pool file's own checks, so a bad setting gets the same message
            parsed = parse_pool({"workers": [spec], "providers": {pid: provider}})
        except PoolError as e:
            raise ConductorError(f"LLM planner: {_as_option(str(e))}") from None
        worker = parsed.workers[0]
        own = replace(parsed.providers[pid],
                      key_hint="name the variable that holds its key with --planner-option api_key_env=NAME")
        providers = {pid: own, **pool.providers}
        return worker, replace(pool, workers=(*pool.workers, worker), providers=providers)

    def structured_for(self, worker: Worker) -> bool:
        s = self.config.structured
        if s != "auto":
            return s == "on"
        try:
            import litellm

            return bool(litellm.supports_response_schema(model=worker.model))
        except Exception:  # unknown model or provider: litellm cannot tell
            return False

    def request_params(self, pool: Pool, worker: Worker, structured: bool,
                       kinds: Sequence[str] | None = None) -> dict[str, Any]:
        """Sampling parameters and response format for the planner's calls (seed added per sample)."""
        c = self.config
        kinds = tuple(kinds or c.kinds)
        supported = _supported_params(worker.model or "")
        params: dict[str, Any] = {
            "temperature": c.temperature if c.temperature is not None else worker.params.get("temperature", 1.0)}
        if c.top_p is not None:
            params["top_p"] = c.top_p
        max_tokens = c.max_tokens or worker.params.get("max_tokens")
        if structured:
            schema = plan_schema(pool, c.max_steps, c.instruction_chars, kinds=kinds)
            params["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "plan", "schema": schema, "strict": c.strict}}
            max_tokens = max_tokens or max_plan_chars(pool, c.max_steps, c.instruction_chars, kinds=kinds) + 16
        params["max_tokens"] = max_tokens or FREE_MAX_TOKENS
        if c.logprobs == "on" or (c.logprobs == "auto" and supported is not None and "logprobs" in supported):
            params["logprobs"] = True
        if supported is not None and "seed" not in supported:
            # The seed still tells the K samples apart in the cache key; litellm
            # drops it (and any other parameter the provider lacks) from the request.
            params["drop_params"] = True
        return params

    def ready(self, pool: Pool, budget_usd: float | None = None) -> tuple[Worker, Pool]:
        """What would fail every planning call, found before any is sent: no known price under a
        budget (`budget_usd`: the run's, else the bound one), the key's variable unset, the endpoint
        unreachable, the model not served. `conductor run` asks before it writes a new run folder,
        which was otherwise left behind in `planning`."""
        worker, exec_pool = self.resolve(pool)
        provider = exec_pool.provider_of(worker)
        budget_on = (budget_usd if budget_usd is not None else self.binding.budget_usd) is not None
        if budget_on or provider.budget_usd is not None:
            from conductor.execute.prices import resolve_price

            if resolve_price(worker) is None:
                raise ConductorError(f"LLM planner: no known price for model {worker.model}, so it cannot plan "
                                     f"under a budget; give it a price (pool worker price, or "
                                     f"--planner-option price={{input_per_mtok: ..., output_per_mtok: ...}})")
        from conductor.preflight import Given, preflight

        problems = []  # all of them at once: an unset key hid the endpoint's problems until the next try
        if provider.api_key_env and not os.environ.get(provider.api_key_env):
            problems.append(f"environment variable {provider.api_key_env} is not set (the key of provider "
                            f"{provider.id}, which serves {worker.model})")
        # The worker --planner-model adds is named as the options that made it, not as a pool file's worker.
        given = {worker.id: Given(f"--planner-model {worker.model}", "--planner-option api_base")} \
            if self.config.model is not None else None
        if problems := problems + preflight(exec_pool, [worker.id], given):
            raise ConductorError("LLM planner: cannot plan: " + "; ".join(problems))
        return worker, exec_pool

    # ---- planning ---------------------------------------------------------

    def plan(self, queries: Sequence[Query], pool: Pool, samples: int) -> list[list[PlanDraft]]:
        if samples < 1:
            raise ConductorError(f"LLM planner: samples must be at least 1 (got {samples})")
        if not queries:
            return []
        kinds = self.plan_kinds()
        if not prompts.first_step_workers(pool, kinds):
            err = f"the pool has no workers of kind {', '.join(k for k in kinds if k != 'function')} to plan with"
            return [[_invalid(None, err, {}) for _ in range(samples)] for _ in queries]
        worker, exec_pool = self.ready(pool)  # a resumed run's too: its budget may be new
        return asyncio.run(self._plan_all(queries, pool, exec_pool, worker, samples))

    async def _plan_all(self, queries: Sequence[Query], pool: Pool, exec_pool: Pool, worker: Worker,
                        samples: int) -> list[list[PlanDraft]]:
        c, b = self.config, self.binding
        structured = self.structured_for(worker)
        mode = "structured" if structured else "free"
        kinds = self.plan_kinds()
        params = self.request_params(pool, worker, structured, kinds)
        base_seed = c.seed if c.seed is not None else b.seed
        tmp = tempfile.TemporaryDirectory(prefix="conductor-planner-") if b.work_dir is None else None
        work = Path(tmp.name) if tmp is not None else Path(b.work_dir)
        progress = Progress(label="plan", enabled=b.progress)
        progress.c.plans_total = len(queries) * samples
        context = ExecutionContext(work, exec_pool, ExecOptions(run_id=b.run_id, refresh=b.refresh,
                                                                run_budget_usd=b.budget_usd, seed=b.seed),
                                   state=load_state(work), cache_path=b.cache_path, progress=progress)
        provider = exec_pool.provider_of(worker)
        slots = asyncio.Semaphore(c.max_in_flight or max(8, 2 * provider.max_concurrency))
        failures: list[StepFailed] = []
        failed_before = {} if b.retry_failed else step_failures(work)  # by earlier runs of this planning

        async def one(q: Query, k: int) -> PlanDraft:
            msgs = prompts.messages(q, pool, mode, c.max_steps, instruction_chars=c.instruction_chars,
                                    kinds=kinds)
            prompt_text = orjson.dumps(msgs).decode()
            job = PlanJob(f"{q.query_id}#{k}", q.query_id, q.index, k, q.task, q.prompt, None)
            step = Step(worker.id, prompts.user_prompt(q), ())
            got: list[Entry] = []
            info: dict[str, Any] = {"mode": mode, "worker": worker.id, "model": worker.model,
                                    "seed": base_seed + k}
            if (final := _final_failure(failed_before.get(job.plan_id, []))) is not None:
                progress.c.plans_done += 1  # failed for good before: not asked (and paid) again
                return _invalid(prompt_text, final[0], {**info, "status": "error", "failure": final[1]})
            async with slots:
                ended = True  # planned, or failed: a call cut off by Ctrl-C is neither, and is asked again
                started = time.time()
                try:
                    row = await ex.call_worker(job, "plan", 0, step, worker, msgs,
                                               params={**params, "seed": base_seed + k},
                                               accept=lambda e: got.append(e))
                except StepFailed as f:
                    logged = ex.log_failure(job, "plan", 0, step, f, worker=worker, started=started)  # its cost
                    info.update(status=f.status, failure=f.kind, cost_usd=f.cost)
                    final = _final_failure([*failed_before.get(job.plan_id, []), logged])
                    if final is None:  # a rerun may cure it
                        failures.append(f)
                        return _invalid(prompt_text, f"planning call failed: {f}", info)
                    return _invalid(prompt_text, final[0], info)
                except BaseException:
                    ended = False
                    raise
                finally:
                    if ended:
                        progress.c.plans_done += 1
                        progress.tick()
            e = got[0]
            info.update(cost_usd=row["cost_usd"], original_cost_usd=row["original_cost_usd"],
                        cache_hit=row["cache_hit"], request_key=row["request_key"])
            return PlanDraft(text=e.text, prompt=prompt_text, prompt_tokens=e.prompt_tokens,
                             completion_tokens=e.completion_tokens, logprob=e.logprob,
                             template_version=prompts.TEMPLATE_VERSION, info=info)

        try:
            with context as ex:
                try:
                    drafts = await ex.gather_gently(one(q, k) for q in queries for k in range(samples))
                finally:
                    await ex.close_connections()
        finally:
            progress.close()
            if tmp is not None:
                tmp.cleanup()
        _stop_on(failures, len(drafts), b)
        return [list(drafts[i * samples:(i + 1) * samples]) for i in range(len(queries))]


# Failures that a rerun may cure (the executor already retried them) stop planning, on the
# first RETRY_TRANSIENT reruns; then they are final, as a worker's are (journal.TRANSIENT_KINDS),
# so one query the provider always fails cannot hold the job back for ever. Those of the
# planner's setup stop it at once; any other (a malformed answer, a refused request) is an
# invalid plan for its query, so one bad reply never holds back the rest of the batch.
RERUN_KINDS = {"rate_limit", "server", "timeout", "connection", "budget"}
SETUP_KINDS = {"auth", "not_found", "config"}


RETRIED = TRANSIENT_KINDS - {"budget"}  # counted towards RETRY_TRANSIENT: a budget stop never ends planning


def _final_failure(failed: list[dict[str, Any]]) -> tuple[str, str] | None:
    """Why (and of what kind) a query's planning failed for good in an earlier run, from its
    failed rows since its last answer; None when a rerun asks again: a failure a rerun may cure
    (a transient one, on its first RETRY_TRANSIENT reruns; a budget; a key or model fixed since)."""
    from conductor.execute.shared.url import failed_on_governor

    failed = [r for r in failed if not failed_on_governor(r.get("error"))]  # never sent: no try used up
    if not failed:
        return None
    last = failed[-1]
    tries = sum(r.get("failure") in RETRIED for r in failed)
    if last.get("failure") in RETRIED and tries > RETRY_TRANSIENT:
        return (f"planning call failed on {tries} runs, the last time with: {last.get('error')} (final: a rerun "
                f"no longer plans this query; --retry-failed does)"), last["failure"]
    if last["status"] == "error" and last.get("failure") not in TRANSIENT_KINDS | SETUP_KINDS:
        return (f"planning call failed: {last.get('error')} (final: a rerun does not ask again; --retry-failed "
                f"does)"), last.get("failure")
    return None


def _stop_on(failures: list[StepFailed], n: int, binding: Binding) -> None:
    """Raise for the planning failures that must stop the run (see RERUN_KINDS, SETUP_KINDS). Its
    calls were sent, so not exit 2 ("nothing called"): 3 when a budget stopped them, else 4."""
    if setup := [f for f in failures if f.kind in SETUP_KINDS]:
        raise PlanningStopped(f"LLM planner: cannot plan: {setup[0]}"
                              + (_resumes(binding) if binding.work_dir is not None else ""))
    rerun = [f for f in failures if f.kind in RERUN_KINDS]
    if not rerun:
        return
    blocked = sum(f.kind == "budget" for f in rerun)
    why = (f"{blocked} stopped by a budget (the first: {next(f for f in rerun if f.kind == 'budget')}; raise it "
           f"in the pool file or with --budget)" if blocked else f"first error: {rerun[0]}")
    raise PlanningStopped(
        f"LLM planner: {len(rerun)} of {n} planning call(s) failed, {why}; rerun the same "
        f"command to plan them again (finished planning calls are kept and not paid again)",
        exit_code=3 if blocked == len(rerun) else 4)


def _resumes(binding: Binding) -> str:
    """What to do with the run folder the failed planning left (status `failed`, runner.noting_stop).
    Not a plain "rerun": the same request fails the same way until its cause is fixed."""
    return (f". Fix this, then the same command resumes the planning of run {binding.run_id}, also with "
            f"--planner-option api_key_env=NAME added or changed (its status is `failed` until then; with other "
            f"planner options it is a new run, and this one's folder can be deleted)")


def _as_option(message: str) -> str:
    """A pool-file message about the implicit planner worker or its provider, naming the planner
    option instead of `workers[0] (conductor-planner)` or `providers.<id>`."""
    m = re.match(r"(workers\[0\] \([^)]*\)|providers\.[^.:]+)(?:\.([\w.]+))?: (.*)", message, re.S)
    if m is None:
        return message
    option = m.group(2) or ("provider" if m.group(1).startswith("providers") else "model")
    return f"option {option}: {m.group(3)}"


def _supported_params(model: str) -> list[str] | None:
    """The OpenAI parameters litellm maps for this model; None when it cannot tell."""
    try:
        import litellm

        name, provider, _, _ = litellm.get_llm_provider(model)
        return list(litellm.get_supported_openai_params(model=name, custom_llm_provider=provider) or [])
    except Exception:
        return None


def _invalid(prompt: str | None, error: str, info: dict[str, Any]) -> PlanDraft:
    return PlanDraft(text="", prompt=prompt, prompt_tokens=None, completion_tokens=0,
                     template_version=prompts.TEMPLATE_VERSION, info={**info, "error": error})
