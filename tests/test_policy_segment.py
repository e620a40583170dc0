"""The segment learner: one action per group of queries (a metadata field), its cost
weight set by cross-fitting. Synthetic sweep logs, as `policy rollouts --samples all`
writes them: every action once per query, propensity 1/N."""

from __future__ import annotations

import random

import orjson
import pytest

from conductor.policy.actions import Action
from conductor.policy.features import Context, FeatureSettings, context, group_of
from conductor.policy.learner import (FixedLearner, Logged, SegmentLearner, action_logs, best_singles,
                                      load_learner)

BIG = Action("single", ("big",))  # right on every group, dear
ALGEBRA = Action("single", ("algebra",))  # right on algebra only, cheap
HISTORY = Action("single", ("history",))  # right on history only, cheap
ACTIONS = [BIG, ALGEBRA, HISTORY]
COST = {BIG.key: 0.01, ALGEBRA.key: 0.001, HISTORY.key: 0.001}


def sweep(right, groups: dict[str, int], actions=ACTIONS, cost=COST, task="choice") -> list[Logged]:
    """Every action logged once on every query; `right(action_key, group, i)` says if it was correct."""
    out = []
    for group, n in groups.items():
        for i in range(n):
            ctx = Context(task, {}, {}, group)
            for j, a in enumerate(actions):
                ok = right(a.key, group, i)
                out.append(Logged(ctx, list(actions), j, 1 / len(actions), float(ok), correct=ok,
                                  cost=cost[a.key], query=f"{group}-{i}"))
    return out


def planted(key: str, group: str, i: int) -> bool:
    return key == BIG.key or key == f"single:{group}"


def test_each_group_gets_its_cheap_specialist_where_one_fixed_action_must_pay_for_the_dear_one():
    logs = sweep(planted, {"algebra": 60, "history": 60})
    seg = SegmentLearner(floor=0.0)
    seg.fit(logs)
    assert seg.choice["choice"]["groups"] == {"algebra": ALGEBRA.key, "history": HISTORY.key}
    why = seg.why["choice"]
    assert why["reached"] and why["grouped"]
    assert why["crossfit_accuracy"] == 1.0 and why["crossfit_usd"] == pytest.approx(0.001)
    fixed = FixedLearner(floor=0.0)
    fixed.fit(logs)
    assert fixed.choice["choice"] == BIG.key  # no single action matches big's accuracy for less
    # Planning: a query of each group gets its specialist; a group never seen gets the task-wide choice.
    for group, want in (("algebra", ALGEBRA), ("history", HISTORY), ("poetry", BIG), (None, BIG)):
        assert ACTIONS[seg.greedy(Context("choice", {}, {}, group), ACTIONS)] == want


def test_cross_fitting_keeps_noise_in_small_groups_from_passing_for_skill():
    """Thirty groups of 20 queries: the cheap workers are right at random half the time,
    the dear one 80%. Picking per group on the logs finds a cheap worker that looks right
    ~70% of the time in every group; a floor at the dear worker's accuracy must not take
    that for real."""
    rng = random.Random(1)
    cheap = [Action("single", (f"cheap{j}",)) for j in range(6)]
    actions, cost = [BIG, *cheap], {BIG.key: 0.01, **{a.key: 0.001 for a in cheap}}
    noise = {(a.key, g, i): (rng.random() < (0.8 if a == BIG else 0.5)) for a in actions for g in range(30)
             for i in range(20)}
    logs = sweep(lambda k, g, i: noise[(k, int(g), i)], {str(g): 20 for g in range(30)}, actions, cost)
    in_sample = sum(max(sum(noise[(a.key, g, i)] for i in range(20)) for a in cheap) for g in range(30)) / 600
    assert in_sample > 0.6  # what choosing on the logs alone would believe of the cheap workers
    seg = SegmentLearner(floor=-0.05)
    seg.fit(logs)
    why = seg.why["choice"]
    assert why["crossfit_accuracy"] >= why["need_accuracy"]
    picks = [actions[seg.greedy(Context("choice", {}, {}, str(g)), actions)] for g in range(30)]
    assert picks.count(BIG) >= 25, picks  # the dear worker almost everywhere


def test_without_a_floor_each_group_maximises_accuracy_minus_lambda_cost():
    logs = sweep(planted, {"algebra": 30, "history": 30})
    cheap = SegmentLearner(lam=0.0)  # accuracy alone: every action ties on its own group, big on both
    cheap.fit(logs)
    assert cheap.why["choice"]["lambda"] == 0.0 and "need_accuracy" not in cheap.why["choice"]
    assert cheap.choice["choice"]["all"] == BIG.key
    dear = SegmentLearner(lam=50.0)
    dear.fit(logs)
    assert dear.choice["choice"]["groups"] == {"algebra": ALGEBRA.key, "history": HISTORY.key}


