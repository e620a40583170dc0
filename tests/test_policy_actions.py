"""The policy's action space and its selection: cascades, the measured Pareto cut,
sweeps and fixed actions, and training that ships the learned policy only when it
beats the best fixed action on held-back queries."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest
import yaml

from conductor.planners.base import Query
from conductor.planners.embedded import EmbeddedConfig, EmbeddedPlanner
from conductor.plans import parse_plan
from conductor.policy.actions import Action, Measured, action_set, from_steps, pareto
from conductor.policy.features import context
from conductor.policy.learner import FixedLearner, Logged
from conductor.policy.training import TrainConfig, choose, policy_value
from conductor.pool import load_pool

PRICES = {"tiny": 0.1, "small": 0.2, "mid": 0.3, "big": 4.0, "huge": 10.0}
SKILLS = {"tiny": 0.7, "small": 0.75, "mid": 0.8, "big": 0.9, "huge": 0.92}


@pytest.fixture
def pool(tmp_path):
    workers = [{"id": w, "model": f"openai/{w}", "api_base": "http://127.0.0.1:9/v1", "skills": {"math": s},
                "price": {"input_per_mtok": PRICES[w], "output_per_mtok": PRICES[w]}} for w, s in SKILLS.items()]
    workers.append({"id": "vote", "kind": "function", "function": "vote"})
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"workers": workers}))
    return load_pool(path)


def test_cascade_keys_and_plans_round_trip():
    a = Action.from_key("cascade:tiny+small>big>huge")
    assert a.solvers == ("tiny", "small") and a.escalation == ("big", "huge") and a.key == "cascade:tiny+small>big>huge"
    steps = a.steps("What is 2 + 2?")
    assert steps[2]["when"] == {"disagree": [0, 1]} and steps[3]["when"] == {"no_majority": [0, 1, 2]}
    assert from_steps(orjson.dumps({"steps": steps}).decode()) == a
    for bad in ("cascade:tiny>big", "cascade:tiny+small", "cascade:a+b>c>d>e", "single:", "loop:a"):
        with pytest.raises(ValueError):
            Action.from_key(bad)


def test_the_action_set_holds_cheap_cascades_not_only_expensive_singles(pool):
    acts = action_set(pool, "math")
    keys = {a.key for a in acts}
    assert {f"single:{w}" for w in SKILLS} <= keys  # every worker alone
    cascades = [a for a in acts if a.shape == "cascade"]
    # Cheap members only (at most a third of the best worker's price), escalating to the 4 most skilled.
    assert cascades and all(set(a.solvers) <= {"tiny", "small", "mid"} for a in cascades)
    assert {a.escalation[-1] for a in cascades} == {"huge", "big", "mid", "small"}
    assert "cascade:mid+small>huge" in keys and "cascade:mid+small+tiny>big" in keys
    assert "cascade:mid+small>big>huge" in keys  # two-level
    assert "ensemble:mid+small+tiny>vote" in keys


def test_pareto_keeps_the_frontier_and_drops_what_is_dominated():
    def m(key, acc, cost, n=400):
        return Measured(Action.from_key(key), n, acc, cost)

    ms = [m("single:huge", 0.90, 10.0), m("single:big", 0.90, 2.0), m("single:tiny", 0.70, 0.1),
          m("cascade:tiny+small>huge", 0.93, 1.0), m("single:mid", 0.60, 0.3),  # dominated far below
          m("cascade:tiny+small>big", 0.925, 0.9)]
    kept = {x.action.key for x in pareto(ms, band=1.0)}
    assert "single:mid" not in kept and "single:huge" not in kept and "single:big" not in kept
    assert {"single:tiny", "cascade:tiny+small>big", "cascade:tiny+small>huge"} <= kept


def test_a_sweep_plans_every_candidate_once_with_equal_propensities(pool):
    q = Query("q1", "What is 2 + 2?", "math")
    n = len(action_set(pool, "math"))
    drafts = EmbeddedPlanner(EmbeddedConfig(sweep=True, policy="none")).plan([q], pool, n + 3)[0]
    valid = [d for d in drafts if d.text]
    assert len(valid) == n and len({d.info["action"] for d in valid}) == n
    assert all(d.propensity == pytest.approx(1 / n) for d in valid)
    assert [d.info["error"] for d in drafts if not d.text] == [f"sweep slot not used: this query has {n} "
                                                               f"candidate actions"] * 3
    cascade = next(d for d in valid if d.info["action"] == "cascade:mid+small>huge")
    plan = parse_plan(cascade.text, pool)
    assert from_steps(plan.to_json()) == Action.from_key("cascade:mid+small>huge")
    with pytest.raises(Exception, match="use --samples all"):
        EmbeddedPlanner(EmbeddedConfig(sweep=True, policy="none")).plan([q], pool, 2)


def test_a_fixed_action_is_planned_for_every_query_and_a_foreign_worker_is_refused(pool):
    qs = [Query(f"q{i}", f"What is {i} + 2?", "math") for i in range(3)]
    drafts = EmbeddedPlanner(EmbeddedConfig(action="cascade:tiny+small>big", policy="none")).plan(qs, pool, 1)
    assert [d[0].info["action"] for d in drafts] == ["cascade:tiny+small>big"] * 3
    with pytest.raises(Exception, match="gpt-9"):
        EmbeddedPlanner(EmbeddedConfig(action="single:gpt-9", policy="none")).plan(qs, pool, 1)


def _logs(n_queries: int, signal: bool) -> list[Logged]:
    """Sweep-shaped logs over two actions: with `signal`, queries that mention alpha are solved
    only by `a` and those that mention beta only by `b`; without, `a` is always a bit better."""
    acts = [Action("single", ("a",)), Action("single", ("b",))]
    out = []
    for i in range(n_queries):
        word = "alpha" if i % 2 else "beta"
        ctx = context(f"Question {i} about {word}: how many?", "math")
        for j, act in enumerate(acts):
            if signal:
                ok = (word == "alpha") == (act.solvers[0] == "a")
            else:
                ok = (i % 5 != 0) if j == 0 else (i % 4 != 0)
            out.append(Logged(ctx, acts, j, 0.5, float(ok), correct=ok, cost=0.0, query=f"q{i}"))
    return out


def test_training_ships_the_learned_policy_only_when_it_beats_the_best_fixed_action(tmp_path):
    cfg = TrainConfig(pool=tmp_path / "unused.yaml", runs=[], holdout=0.3)
    sel = choose(cfg, _logs(400, signal=True))
    assert sel["shipped"] == "learned"
    assert sel["learned"]["accuracy"] > 0.9 and sel["fixed"]["accuracy"] < 0.6
    # The per-task table learner can only do what the fixed action does: a tie ships the fixed one.
    sel = choose(TrainConfig(pool=tmp_path / "unused.yaml", runs=[], holdout=0.3, learner="table"),
                 _logs(400, signal=False))
    assert sel["shipped"] == "fixed" and sel["fixed"]["choice"] == {"math": "single:a"}
    assert sel["learned"]["reward"] == pytest.approx(sel["fixed"]["reward"])


def test_policy_value_is_exact_on_sweep_logs():
    logs = _logs(200, signal=False)
    fixed = FixedLearner()
    fixed.fit(logs)
    v = policy_value(fixed, logs)
    truth = sum(1 for i in range(200) if i % 5 != 0) / 200  # action a on every query
    assert v["accuracy"] == pytest.approx(truth) and v["matched"] == 200


def test_an_action_that_serves_half_the_queries_is_not_the_best_fixed_action():
    """A replay model that recorded half the questions is perfect on those: measured on them
    alone it would look best; counted over every query it is not."""
    a, b = Action("single", ("a",)), Action("single", ("b",))
    logs = []
    for i in range(200):
        ctx = context(f"Question {i}", "math")
        acts = [a, b] if i % 2 else [a]
        for j, act in enumerate(acts):
            ok = True if act is b else (i % 10 != 0)
            logs.append(Logged(ctx, acts, j, 1 / len(acts), float(ok), correct=ok, cost=0.0, query=f"q{i}"))
    fixed = FixedLearner()
    fixed.fit(logs)
    assert fixed.choice == {"math": "single:a"}
    from conductor.policy.training import measure
    m = {x.action.key: x for x in measure(logs)["math"]}
    assert m["single:b"].accuracy == pytest.approx(0.5) and m["single:a"].accuracy == pytest.approx(0.9)


def _priced_logs(n: int, lam: float = 0.01) -> list[Logged]:
    """Sweep-shaped logs of four actions with known accuracy and cost: the best single `big`
    (0.90 at $1), a cascade matching it at a fifth of the cost, a cheaper cascade a point and
    a half below it, and a cheap single far below."""
    table = {"single:big": (0.90, 1.0), "cascade:tiny+small>big": (0.90, 0.2),
             "cascade:tiny+small>mid": (0.885, 0.1), "single:tiny": (0.70, 0.01)}
    acts = [Action.from_key(k) for k in table]
    out = []
    for i in range(n):
        ctx = context(f"Question {i}: how many?", "math")
        for j, a in enumerate(acts):
            acc, usd = table[a.key]
            ok = (i % 200) < acc * 200
            out.append(Logged(ctx, acts, j, 1 / len(acts), float(ok) - lam * usd, correct=ok, cost=usd,
                              query=f"q{i}"))
    return out


def test_a_floor_picks_the_cheapest_action_reaching_the_best_singles_accuracy():
    logs = _priced_logs(400)
    by_reward = FixedLearner()
    by_reward.fit(logs)  # lambda 0.01: the reward ranks the two cascades by accuracy
    assert by_reward.choice == {"math": "cascade:tiny+small>big"}
    match = FixedLearner(floor=0.0)
    match.fit(logs)
    assert match.choice == {"math": "cascade:tiny+small>big"}
    assert match.why["math"]["best_single"] == "single:big" and match.why["math"]["reached"]
    within = FixedLearner(floor=-0.02)  # within two points: the cheaper cascade is enough
    within.fit(logs)
    assert within.choice == {"math": "cascade:tiny+small>mid"}
    above = FixedLearner(floor=0.05)  # nothing reaches it: the most accurate, the cheaper of a tie
    above.fit(logs)
    assert above.choice == {"math": "cascade:tiny+small>big"} and not above.why["math"]["reached"]


def test_a_budget_picks_the_most_accurate_action_within_that_share_of_the_best_singles_cost():
    """The other side of the same target: spend the allowance on accuracy instead of saving it."""
    logs = _priced_logs(400)
    quarter = FixedLearner(budget=0.25)  # both cascades fit: the more accurate one
    quarter.fit(logs)
    assert quarter.choice == {"math": "cascade:tiny+small>big"}
    assert quarter.why["math"]["cap_usd"] == pytest.approx(0.25) and quarter.why["math"]["reached"]
    tenth = FixedLearner(budget=0.15)  # the dear cascade (20%) is over: the cheap one
    tenth.fit(logs)
    assert tenth.choice == {"math": "cascade:tiny+small>mid"}
    tight = FixedLearner(budget=0.001)  # nothing fits: the cheapest action, flagged
    tight.fit(logs)
    assert tight.choice == {"math": "single:tiny"} and not tight.why["math"]["reached"]


def test_with_a_budget_the_learned_policy_ships_only_within_it_and_more_accurate(tmp_path, monkeypatch):
    logs = _priced_logs(400)
    ctx_ids = {id(e.context): int(e.query[1:]) for e in logs}

    class Routes:
        """The cheap single where it is right, the dear cascade elsewhere: as accurate as the
        best single at about 6% of its cost; `dear` routes the rest to the best single itself."""

        def __init__(self, dear=False):
            self.dear = dear

        def fit(self, examples):
            return {}

        def greedy(self, ctx, actions):
            rest = "single:big" if self.dear else "cascade:tiny+small>big"
            return [a.key for a in actions].index("single:tiny" if ctx_ids[id(ctx)] % 200 < 140 else rest)

    cfg = TrainConfig(pool=tmp_path / "unused.yaml", runs=[], holdout=0.3, budget=0.15)
    monkeypatch.setattr("conductor.policy.training._learner", lambda cfg, reference=None: Routes())
    sel = choose(cfg, logs)
    assert sel["fixed"]["choice"] == {"math": "cascade:tiny+small>mid"}  # 0.885 at 10%
    assert sel["learned_share_of_best_single_usd"] < 0.15 and sel["learned_minus_fixed_accuracy"][0] > 0
    assert sel["shipped"] == "learned"
    # As accurate, but over the budget on the held-back queries: the fixed action ships.
    monkeypatch.setattr("conductor.policy.training._learner", lambda cfg, reference=None: Routes(dear=True))
    sel = choose(cfg, logs)
    assert sel["learned_share_of_best_single_usd"] > 0.15 and sel["shipped"] == "fixed"
    # A pool of free workers: every action fits a share of nothing, so the fixed one is simply the
    # most accurate, and the routes (no more accurate) stay unshipped; no share is made up.
    sel = choose(cfg, [replace(e, cost=0.0) for e in logs])
    assert sel["fixed"]["choice"]["math"] in ("single:big", "cascade:tiny+small>big")  # both 0.90
    assert sel["learned_share_of_best_single_usd"] is None and sel["shipped"] == "fixed"


class _PlaysBOnZebra:
    """A per-query policy whose picks are known: `b` on the zebra queries' contexts, else `a`."""

    zebras: set[int] = set()

    def fit(self, examples):
        return {}

    def greedy(self, ctx, actions):
        return 1 if id(ctx) in self.zebras else 0


