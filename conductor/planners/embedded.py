"""The embedded planner: a policy over plan templates that needs no GPU and no weights.

Templates: one worker solves; one solves and another verifies; several solve in
parallel and an aggregating step decides; cheap workers answer and an expensive
one runs only when they disagree (a cascade). Each candidate plan gets an expected
accuracy from the pool's `skills` and an expected cost from its prices; the
utility is accuracy - cost_weight * USD. K=1 takes the best candidate (unless `explore`
is given); K>1 samples candidates from a softmax over utilities and logs each draw's propensity.

When a learned policy exists for the pool (`conductor policy train`, see
conductor/policy), it replaces that prior: its candidate actions, its greedy
choice, epsilon-greedy draws for K>1. The prior remains the fallback for a pool,
or a task, that has no learned policy.

Two options serve training and evaluation: `sweep` plans every candidate of the
policy's action set once per query (K = the largest set; propensity 1/N), so
each action is measured on the same queries; `action=KEY` plans one fixed action
for every query (how the best fixed cascade is evaluated).
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Sequence

import orjson

from conductor.errors import ConductorError
from conductor.planners.base import UNUSED_SLOT, PlanDraft, PlannerBackEnd, Query, SeededByRun
from conductor.policy.actions import Action, planning_prices
from conductor.pool import Pool, Price, Worker
from conductor.yamlkeys import shown_value

TEMPLATE_VERSION = "embedded-v1"

# The graders read a final "Answer: ..." line first; every instruction asks for one.
ANSWER_LINE = {
    "math": "End with a final line of the form 'Answer: <number>'.",
    "choice": "End with a final line of the form 'Answer: <letter>'.",
    "exact": "End with a final line of the form 'Answer: <answer>'.",
    "literal": "End with a final line of the form 'Answer: <the value as a Python literal>'.",
    "code": "Give the complete solution as one ```python code block.",
}
SOLVE = {"math": "Solve the problem step by step.", "choice": "Think it through.", "exact": "Answer concisely.",
         "literal": "Work out the value.", "code": "Write the code."}
VERIFY = ("Check the solution above step by step. If it is correct, restate its final answer; "
          "if it is wrong, solve the problem correctly.")
AGGREGATE = ("Several independent solutions to the same problem are above. Decide which final "
             "answer is correct, checking the reasoning where they disagree.")


@dataclass(frozen=True)
class Candidate:
    action: Action
    accuracy: float  # the prior's expectation
    cost: float

    @property
    def template(self) -> str:
        return self.action.shape


TEMPLATES = ("single", "verify", "ensemble")


@dataclass(frozen=True)
class EmbeddedConfig:
    cost_weight: float = 10.0  # accuracy points traded per USD of expected cost
    temperature: float = 0.05  # softmax temperature over utilities when sampling K>1
    default_skill: float = 0.5  # expected accuracy when the pool says nothing
    listed_skill: float = 0.7  # when a skill tag is listed without a number
    expected_output_tokens: int = 300
    ensemble_size: int = 3
    templates: tuple[str, ...] = TEMPLATES
    seed: int | None = None  # None: the run's --seed (given in `bind`; 0 when planning outside a run)
    # Learned policy: "auto" uses the newest artifact for this pool under the default folder
    # ($CONDUCTOR_POLICY_DIR, else data/policy) if there is one; "none" plans with the prior;
    # a path names a policy folder (a root, a pool's folder, or one version).
    policy: str = "auto"
    # Share of draws spread evenly over the candidates (default: 0.2 with a learned policy at K>1;
    # none with the prior, whose softmax already explores). 1.0 draws uniformly. Unset or 0, K=1
    # plans greedily; above 0, K=1 draws too, so `policy rollouts -k 1` logs what it explored.
    explore: float | None = None
    # Without a learned policy: "templates" (the prior's own candidates) or "bandit" (the policy's
    # action set, scored by the prior): what a first round of rollouts should explore.
    candidates: str = "templates"
    sweep: bool = False  # every candidate once per query (see the module docstring)
    action: str | dict[str, str] | None = None  # one fixed action key for every query (or per task)
    use: str = "auto"  # with a learned policy: auto (what training shipped), learned, or fixed

    def __post_init__(self) -> None:
        # Planner options arrive as YAML scalars: a string, .nan or 0 would otherwise crash or plan
        # nonsense deep inside planning, after the run folder exists.
        shares = ("default_skill", "listed_skill") + (("explore",) if self.explore is not None else ())
        for name in shares:
            if not _number(getattr(self, name), 0.0, 1.0):
                raise ValueError(f"{name} must be between 0 and 1 (got {getattr(self, name)!r})")
        for name in ("cost_weight", "temperature"):
            if not _number(getattr(self, name), 0.0, math.inf):
                raise ValueError(f"{name} must be a finite number, at least 0 (got {getattr(self, name)!r})")
        for name, least in (("expected_output_tokens", 1), ("ensemble_size", 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name} must be a whole number, at least {least} (got {v!r})")
        if self.candidates not in ("templates", "bandit"):
            raise ValueError(f"candidates must be templates or bandit (got {shown_value(self.candidates)})")
        object.__setattr__(self, "templates", _templates(self.templates))
        self._check_learned()

    def _check_learned(self) -> None:
        """The learned policy's options: `policy=5` was a traceback once the run folder existed."""
        if self.policy is False:  # YAML reads policy=off as false
            object.__setattr__(self, "policy", "none")
        if not isinstance(self.policy, str) or not self.policy.strip():
            # `policy=` (YAML: null) meant the prior without a word, while unset means auto
            got = "nothing" if self.policy is None or self.policy == "" else shown_value(self.policy)
            raise ValueError(f"policy must be auto, none or a policy folder (got {got})")
        if self.use not in USES:
            raise ValueError(f"use must be one of {', '.join(USES)} (got {shown_value(self.use)})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a whole number, at least 0 (got {shown_value(self.seed)})")
        if not isinstance(self.sweep, bool):
            raise ValueError(f"sweep must be true or false (got {shown_value(self.sweep)})")
        if self.action is not None:
            keys = self.action.values() if isinstance(self.action, dict) else [self.action]
            if not all(isinstance(k, str) for k in keys):
                raise ValueError(f"action must be an action key, or a mapping of task to action key "
                                 f"(got {shown_value(self.action)})")
            for key in keys:
                Action.from_key(key)  # a clear ValueError on a malformed key