def test_a_budget_buys_the_most_accurate_grouping_within_the_cap(tmp_path):
    """The specialists are right on 90% of their group, the dear worker on all of them. Within
    15% of its cost, one cheap worker for everyone is right on half the queries; one per
    group, on 90%. Over a cap nothing meets, the cheapest setting is flagged as missing it."""
    logs = sweep(lambda k, g, i: k == BIG.key or (k == f"single:{g}" and i % 10 != 0),
                 {"algebra": 60, "history": 60})
    seg = SegmentLearner(budget=0.15, reference=best_singles(logs))
    seg.fit(logs)
    why = seg.why["choice"]
    assert seg.choice["choice"]["groups"] == {"algebra": ALGEBRA.key, "history": HISTORY.key}
    assert why["reached"] and why["grouped"] and why["crossfit_usd"] <= why["cap_usd"] == pytest.approx(0.0015)
    assert why["crossfit_accuracy"] == pytest.approx(0.9) and why["task_wide_crossfit"][0] < 0.6
    fixed = FixedLearner(budget=0.15, reference=best_singles(logs))
    fixed.fit(logs)
    assert fixed.choice["choice"] != BIG.key
    roomy = SegmentLearner(budget=1.0, reference=best_singles(logs))  # the dear worker fits: it is the best
    roomy.fit(logs)
    assert roomy.choice["choice"]["all"] == BIG.key and not roomy.why["choice"]["grouped"]
    tight = SegmentLearner(budget=0.05, reference=best_singles(logs))
    tight.fit(logs)
    assert not tight.why["choice"]["reached"]
    back = load_learner(tmp_path, {"kind": "segment", "name": "segment", "files": seg.save(tmp_path)})
    assert back.budget == 0.15 and back.choice == seg.choice


def test_shrinkage_lets_a_real_specialist_through_but_not_a_lucky_one():
    """`wide` is right on 70% of every group, `history` on all of history and nothing else,
    so grouping pays. On algebra, `lucky` beats `wide` by one question in thirty and is wrong
    everywhere else, and `algebra`, where it is planted, is right on all of algebra. On the
    group's logs alone (shrink 0) algebra takes the lucky worker; weighing the task-wide logs
    as 20 more queries drops it and keeps the real specialist."""
    wide, lucky = Action("single", ("wide",)), Action("single", ("lucky",))
    actions = [wide, lucky, ALGEBRA, HISTORY]
    cost = {a.key: 0.001 for a in actions}

    def right(with_specialist: bool):
        def ok(key: str, group: str, i: int) -> bool:
            if key == wide.key:
                return i % 10 < 7
            if key == lucky.key:
                return group == "algebra" and i % 30 < 22  # 22 of 30 on algebra, where wide has 21
            return key == f"single:{group}" and (with_specialist or group == "history")
        return ok

    for shrink, specialist, want in ((0.0, False, lucky), (20.0, False, wide), (20.0, True, ALGEBRA)):
        seg = SegmentLearner(lam=0.0, shrinks=[shrink], folds=2)
        seg.fit(sweep(right(specialist), {"algebra": 30, "history": 60}, actions, cost))
        assert seg.why["choice"]["grouped"] and seg.why["choice"]["shrink"] == shrink
        assert seg.choice["choice"]["all"] == wide.key
        assert seg.choice["choice"]["groups"] == {"algebra": want.key, "history": HISTORY.key}, (shrink, specialist)


def test_cross_fitted_shrinkage_plans_new_queries_of_many_small_groups_better():
    """Twelve groups of 80 queries. Within a 15% budget (the dear worker is out), `wide` is
    right 75% of the time everywhere, eight cheap workers 70%, except that four of them are
    right 95% of the time on one group each. Over twenty draws of the logs, the choices made
    with the default shrinks (cross-fitted with lam) must be worth more on new queries (the
    true accuracies of the chosen workers) than the choices on each group's logs alone."""
    wide = Action("single", ("wide",))
    cheap = [Action("single", (f"cheap{j}",)) for j in range(8)]
    actions = [BIG, wide, *cheap]
    cost = {BIG.key: 0.01, **{a.key: 0.001 for a in (wide, *cheap)}}

    def p(key: str, g: int) -> float:
        if key == BIG.key:
            return 0.85
        if key == wide.key:
            return 0.75
        return 0.95 if key == f"single:cheap{g}" and g < 4 else 0.70

    worth: dict[str, list[float]] = {"alone": [], "shrunk": []}
    for seed in range(20):
        rng = random.Random(seed)
        draw = {(a.key, g, i): rng.random() < p(a.key, g) for a in actions for g in range(12) for i in range(80)}
        logs = sweep(lambda k, g, i: draw[(k, int(g), i)], {str(g): 80 for g in range(12)}, actions, cost)
        # One draw's per-action tables, made once for both fits and the reference (as training shares
        # them with the fixed action): they depend on the logs alone, and took half the test's time.
        tables = action_logs(logs)
        reference = best_singles(logs, tables)
        for name, shrinks in (("alone", [0.0]), ("shrunk", None)):
            seg = SegmentLearner(budget=0.15, reference=reference, shrinks=shrinks)
            seg.fit(logs, tables)
            assert seg.why["choice"]["shrinks_tried"] == list(shrinks or SegmentLearner.shrinks)
            picks = [actions[seg.greedy(Context("choice", {}, {}, str(g)), actions)] for g in range(12)]
            worth[name].append(sum(p(a.key, g) for g, a in enumerate(picks)) / 12)
    alone, shrunk = worth["alone"], worth["shrunk"]
    assert sum(shrunk) / 20 > sum(alone) / 20 + 0.003, worth
    assert sum(s > a for s, a in zip(shrunk, alone)) > 2 * sum(s < a for s, a in zip(shrunk, alone)), worth


