"""The segment learner: one action per group of queries (a metadata field), its cost
weight set by cross-fitting. Synthetic sweep logs, as `policy rollouts --samples all`
writes them: every action once per query, propensity 1/N."""

from __future__ import annotations

import random

import pytest

from conductor.policy.actions import Action
from conductor.policy.features import Context, FeatureSettings, context, group_of
from conductor.policy.learner import FixedLearner, Logged, SegmentLearner, best_singles, load_learner

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