USES = ("auto", "learned", "fixed")


def _templates(given: object) -> tuple[str, ...]:
    """`templates` as names: a list, or text such as single,ensemble."""
    items = given.split(",") if isinstance(given, str) else given
    names = tuple(t.strip() if isinstance(t, str) else t for t in items) if isinstance(items, (list, tuple)) else ()
    if not names or not all(isinstance(t, str) and t in TEMPLATES for t in names):
        got = "nothing" if given in (None, "", [], ()) else shown_value(given)
        raise ValueError(f"templates must name one or more of {', '.join(TEMPLATES)}, e.g. "
                         f"templates=single,ensemble (got {got})")
    return names


def _check_workers(key: str, pool: Pool) -> Action:
    """The action `key` names, refused when a worker of it is not in the pool."""
    action = Action.from_key(key)
    missing = [w for w in action.workers if not pool.has(w)]
    if missing:
        raise ConductorError(f"planner option action={key}: worker(s) {', '.join(missing)} not in the pool")
    return action


def _sweep_actions(pool: Pool, task: str | None, allowed: set[str] | frozenset[str]) -> list[Action]:
    """A sweep's candidates for one query: the action set's actions its workers can serve."""
    from conductor.policy.actions import action_set, servable

    return servable(action_set(pool, task), allowed)


def _sweep_short(query_id: str, n: int, samples: int) -> str:
    """`query_id` has the largest candidate set (`n`) of the queries checked: the count to ask for."""
    return (f"sweep: query {query_id} has {n} candidate actions but only {samples} samples; a sweep needs as "
            f"many samples per query as the largest candidate set, {n} (no query has more): use --samples all "
            f"with `conductor policy rollouts`, or --samples {n} or more with `conductor run`")


def _largest_sweep(pool: Pool, rows) -> tuple[str, int] | None:
    """The query with the most sweep candidates among `rows` (query id, task, servable workers) and
    their count (the first such query on a tie), or None when no row has a worker."""
    sizes: dict[tuple, int] = {}
    best: tuple[str, int] | None = None
    for qid, task, allowed in rows:
        if not allowed:
            continue  # planned invalid: no worker recorded it
        key = (task, frozenset(allowed))
        if key not in sizes:
            sizes[key] = len(_sweep_actions(pool, task, allowed))
        if best is None or sizes[key] > best[1]:
            best = (qid, sizes[key])
    return best