def test_shrinks_are_saved_and_checked(tmp_path):
    logs = sweep(planted, {"algebra": 40, "history": 40})
    seg = SegmentLearner(floor=0.0, reference=best_singles(logs), shrinks=[0, 30])
    seg.fit(logs)
    back = load_learner(tmp_path, {"kind": "segment", "name": "segment", "files": seg.save(tmp_path)})
    assert back.shrinks == (0.0, 30.0) and back.describe()["shrinks"] == [0.0, 30.0]
    data = orjson.loads((tmp_path / "segment.json").read_bytes())
    del data["shrinks"]  # an artifact from before shrinkage: its groups chose on their own logs
    (tmp_path / "segment.json").write_bytes(orjson.dumps(data))
    assert load_learner(tmp_path, {"kind": "segment", "name": "segment"}).shrinks == (0.0,)
    for bad in ([], [-1.0], [float("nan")], [float("inf")]):
        with pytest.raises(ValueError, match="shrinks"):
            SegmentLearner(shrinks=bad)


def test_groups_below_the_minimum_size_take_the_task_wide_choice():
    logs = sweep(planted, {"algebra": 60, "history": 5})
    seg = SegmentLearner(floor=0.0, min_group=20)
    seg.fit(logs)
    assert seg.choice["choice"]["groups"] == {"algebra": ALGEBRA.key}
    assert ACTIONS[seg.greedy(Context("choice", {}, {}, "history"), ACTIONS)] == BIG
    assert seg.why["choice"]["groups"] == {"algebra": 60, "(task-wide)": 5}


def test_a_saved_segment_learner_plans_the_same(tmp_path):
    logs = sweep(planted, {"algebra": 40, "history": 40})
    seg = SegmentLearner(floor=0.0, reference=best_singles(logs))
    seg.fit(logs)
    files = seg.save(tmp_path)
    back = load_learner(tmp_path, {"kind": "segment", "name": "segment", "files": files})
    for group in ("algebra", "history", "other", None):
        ctx = Context("choice", {}, {}, group)
        assert back.greedy(ctx, ACTIONS) == seg.greedy(ctx, ACTIONS)
    # A candidate list without the group's choice falls back to the task-wide choice (big),
    # and without that too, to the candidate with the best task-wide score.
    assert back.greedy(Context("choice", {}, {}, "algebra"), [HISTORY, BIG]) == 1
    assert back.greedy(Context("choice", {}, {}, "algebra"), [HISTORY]) == 0


@pytest.mark.parametrize("metadata, group", [
    ('{"category": "law"}', "law"),
    ('{"category": 7}', "7"),
    ('{"other": "x"}', None),
    ('{"category": null}', None),
    (None, None),
    ("[1, 2]", None),
])
def test_the_group_is_the_named_metadata_field(metadata, group):
    assert group_of(metadata, "category") == group
    assert context("A question?", "choice", FeatureSettings(group_by="category"), metadata).group == group
    assert context("A question?", "choice", FeatureSettings(), metadata).group is None


def test_policy_show_says_what_the_groups_chose():
    from conductor.policy.training import _groups_text

    logs = sweep(planted, {"algebra": 60, "history": 60})
    seg = SegmentLearner(floor=0.0, shrinks=[0, 30])
    seg.fit(logs)
    (line,) = _groups_text(seg.why, "subject")
    shrink = seg.why["choice"]["shrink"]
    assert line.startswith(f"groups   choice: 2 groups by subject, shrink {shrink:g} (of 0 30), lambda ")
    assert "cross-fitted 1.0000 at $0.00100, task-wide 1.0000 at $0.0100" in line