def test_a_learned_policy_within_noise_of_the_fixed_action_is_not_shipped(tmp_path, monkeypatch):
    """On every tenth query (a zebra) `b` beats `a` five times in nine and loses four, so the
    learned policy is a little better on the held-back queries than the fixed `a`, by less
    than one standard error of the difference: the fixed action ships. With no margin asked
    for, the point estimate decides; with a real edge (b wins on every zebra), it ships."""
    import conductor.policy.training as training

    monkeypatch.setattr(training, "_learner", lambda cfg, reference=None: _PlaysBOnZebra())
    acts = [Action("single", ("a",)), Action("single", ("b",))]

    def logs(b_wins):
        out = []
        for i in range(400):
            zebra = i % 10 == 0
            ctx = context(f"Question {i} {'zebra' if zebra else 'plain'}", "math")
            if zebra:
                _PlaysBOnZebra.zebras.add(id(ctx))
            for j, act in enumerate(acts):
                ok = (act.solvers[0] == "b") == b_wins(i) if zebra else act.solvers[0] == "a"
                out.append(Logged(ctx, acts, j, 0.5, float(ok), correct=ok, cost=0.0, query=f"q{i}"))
        return out

    noisy = logs(lambda i: (i // 10) % 9 < 5)
    cfg = TrainConfig(pool=tmp_path / "unused.yaml", runs=[], holdout=0.5)
    sel = choose(cfg, noisy)
    d = sel["learned_minus_fixed_reward"]
    assert sel["fixed"]["choice"] == {"math": "single:a"}
    assert 0 < d[0] <= d[1] and sel["shipped"] == "fixed"
    assert choose(TrainConfig(pool=tmp_path / "unused.yaml", runs=[], holdout=0.5, ship_margin=0),
                  noisy)["shipped"] == "learned"
    assert choose(cfg, logs(lambda i: True))["shipped"] == "learned"


def test_with_a_floor_the_learned_policy_ships_only_when_it_reaches_it_and_costs_less(tmp_path, monkeypatch):
    logs = _priced_logs(400)
    sel = choose(TrainConfig(pool=tmp_path / "unused.yaml", runs=[], holdout=0.3, floor=0.0, learner="table"), logs)
    # The table learner plays the best-reward action: the fixed one itself, so nothing is saved.
    assert sel["fixed"]["choice"] == {"math": "cascade:tiny+small>big"}
    assert sel["fixed_minus_learned_usd"][0] == pytest.approx(0) and sel["shipped"] == "fixed"
    # Trained with a lambda that pays too much for cost, it plays the cheap single: cheaper, but
    # far below the best single on the held-back queries, so the fixed action ships.
    sel = choose(TrainConfig(pool=tmp_path / "unused.yaml", runs=[], holdout=0.3, floor=0.0, learner="table"),
                 _priced_logs(400, lam=50.0))
    assert sel["fixed_minus_learned_usd"][0] > 0 and sel["learned_minus_best_single_accuracy"][0] < -0.1
    assert sel["shipped"] == "fixed"

    # A per-query policy that sends the questions the cheap single solves to it, and the rest to
    # the cascade: the best single's accuracy at a third of the cascade's cost. It ships.
    class Routes:
        def fit(self, examples):
            return {}

        def greedy(self, ctx, actions):
            i = int(ctx_ids[id(ctx)])
            return [a.key for a in actions].index("single:tiny" if i % 200 < 140 else "cascade:tiny+small>big")

    ctx_ids = {id(e.context): e.query[1:] for e in logs}
    monkeypatch.setattr("conductor.policy.training._learner", lambda cfg, reference=None: Routes())
    sel = choose(TrainConfig(pool=tmp_path / "unused.yaml", runs=[], holdout=0.3, floor=0.0), logs)
    assert sel["learned"]["accuracy"] >= 0.9 and sel["learned"]["usd"] < 0.1
    assert sel["shipped"] == "learned"


def test_folds_hold_every_query_back_once_from_fits_that_never_saw_it(tmp_path, monkeypatch):
    """`folds` K: each query is judged once, by a learner and a fixed action fitted on the
    other K - 1 parts, so the choice between them rests on every train query."""
    logs = _logs(400, signal=True)
    query_of = {id(e.context): e.query for e in logs}
    fits = []

    class Spy:
        def fit(self, examples):
            fits.append({e.query for e in examples})
            return {}

        def greedy(self, ctx, actions):
            assert query_of[id(ctx)] not in fits[-1], "judged by a fit that saw it"
            word_alpha = "alpha" in ctx_words[id(ctx)]
            return [a.solvers[0] for a in actions].index("a" if word_alpha else "b")

    ctx_words = {id(e.context): ("alpha" if int(e.query[1:]) % 2 else "beta") for e in logs}
    monkeypatch.setattr("conductor.policy.training._learner", lambda cfg, reference=None: Spy())
    sel = choose(TrainConfig(pool=tmp_path / "unused.yaml", runs=[], folds=4), logs)
    assert sel["how"] == "4-fold cross-fit" and sel["held_back_queries"] == 400 and len(sel["folds"]) == 4
    assert len(fits) == 4 and sum(len(f) for f in fits) == 3 * 400
    assert set.union(*({f"q{i}" for i in range(400)} - f for f in fits)) == {f"q{i}" for i in range(400)}
    assert sel["learned"]["accuracy"] == 1.0 and sel["learned"]["matched"] == 400 and sel["shipped"] == "learned"
    # One held-back share instead: a quarter of the queries decide.
    one = choose(TrainConfig(pool=tmp_path / "unused.yaml", runs=[], holdout=0.25), logs)
    assert 60 < one["held_back_queries"] < 140 and "folds" not in one
