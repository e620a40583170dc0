"""Re-planning: a step assigned to a worker of kind "planner" has the planner
write a new workflow over the outputs that step sees; the executor runs it one
level deeper and takes its last output as the step's output
(Executor._replan). This module holds the replanner of each back end.

- llm: one call through the executor (`call_worker`: cache, limits, budget,
  retries, a trace row at "<step>.plan" holding the sub-plan), to the step's
  planner worker when it names a model, else to the run's planner model.
- vllm: the loaded engine, called in a worker thread so the executor's other
  calls go on; re-plans that arrive while the engine is busy are batched into
  its next call.
- embedded: no model: its own templates. It picks the best-valued template
  (one solver, or a solver and a checker) for the query, and puts the work the
  step sees, and the step's instruction, in front of the first instruction,
  so the sub-workflow verifies or finishes that work.

At the deepest allowed level the sub-plan's prompt and schema leave out
planner workers, so a sub-plan cannot ask for a depth the run forbids (the
executor still refuses one, with a clear error, for back ends that ignore it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any, Sequence

from conductor.errors import ConductorError, PlanError
from conductor.execute.engine import Executor, ReplanRequest, Replanner, StepFailed
from conductor.planners import prompt as prompts
from conductor.planners.base import PlannerBackEnd, Query
from conductor.plans import Plan, parse_plan, validate_plan
from conductor.pool import Pool

# Appended to prompt.replan_messages' user turn: what the re-planning step asked for.
REPLAN_TASK = "\n\nThe step that asked for this plan says: {instruction}"


def make_replanner(planner: Any, pool: Pool, max_steps: int) -> Replanner | None:
    """The replanner a planner back end declares; None for planners that cannot re-plan."""
    return planner.replanner(pool, max_steps) if isinstance(planner, PlannerBackEnd) else None


class BaseReplanner:
    """What every back end's replanner offers besides re-planning a step."""

    def extend_pool(self, pool: Pool) -> Pool:
        """The pool the executor runs in: the run's, plus any worker re-planning calls need."""
        return pool


def sub_kinds(kinds: Sequence[str], req: ReplanRequest) -> tuple[str, ...]:
    """Worker kinds the sub-plan may use: no planners at the deepest level."""
    return tuple(k for k in kinds if req.may_replan or k != "planner")


def replan_messages(req: ReplanRequest, pool: Pool, mode: str, max_steps: int, instruction_chars: int,
                    kinds: Sequence[str]) -> list[dict[str, str]]:
    msgs = prompts.replan_messages(query_of(req), req.prior, pool, mode, max_steps,
                                   instruction_chars=instruction_chars, kinds=kinds)
    msgs[-1]["content"] += REPLAN_TASK.format(instruction=req.step.instruction)
    return msgs


def query_of(req: ReplanRequest) -> Query:
    j = req.job
    return Query(j.query_id, j.prompt, j.task, index=j.query_index)


def parse_sub_plan(text: str, pool: Pool, max_steps: int) -> Plan:
    try:
        return parse_plan(text, pool, max_steps)
    except PlanError as e:
        raise StepFailed("error", f"the sub-plan is not valid: {e}") from None


class LLMReplanner(BaseReplanner):
    def __init__(self, planner: Any, pool: Pool, max_steps: int):
        self.planner = planner  # an LLMPlanner
        self.pool = pool  # the run's pool: what prompts offer and sub-plans may name
        self.max_steps = max_steps

    def extend_pool(self, pool: Pool) -> Pool:
        return self.planner.extend_pool(pool)

    async def __call__(self, ex: Executor, req: ReplanRequest) -> Plan:
        p, c = self.planner, self.planner.config
        # A planner worker without a model stands for the run's planner; resolved
        # against the run's pool so that it is the worker extend_pool gave the executor.
        worker = req.worker if req.worker.model else p.resolve(self.pool)[0]
        kinds = sub_kinds(c.kinds, req)
        if not prompts.planner_workers(self.pool, kinds):
            raise StepFailed("error", f"the pool has no workers of kind {', '.join(kinds)} to re-plan with")
        structured = p.structured_for(worker)
        mode = "structured" if structured else "free"
        msgs = replan_messages(req, self.pool, mode, c.max_steps, c.instruction_chars, kinds)
        params = p.request_params(self.pool, worker, structured, kinds)
        base = c.seed if c.seed is not None else ex.opt.seed
        params["seed"] = base + req.job.sample
        got: list[Plan] = []

        def accept(entry) -> dict[str, Any]:
            sub = parse_sub_plan(entry.text, self.pool, min(self.max_steps, c.max_steps))
            got.append(sub)
            return {"sub_plan": sub.to_json()}

        await ex.call_worker(req.job, req.plan_path, req.depth + 1, req.step, worker, msgs, params=params,
                             accept=accept)
        req.recorded = True
        return got[0]