def _number(v: object, low: float, high: float) -> bool:
    """A real number in [low, high], and finite: NaN passes no comparison, so it is caught here."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and low <= v <= high


POLICY_FOLDERS = ("a folder `conductor policy train` wrote (its root, a pool's folder or one version vNNNN), "
                  "or policy=auto (the newest for the pool, if any) or policy=none (the prior)")


def _not_a_policy_folder(path: Path) -> str | None:
    """Why a `policy=` path cannot hold a policy: one that does not exist (a typo, an unmounted
    volume) was told "no policy artifact there for this pool", as if the folder were there."""
    if not path.exists():
        return f"there is no folder {path.absolute()}; give {POLICY_FOLDERS}"
    if not path.is_dir():
        return f"{path.absolute()} is a file, not a policy folder; give {POLICY_FOLDERS}"
    return None


def _warn_unpriced(pool: Pool) -> None:
    """Say which workers planning counts at the dearest known price: a free local model given no
    price is then no longer preferred, and `price: {input_per_mtok: 0, output_per_mtok: 0}` says so.
    With no known price at all, price ranks nothing and cost_weight does nothing: said too."""
    from conductor.execute.prices import resolve_price

    llm = [w for w in pool.workers if w.kind == "llm"]
    unpriced = [w.id for w in llm if resolve_price(w) is None]
    if not unpriced:
        return
    if len(unpriced) < len(llm):
        text = (f"{', '.join(unpriced)}: no price in the pool file nor in litellm's cost map; the embedded "
                f"planner counts {'it' if len(unpriced) == 1 else 'them'} at the dearest known price "
                f"(a free local model: give it price: {{input_per_mtok: 0, output_per_mtok: 0}})")
    else:
        text = (f"no llm worker ({', '.join(unpriced)}) has a price in the pool file or in litellm's cost map: "
                f"the embedded planner ranks plans by skills alone (cost_weight has no effect) and the run's "
                f"cost is unknown; give each a price: {{input_per_mtok: ..., output_per_mtok: ...}} (0 and 0 "
                f"for a free local model)")
    print(f"conductor: warning: {text}", file=sys.stderr, flush=True)


class EmbeddedPlanner(SeededByRun, PlannerBackEnd):
    name = "embedded"

    def __init__(self, config: EmbeddedConfig | None = None):
        self.config = config or EmbeddedConfig()
        self._seed_option = self.config.seed  # None: the run's seed, each time it is bound
        self._learned: dict[str, object] = {}  # pool key -> loaded artifact (or None)
        self._priced: tuple[Pool, dict[str, Price]] | None = None

    def prices(self, pool: Pool) -> dict[str, Price]:
        """The pool's workers' prices for planning (policy.actions.planning_prices), once per pool."""
        if self._priced is None or self._priced[0] is not pool:
            self._priced = (pool, planning_prices(pool.workers))
            _warn_unpriced(pool)
        return self._priced[1]

    def resolve(self, pool: Pool) -> None:
        """Check what the pool decides before the run folder exists: an `action=` worker the pool
        lacks, a `policy=` folder with nothing for this pool, or a damaged artifact, were found
        only by planning, leaving a run behind in status `planning`."""
        for key in self._action_keys():
            _check_workers(key, pool)
        self.learned_policy(pool)

    def check_samples(self, queries: Path, pool: Pool, samples: int) -> None:
        """Refuse a sweep short of samples before the run folder exists, as planning would: per
        query, its candidates are the action set's actions its recorded workers can serve."""
        if not self.config.sweep or self.config.action is not None or samples < 1:
            return  # `action` plans instead of a sweep; --samples out of range is the run's to refuse
        from conductor.queries import load_queries

        recorded = pool.servable_questions()  # `pool` as planning sees it (runner.planning_pool)
        solvers = frozenset(w.id for w in pool.workers if w.kind == "llm")
        t = load_queries(queries).select(["query_id", "task", "prompt"])
        rows = ((qid, task, solvers if recorded is None else solvers & recorded.get(prompt, frozenset()))
                for qid, task, prompt in zip(*(t.column(c).to_pylist() for c in ("query_id", "task", "prompt"))))
        largest = _largest_sweep(pool, rows)  # the count needed is the largest set's, not the first short one's
        if largest is not None and largest[1] > samples:
            raise ConductorError(_sweep_short(largest[0], largest[1], samples))

    def action_workers(self) -> list[str]:
        """The workers the `action=` option gives steps to (none without it), in order."""
        return list(dict.fromkeys(w for key in self._action_keys() for w in Action.from_key(key).workers))

    def _action_keys(self) -> list[str]:
        action = self.config.action
        if action is None:
            return []
        return list(action.values()) if isinstance(action, dict) else [action]

    def replanner(self, pool: Pool, max_steps: int):
        from conductor.planners.replan import EmbeddedReplanner

        return EmbeddedReplanner(self, pool, max_steps)

    def plan(self, queries: Sequence[Query], pool: Pool, samples: int) -> list[list[PlanDraft]]:
        solvers = [w for w in pool.workers if w.kind == "llm"]
        voters = [w for w in pool.workers if w.kind == "function" and w.function == "vote"]
        if not solvers:
            return [[_invalid("the pool has no llm workers to plan with") for _ in range(samples)] for _ in queries]
        # A replay pool answers only recorded (model, question) pairs: plan each query with
        # the workers that recorded it, the prompt as is, and no step a model must write anew.
        recorded = pool.servable_questions()
        learned = self.learned_policy(pool)
        if self.config.sweep and self.config.action is None:
            largest = _largest_sweep(pool, ((q.query_id, q.task, frozenset(
                w.id for w in solvers if recorded is None or w.id in recorded.get(q.prompt, ())))
                for q in queries))
            if largest is not None and largest[1] > samples:  # name the batch's largest set, as check_samples
                raise ConductorError(_sweep_short(largest[0], largest[1], samples))
        out = []
        for q in queries:
            qs = solvers if recorded is None else [w for w in solvers if w.id in recorded.get(q.prompt, ())]
            if not qs:
                out.append([_invalid("no worker of this replay pool has a recorded response to this query")
                            for _ in range(samples)])
                continue
            if self.config.action is not None:
                out.append(self._fixed(q, pool, {w.id for w in qs}, samples, recorded is not None))
                continue
            if self.config.sweep:
                out.append(self._sweep(q, pool, {w.id for w in qs}, samples, recorded is not None))
                continue
            if learned is not None:
                drafts = self._choose_learned(q, learned, {w.id for w in qs}, samples, pool,
                                              replay=recorded is not None)
                if drafts is not None:
                    out.append(drafts)
                    continue
            if self.config.candidates == "bandit":
                cands = self._bandit_candidates(q, pool, {w.id for w in qs})
            else:
                cands = self.candidates(q, qs, voters, replay=recorded is not None, pool=pool)
            out.append(self._choose(q, cands, samples, replay=recorded is not None))
        return out

    def learned_policy(self, pool: Pool):
        """The learned policy planning uses for this pool (conductor.policy.artifact), or None."""
        from conductor.policy.artifact import find, load, pool_key

        setting = self.config.policy
        if setting.lower() in ("none", "prior", "off"):
            return None
        key = pool_key(pool)
        if key not in self._learned:
            where = None if str(setting).lower() == "auto" else str(Path(setting).expanduser())
            if where is not None and (why := _not_a_policy_folder(Path(where))):
                raise ConductorError(f"planner option policy={setting}: {why}")
            folder = find(pool, where)
            if folder is None and where is not None:
                raise ConductorError(f"planner option policy={setting}: no policy artifact there for this pool")
            self._learned[key] = load(folder, pool, self.config.use) if folder is not None else None
        return self._learned[key]

    def _choose_learned(self, q: Query, learned, allowed: set[str], samples: int, pool: Pool,
                        replay: bool) -> list[PlanDraft] | None:
        from conductor.policy import planning

        acts = planning.candidates(learned, q, allowed)
        if acts is None:
            return None  # the policy knows nothing of this task: the prior plans it
        explore = self.config.explore
        if explore is None:
            explore = planning.DEFAULT_EXPLORE if samples > 1 else 0.0
        picks = planning.choose(learned, q, acts, samples, explore, self.seed)
        drafts = []
        for p in picks:
            c = self._estimate(q, pool, p.action)
            d = self._draft(q, c, p.propensity, replay)
            d.info.update(policy=learned.label, use=learned.extra.get("use"), greedy=p.greedy, explore=explore,
                          candidates=len(acts))
            if learned.features.group_by:
                d.info["group"] = p.group
            drafts.append(d)
        return drafts

    def _bandit_candidates(self, q: Query, pool: Pool, allowed: set[str]) -> list[Candidate]:
        from conductor.policy.actions import action_set, servable

        acts = servable(action_set(pool, q.task), allowed)
        return [self._estimate(q, pool, a) for a in acts]

    def _sweep(self, q: Query, pool: Pool, allowed: set[str], samples: int, replay: bool) -> list[PlanDraft]:
        """Every servable candidate once, in action-set order; the rest of the K slots are
        marked invalid (this query has fewer candidates than the largest set)."""
        acts = _sweep_actions(pool, q.task, allowed)
        if len(acts) > samples:
            raise ConductorError(_sweep_short(q.query_id, len(acts), samples))
        drafts = []
        for a in acts:
            d = self._draft(q, self._estimate(q, pool, a), 1.0 / len(acts), replay)
            d.info.update(policy="sweep", candidates=len(acts))
            drafts.append(d)
        drafts += [_invalid(f"{UNUSED_SLOT}: this query has {len(acts)} candidate actions")
                   for _ in range(samples - len(acts))]
        return drafts

    def _fixed(self, q: Query, pool: Pool, allowed: set[str], samples: int, replay: bool) -> list[PlanDraft]:
        key = self.config.action
        if isinstance(key, dict):
            key = key.get(q.task or "none")
            if key is None:
                return [_invalid(f"planner option action: no action for task {q.task!r}") for _ in range(samples)]
        action = _check_workers(key, pool)
        if any(w not in allowed for w in action.solvers + action.escalation):
            return [_invalid(f"action {action.key}: a worker has no recorded response to this query")
                    for _ in range(samples)]
        d = self._draft(q, self._estimate(q, pool, action), 1.0, replay)
        d.info.update(policy="fixed")
        return [d] * samples

    def _estimate(self, q: Query, pool: Pool, action: Action) -> Candidate:
        """A candidate with the prior's expected accuracy and cost (as `candidates` computes them)."""
        cfg = self.config
        price = self.prices(pool)
        template, solvers, finisher = action.shape, action.solvers, action.finisher
        n_in = len(q.prompt) // 4 + 40
        acc = [self._skill(pool.worker(w), q.task) for w in solvers]
        cost = sum(_cost(price[w], n_in, cfg.expected_output_tokens) for w in solvers)
        if template == "cascade":
            # Independent answers: the cheap ones agree (all right, or rarely all wrong the same
            # way) and stop, or the escalation decides.
            agree = math.prod(acc)
            esc = [self._skill(pool.worker(w), q.task) for w in action.escalation]
            p = agree + (1 - agree - math.prod(1 - a for a in acc)) * esc[-1]
            cost += (1 - agree) * sum(_cost(price[w], n_in, cfg.expected_output_tokens) for w in action.escalation)
        elif template == "verify":
            b = pool.worker(finisher)
            ab = self._skill(b, q.task)
            p = acc[0] * (1 - 0.2 * (1 - ab)) + (1 - acc[0]) * 0.5 * ab
            cost += _cost(price[b.id], 2 * n_in + cfg.expected_output_tokens, cfg.expected_output_tokens)
        elif template == "ensemble":
            p = _majority(acc)
            f = pool.worker(finisher)
            if f.kind != "function":
                cost += _cost(price[f.id], len(solvers) * (n_in + cfg.expected_output_tokens),
                              cfg.expected_output_tokens)
        else:
            p = acc[0]
        return Candidate(action, p, cost)

    def candidates(self, q: Query, solvers: list[Worker], voters: list[Worker], *,
                   replay: bool = False, pool: Pool | None = None) -> list[Candidate]:
        """Candidate plans; with `replay`, only single workers and ensembles closed by a vote.
        Prices as `pool`'s workers rank them (planning_prices), else as `solvers`' do."""
        cfg = self.config
        price = self.prices(pool) if pool is not None else planning_prices(solvers)
        acc = {w.id: self._skill(w, q.task) for w in solvers}
        n_in = len(q.prompt) // 4 + 40
        cost = {w.id: _cost(price[w.id], n_in, cfg.expected_output_tokens) for w in solvers}
        ranked = sorted(solvers, key=lambda w: -acc[w.id])
        cands: list[Candidate] = []
        if "single" in cfg.templates:
            cands += [Candidate(Action("single", (w.id,)), acc[w.id], cost[w.id]) for w in solvers]
        if "verify" in cfg.templates and len(solvers) > 1 and not replay:
            # Verify a cheap-or-good solver with one of the strongest checkers.
            first = sorted(solvers, key=lambda w: -(acc[w.id] - cfg.cost_weight * cost[w.id]))[:4]
            for a in first:
                for b in ranked[:3]:
                    if a.id == b.id:
                        continue
                    p = acc[a.id] * (1 - 0.2 * (1 - acc[b.id])) + (1 - acc[a.id]) * 0.5 * acc[b.id]
                    c = cost[a.id] + _cost(price[b.id], 2 * n_in + cfg.expected_output_tokens,
                                           cfg.expected_output_tokens)
                    cands.append(Candidate(Action("verify", (a.id,), b.id), p, c))
        k = cfg.ensemble_size
        if "ensemble" in cfg.templates and len(solvers) >= k and (voters or not replay):
            by_value = sorted(solvers, key=lambda w: -(acc[w.id] - cfg.cost_weight * cost[w.id]))
            groups = {tuple(w.id for w in ranked[:k]), tuple(w.id for w in by_value[:k])}
            for group in sorted(groups):
                p = _majority([acc[g] for g in group])
                c = sum(cost[g] for g in group)
                if voters:
                    finisher = voters[0].id
                else:
                    finisher = ranked[0].id
                    c += _cost(price[ranked[0].id], k * (n_in + cfg.expected_output_tokens), cfg.expected_output_tokens)
                cands.append(Candidate(Action("ensemble", group, finisher), p, c))
        return cands

    def _choose(self, q: Query, cands: list[Candidate], samples: int, replay: bool = False) -> list[PlanDraft]:
        cfg = self.config
        utils = [c.accuracy - cfg.cost_weight * c.cost for c in cands]
        if samples == 1 and not cfg.explore:  # greedy; a given `explore` draws, as with a learned policy
            best = max(range(len(cands)), key=lambda i: (utils[i], -i))
            return [self._draft(q, cands[best], 1.0, replay)]
        top = max(utils)
        weights = [math.exp((u - top) / max(cfg.temperature, 1e-9)) for u in utils]
        total = sum(weights)
        probs = [w / total for w in weights]
        if cfg.explore:  # mix in uniform exploration; the propensity is the mixture's probability
            probs = [(1 - cfg.explore) * p + cfg.explore / len(probs) for p in probs]
        rng = random.Random(_seed(self.seed, q.query_id))
        picks = rng.choices(range(len(cands)), weights=probs, k=samples)
        return [self._draft(q, cands[i], probs[i], replay) for i in picks]

    def _draft(self, q: Query, c: Candidate, propensity: float, replay: bool = False) -> PlanDraft:
        text = orjson.dumps({"steps": self.steps(q, c, replay=replay)}).decode()
        return PlanDraft(
            text=text,
            propensity=propensity,
            template_version=TEMPLATE_VERSION,
            info={"template": c.template, "expected_accuracy": round(c.accuracy, 4),
                  "expected_cost_usd": c.cost, "action": c.action.key, "policy": "prior"},
        )

    def steps(self, q: Query, c: Candidate, *, replay: bool = False) -> list[dict]:
        solve = q.prompt if replay else solve_instruction(q)  # a recorded answer needs the question verbatim
        finish = {"verify": VERIFY, "ensemble": AGGREGATE}.get(c.template)
        return c.action.steps(solve, _with_format(finish, q.task) if finish else None)

    def _skill(self, w: Worker, task: str | None) -> float:
        s = w.skill(task)
        if s is not None:
            return s
        if task is not None and task in w.skills:
            return self.config.listed_skill
        return self.config.default_skill


def solve_instruction(q: Query) -> str:
    """The prompt itself, plus the answer-line convention the graders read."""
    if q.task not in ANSWER_LINE:
        return q.prompt
    return f"{q.prompt}\n\n{SOLVE[q.task]} {ANSWER_LINE[q.task]}"


def _with_format(text: str, task: str | None) -> str:
    return f"{text} {ANSWER_LINE[task]}" if task in ANSWER_LINE else text


def _cost(price: Price, tokens_in: int, tokens_out: int) -> float:
    return tokens_in * price.input + tokens_out * price.output


def _majority(ps: list[float]) -> float:
    """Probability that more than half of independent solvers are right."""
    n = len(ps)
    total = 0.0
    for k in range(n // 2 + 1, n + 1):
        for right in combinations(range(n), k):
            p = 1.0
            for i in range(n):
                p *= ps[i] if i in right else 1 - ps[i]
            total += p
    return total


def _seed(seed: int, query_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{query_id}".encode()).digest()[:8], "big")


def _invalid(reason: str) -> PlanDraft:
    return PlanDraft(text="", template_version=TEMPLATE_VERSION, info={"error": reason})