class VLLMReplanner(BaseReplanner):
    """Re-plans on the vLLM planner's engine; concurrent requests share engine calls."""

    def __init__(self, planner: Any, pool: Pool, max_steps: int):
        self.planner = planner  # a VLLMPlanner
        self.pool = pool
        self.max_steps = max_steps
        self.engine_calls = 0
        self._pending: list[tuple[ReplanRequest, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None

    async def __call__(self, ex: Executor, req: ReplanRequest) -> Plan:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((req, fut))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let the requests of this turn of the loop join the batch
        try:
            self.planner.engine()  # a first load happens here, in the loop's (main) thread, not a worker thread
        except Exception as e:
            batch, self._pending = self._pending, []
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(StepFailed("error", f"vLLM engine: {type(e).__name__}: {e}"))
            return
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                outcomes = await asyncio.to_thread(self._generate, [r for r, _ in batch])
            except Exception as e:  # the engine failed: every request of the batch fails with it
                outcomes = [StepFailed("error", f"vLLM engine: {type(e).__name__}: {e}")] * len(batch)
            for (_, fut), outcome in zip(batch, outcomes):
                if fut.done():
                    continue
                if isinstance(outcome, BaseException):
                    fut.set_exception(outcome)
                else:
                    fut.set_result(outcome)

    def _generate(self, reqs: list[ReplanRequest]) -> list[Plan | StepFailed]:
        """Blocking: one engine call for every request that fits the engine."""
        p, c = self.planner, self.planner.config
        llm = p.engine()
        tokenizer = llm.get_tokenizer()
        limit = llm.llm_engine.model_config.max_model_len
        outcomes: list[Plan | StepFailed | None] = [None] * len(reqs)
        prompts_, params, index = [], [], []
        by_kinds: dict[tuple[str, ...], Any] = {}
        for i, req in enumerate(reqs):
            kinds = sub_kinds(c.kinds, req)
            if not prompts.planner_workers(self.pool, kinds):
                outcomes[i] = StepFailed("error", f"the pool has no workers of kind {', '.join(kinds)} "
                                                  f"to re-plan with")
                continue
            msgs = replan_messages(req, self.pool, c.mode, c.max_steps, c.instruction_chars, kinds)
            if getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            else:
                text = "\n\n".join(m["content"] for m in msgs) + "\n\nPlan:\n"
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) >= limit:
                outcomes[i] = StepFailed("error", f"the re-planning prompt is {len(ids)} tokens; the engine's "
                                                  f"max_model_len is {limit}")
                continue
            if kinds not in by_kinds:
                by_kinds[kinds] = type(p)(dataclasses.replace(c, kinds=kinds), llm=llm).sampling_params(
                    self.pool, 1)
            prompts_.append({"prompt_token_ids": ids})
            params.append(by_kinds[kinds])
            index.append(i)
        if prompts_:
            self.engine_calls += 1
            results = llm.generate(prompts_, params, use_tqdm=False)
            for i, res in zip(index, results):
                out = res.outputs[0]
                text = tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
                req = reqs[i]
                req.info = {"text": text, "prompt_tokens": len(res.prompt_token_ids or ()),
                            "completion_tokens": len(out.token_ids), "model": c.model,
                            "logprob": out.cumulative_logprob if _finite(out.cumulative_logprob) else None}
                try:
                    outcomes[i] = parse_sub_plan(text, self.pool, min(self.max_steps, c.max_steps))
                except StepFailed as f:
                    outcomes[i] = f
        return outcomes  # type: ignore[return-value]


class EmbeddedReplanner(BaseReplanner):
    """The embedded planner's templates, written over the work the step sees."""

    def __init__(self, planner: Any, pool: Pool, max_steps: int):
        self.planner = planner  # an EmbeddedPlanner
        self.pool = pool
        self.max_steps = max_steps

    async def __call__(self, ex: Executor, req: ReplanRequest) -> Plan:
        p = self.planner
        q = query_of(req)
        solvers = [w for w in self.pool.workers if w.kind == "llm"]
        if not solvers:
            raise StepFailed("error", "the pool has no llm workers to re-plan with")
        replay = self.pool.replay is not None
        cands = [c for c in p.candidates(q, solvers, [], replay=replay) if c.template in ("single", "verify")]
        if not cands:
            raise StepFailed("error", "no template of the embedded planner fits this pool")
        weight = p.config.cost_weight
        best = max(cands, key=lambda c: (c.accuracy - weight * c.cost, c.template == "single"))
        steps = p.steps(q, best, replay=replay)[: self.max_steps]
        if req.prior and not replay:  # a replay pool answers only the recorded question, verbatim
            done = "\n\n".join(f"Step {j} output:\n{out}" for j, (_, out) in enumerate(req.prior))
            steps[0] = {**steps[0], "instruction": (f"Work done so far on this question:\n\n{done}\n\n"
                                                    f"What to do now: {req.step.instruction}\n\n"
                                                    f"{steps[0]['instruction']}")}
        try:
            sub = validate_plan(steps, self.pool, self.max_steps)
        except PlanError as e:
            raise ConductorError(f"embedded re-plan is not valid: {e}") from None
        req.info = {"text": sub.to_json(), "model": None}
        return sub


def _finite(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x)
