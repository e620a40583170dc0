"""Evaluation of a replay pool: every single worker, the best single worker, the
per-question oracle, uniform random, the embedded planner (its prior) and any
learned policies given (a lambda sweep draws a curve), each as accuracy, mean
USD, calls and tokens per query; written as Markdown, JSON and a chart.

For each learned policy artifact it also runs the best fixed action training
chose (`use=fixed`) and, once, the best fixed cascade measured on the train
split; it compares them on the same queries (paired standard errors) and
checks the targets given.

`conductor eval` and the Dagster asset `eval_report` are thin front ends over
`evaluate`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from conductor.errors import ConductorError
from conductor.evaluation.planner import run_planner, sample_ids
from conductor.evaluation.policies import Policy, paired, table_policies
from conductor.evaluation.report import chart, markdown, objective, objective_order, off_chart, placeholder
from conductor.evaluation.table import build_matrix
from conductor.execute.lock import LOCK_FILE, run_lock
from conductor.pool import load_pool
from conductor.queries import load_queries
from conductor.replay.tables import SPLITS, read_table, replay_source, split_of


@dataclass
class EvalConfig:
    pool: Path
    queries: Path
    split: str = "all"
    out: Path | None = None  # default: data/eval/<dataset>-<split>
    planner: bool = True  # run the embedded planner through the pipeline
    planner_limit: int | None = None  # run it on this many of the queries (a fixed spread-out subset)
    planner_options: dict[str, Any] = field(default_factory=dict)
    policies: list[Path] = field(default_factory=list)  # learned policy artifacts, each run through the pipeline
    seed: int = 0
    fixed: bool = True  # with policies: also run each one's best fixed action, and the best fixed cascade
    shipped_only: bool = False  # with policies: run only what each one shipped (a second round's comparison)
    targets: list["Target"] = field(default_factory=list)


@dataclass(frozen=True)
class Target:
    """Accuracy at least the best single's + `accuracy_delta`, at most `cost_share` of its USD per query."""

    name: str
    accuracy_delta: float
    cost_share: float

    @classmethod
    def parse(cls, text: str) -> "Target":
        """'DELTA:SHARE', e.g. '0:0.25' (at least the best single at a quarter of its cost)
        or '-0.01:0.15' (within a point at 15%)."""
        try:
            delta, share = (float(x) for x in text.split(":"))
        except ValueError:
            raise ConductorError(f"--target {text!r}: expected ACCURACY_DELTA:COST_SHARE, e.g. 0:0.25") from None
        if not (0 < share < math.inf and -1 <= delta <= 1):
            raise ConductorError(f"--target {text!r}: the accuracy delta is a difference of accuracies, from -1 to 1 "
                                 f"(-0.01: within a point), and the cost share a finite number above 0")
        return cls(f"accuracy >= best single {delta:+.3f} at <= {share:.0%} of its cost", delta, share)


@dataclass
class EvalReport:
    policies: list[Policy]
    meta: dict[str, Any]
    markdown: str
    report_path: Path
    chart_path: Path | None  # None: not even a placeholder could be drawn (the report says why)
    json_path: Path

    def find(self, kind: str, by: str | None = None) -> Policy:
        """The policy of a kind (for best_single and oracle: chosen `by` 'grader' or 'label')."""
        for p in self.policies:
            if p.kind == kind and (by is None or by in (p.info.get("chosen_by"), p.info.get("correct_by"))):
                return p
        raise KeyError(kind)


def evaluate(cfg: EvalConfig) -> EvalReport:
    t0 = time.monotonic()
    if cfg.split not in SPLITS:
        raise ConductorError(f"--split {cfg.split!r}: choose from {', '.join(SPLITS)}")
    if cfg.planner_limit is not None and cfg.planner_limit < 1:
        raise ConductorError(f"--planner-limit must be at least 1 (got {cfg.planner_limit})")
    pool = load_pool(cfg.pool)
    from conductor.policy.artifact import find

    for folder in cfg.policies:  # before the planners' runs, which take minutes
        if find(pool, Path(folder)) is None:
            raise ConductorError(f"--policies {folder}: no policy artifact there for this pool ({cfg.pool})")
    source = replay_source(pool)
    out = Path(cfg.out) if cfg.out else Path("data") / "eval" / f"{source.dataset}-{cfg.split}"
    said = f"--out {out}" if cfg.out else f"report folder {out}"
    _not_a_file(out, said)  # before the grading, which takes a while
    queries = load_queries(cfg.queries)
    all_ids = queries.column("query_id").to_pylist()
    ids = all_ids if cfg.split == "all" else [q for q in all_ids if split_of(q) == cfg.split]
    if not ids:
        raise ConductorError(f"query set {cfg.queries}: no queries in the {cfg.split} split")
    queries = queries.filter(pc.is_in(queries.column("query_id"), pa.array(ids)))
    if cfg.split == "test":  # choose the best single worker without looking at the test split
        table_ids = read_table(source.table, ["question_id"]).filter(pl.col("split") == "train")
        select_ids = table_ids.get_column("question_id").unique(maintain_order=True).to_list()
        if not select_ids:
            raise ConductorError(f"--split test: the table {source.table} has no train questions, so the best "
                                 f"single cannot be chosen on train; use --split all (chosen on the evaluated "
                                 f"questions themselves)")
        selection = f"the train split ({len(select_ids)} questions of the table), never on test"
    else:
        select_ids, selection = ids, "the evaluated queries themselves"
    matrix = build_matrix(pool, queries, set(ids) | set(select_ids))
    labelled = len(matrix.labelled_ids.intersection(ids))
    if not labelled and not matrix.graded_ids.intersection(ids):
        raise ConductorError(f"query set {cfg.queries}: nothing to judge the answers by: no query has a reference "
                             f"and none has a `correct` label on every row of {source.table}")
    policies = table_policies(matrix, ids, select_ids)
    evaluated = matrix.rows.filter(pl.col("question_id").is_in(ids))
    judged = evaluated.filter(pl.col("grader").is_not_null() & pl.col("label").is_not_null())
    tasks = queries.column("task").to_pylist()
    meta: dict[str, Any] = {
        "dataset": source.dataset, "split": cfg.split, "queries": len(ids), "pool": str(cfg.pool),
        "queries_path": str(cfg.queries), "table": str(source.table), "workers": len(matrix.workers),
        "task": matrix.task, "tasks": {t: tasks.count(t) for t in sorted(set(tasks), key=str)},
        "graded_queries": len(matrix.graded_ids.intersection(ids)),
        # Queries with a row whose `correct` is null are left out of the labels' figures (and counted).
        "labelled_queries": labelled, "unlabelled_rows": int(evaluated.get_column("unlabelled").sum()),
        "selection": selection, "grading_s": round(matrix.grading_s, 2),
        # Agreement of our grader with the labels, on the labelled rows it can judge (None: no such row).
        "agreement": (judged.select((pl.col("grader") == pl.col("label")).mean()).item()
                      if judged.height else None),
        "rows": evaluated.height, "graded_rows": judged.height,
        # Queries no worker of the pool recorded (a pool of some of the table's models): still judged,
        # wrong for every policy, as in the pipeline's runs.
        "unrecorded_queries": len(set(ids) - set(evaluated.get_column("question_id").to_list())),
        "recorded_cost_rows": int(evaluated.get_column("cost_recorded").sum()),
        "shared_texts": [g for g in matrix.shared if not set(ids).isdisjoint(g)],
        "recorded_cost_by_task": {t: int(n) for t, n in evaluated.filter(pl.col("cost_recorded"))
                                  .group_by("task").len().sort("task").iter_rows()},
        "prompt_tokens_cut": _prompt_cut(evaluated),
    }
    _make_folder(out, said)
    # Two evaluations into one folder would share its planner runs and overwrite each other's report.
    with run_lock(out, f"of eval into {out}"):
        subset = sample_ids(ids, cfg.planner_limit, cfg.seed)
        sub_q = queries.filter(pc.is_in(queries.column("query_id"), pa.array(subset)))
        if cfg.planner:
            # The prior, unless the options name a policy: the learned ones are rows of their own.
            options = {"policy": "none", **cfg.planner_options}
            planned, facts = run_planner(pool, sub_q, out, planner_options=options, seed=cfg.seed,
                                         run_id=f"eval-{source.dataset}-{cfg.split}")
            if len(subset) < len(ids):
                facts["subset_reference"] = _subset_reference(table_policies(matrix, subset, select_ids))
            policies.insert(0, planned)
            meta["planner"] = facts
        learned = [q for i, p in enumerate(cfg.policies) for q in _learned(pool, sub_q, out, Path(p), i, cfg,
                                                                              source.dataset)]
        on_subset = f" ({len(subset)} of {len(ids)} queries)" if len(subset) < len(ids) else ""
        if learned:
            learned.sort(key=lambda p: (*objective_order(p.info), p.kind))
            if cfg.fixed:
                best = _best_by_grader(policies)
                bounds = _task_usd(matrix, select_ids, best) if best is not None else {}
                cascade = _fixed_cascade(pool, sub_q, out, cfg, source.dataset, best, bounds)
                if cascade is not None:
                    learned.append(cascade)
            for p in learned:  # the table's other rows are over every query
                head, mark, _ = p.name.partition(" *shipped*")
                p.name = head + on_subset + mark
            policies[:0] = learned
            meta["learned"] = [p.info for p in learned]
            # Under --planner-limit the learned rows ran on a subset: judge them against the best
            # single on the same queries, not on all of them.
            ref = (_best_by_grader(table_policies(matrix, subset, select_ids)) if len(subset) < len(ids) else None)
            meta["comparisons"] = comparisons(policies, ref)
            meta["targets"] = [check_target(t, policies, ref) for t in cfg.targets]
            if len(subset) < len(ids) and "subset_reference" not in meta.get("planner", {}):
                meta["learned_subset_reference"] = _subset_reference(table_policies(matrix, subset, select_ids))
        meta["wall_time_s"] = round(time.monotonic() - t0, 2)
        title = (f"{source.dataset} ({cfg.split}, {len(ids)} queries): accuracy against cost per query")
        # Our grader's accuracy where anything has a reference; else (a table without any) the labels'.
        meta["chart_accuracy"] = "grader" if meta["graded_queries"] else "labels"
        meta["off_chart"] = off_chart(policies, by=meta["chart_accuracy"])
        chart_path: Path | None
        try:
            chart_path = chart(policies, out / "chart.png", title, by=meta["chart_accuracy"],
                               cost_basis=_cost_basis(meta))
            shown = chart_path.name
        except Exception as e:  # noqa: BLE001 - whatever the chart does, the report is written
            meta["chart_error"] = f"{type(e).__name__}: {e}"
            print(f"conductor: warning: the chart could not be drawn ({meta['chart_error']}); "
                  f"{out / 'report.md'} has every figure", file=sys.stderr)
            chart_path, shown = placeholder(out / "chart.png", meta["chart_error"]), None
        text = markdown(meta, policies, shown)
        report_path = out / "report.md"
        report_path.write_text(text, encoding="utf-8")
        json_path = out / "policies.json"
        json_path.write_bytes(orjson.dumps({"meta": meta, "policies": [p.to_dict() for p in policies]},
                                           option=orjson.OPT_INDENT_2, default=str))
        return EvalReport(policies, meta, text, report_path, chart_path, json_path)


def _not_a_file(out: Path, said: str) -> None:
    """The report folder (report.md, chart.png, policies.json) may not be a file, e.g. `--out report.md`."""
    try:
        is_file = out.exists() and not out.is_dir()
    except OSError:  # not even looked at (a folder on the way that cannot be read): `_make_folder` says why
        return
    if is_file:
        raise ConductorError(f"{said}: is a file, not a folder; eval writes report.md, chart.png and "
                             f"policies.json into a folder: give a folder name (e.g. {out.with_suffix('')}-eval)")


def _make_folder(out: Path, said: str) -> None:
    """Create the report folder and its lock file (as `run_lock` does), or say why it cannot be."""
    _not_a_file(out, said)
    try:
        out.mkdir(parents=True, exist_ok=True)
        os.close(os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644))
    except OSError as e:
        raise ConductorError(f"{said}: cannot create the report folder or write in it "
                             f"({e.strerror or e}{f': {e.filename}' if e.filename else ''})") from None


def _learned(pool, queries: pa.Table, out: Path, folder: Path, i: int, cfg: EvalConfig,
             dataset: str) -> list[Policy]:
    """One learned policy artifact, planned greedily (K=1) through the pipeline: its per-query
    learner and (with `cfg.fixed`) the best fixed action it holds, each marked if shipped."""
    from conductor.policy.artifact import find, read_meta

    found = find(pool, folder)
    if found is None:
        raise ConductorError(f"--policies {folder}: no policy artifact there for this pool")
    meta = read_meta(found)
    lam = float(meta["lambda"])
    floor, budget = meta.get("floor"), meta.get("budget")
    shipped = meta.get("shipped", "learned")
    has_fixed = bool(meta.get("fixed")) or meta["learner"]["kind"] == "fixed"
    # --no-fixed leaves the fixed action out even where it shipped: the learned policy is what is asked
    uses = ([shipped] if cfg.shipped_only else (["learned", "fixed"] if has_fixed else [shipped]) if cfg.fixed
            else ["learned"])
    out_policies = []
    group_by = (meta.get("features") or {}).get("group_by")
    learner = meta["learner"]["name"] + (f" by {group_by}" if group_by else "")
    for use in uses:
        how = objective({"lambda": lam, "floor": floor, "budget": budget})
        name = (f"learned policy, {how} ({learner} v{meta['version']:04d})" if use == "learned"
                else f"best fixed action on train, {how} (v{meta['version']:04d})")
        policy, _ = run_planner(pool, queries, out, planner_options={**cfg.planner_options, "policy": str(found),
                                                                     "use": use},
                                seed=cfg.seed, run_id=f"eval-{dataset}-{cfg.split}-{use}-{i}",
                                run_dir=f"{use}-run-{i}", kind=use, name=name + (" *shipped*" if use == shipped else ""))
        policy.info.update({"lambda": lam, "floor": floor, "budget": budget, "artifact": str(found),
                            "learner": meta["learner"]["name"],
                            "version": meta["version"], "shipped": use == shipped,
                            "selection": meta["training"].get("selection"),
                            "trained_on": [r["run_id"] for r in meta["training"]["runs"]]})
        if use == "fixed":
            policy.info["choice"] = (meta.get("fixed") or meta["learner"]).get("choice")
        out_policies.append(policy)
    return out_policies


def _fixed_cascade(pool, queries: pa.Table, out: Path, cfg: EvalConfig, dataset: str,
                   best: Policy | None, bounds: dict[str, float]) -> Policy | None:
    """Per task of the queries, the cascade most accurate on the first artifact's train logs
    among those costing no more there than the best single worker did on the task's train
    questions (`bounds`), run on these queries; None when no task has one.

    A task with no such cascade (its action set may hold none: every other worker costs more
    than a third of its most skilled one) plans its best single action on the same logs
    instead, and the row's name says so: left out of the plan, its queries were invalid
    plans counted as wrong, and a mixed table's row looked far worse than any cascade is.
    Chosen on the guarded figures training chooses on (`training.measured`'s guarded_accuracy
    and guarded_usd, where an action has unlogged queries), so a cascade logged on a few lucky
    queries of a run that is not a sweep is not picked for them."""
    from conductor.policy.artifact import find, read_meta

    found = find(pool, cfg.policies[0])
    measured = read_meta(found)["training"].get("measured") if found else None
    if best is None or not measured:
        return None
    choice: dict[str, str] = {}
    instead: dict[str, str] = {}  # task -> why it plans a single action
    for task in sorted(set(queries.column("task").to_pylist()), key=str):
        figures = {r["action"]: (r.get("guarded_accuracy", r["accuracy"]), r.get("guarded_usd", r["usd"]))
                   for r in measured.get(task) or []}
        top = lambda keys: max(keys, key=lambda a: (figures[a][0], -figures[a][1]))  # noqa: E731
        budget = bounds.get(task, best.info.get("chosen_usd") or best.usd_per_query)
        cascades = [a for a in figures if a.startswith("cascade:")]
        ok = [a for a in cascades if figures[a][1] <= budget]
        singles = [a for a in figures if a.startswith("single:")]
        if ok:
            choice[task] = top(ok)
        elif singles:
            choice[task], instead[task] = top(singles), ("no cascade within the best single's train cost"
                                                         if cascades else "no cascade in its action set")
        else:  # the training logs hold no plan of the task: the table's best single worker
            choice[task], instead[task] = f"single:{best.worker}", "not in the training logs: the best single"
    if not any(a.startswith("cascade:") for a in choice.values()):
        return None
    if len(choice) == 1:
        name = "best fixed cascade on train: " + next(iter(choice.values()))
    else:
        name = "best fixed cascade on train, per task: " + "; ".join(
            f"{t}: {a}" + (f" ({instead[t]})" if t in instead else "") for t, a in choice.items())
    policy, _ = run_planner(pool, queries, out, planner_options={**cfg.planner_options, "policy": "none",
                                                                 "action": choice},
                            seed=cfg.seed, run_id=f"eval-{dataset}-{cfg.split}-fixed-cascade",
                            run_dir="fixed-cascade-run", kind="fixed_cascade", name=name)
    policy.info.update({"lambda": None, "choice": choice, "instead": instead,
                        "bound_usd": {t: bounds.get(t, best.info.get("chosen_usd") or best.usd_per_query)
                                      for t in choice}})
    return policy


def _task_usd(matrix, select_ids: list[str], best: Policy) -> dict[str, float]:
    """Per task, the best single worker's USD per question of the task on the selection set:
    each task's cascades are bounded by the cost on that task, not by the mean over all tasks
    (on a mixed table cheap questions of one task made another's bound look low or high).
    One task: the figure the best single was chosen with."""
    rows = matrix.rows.filter(pl.col("question_id").is_in(select_ids))
    asked = dict(rows.select("question_id", "task").unique().group_by("task").len().iter_rows())
    if len(asked) <= 1:
        return {t: best.info.get("chosen_usd") or best.usd_per_query for t in asked}
    spent = dict(rows.filter(pl.col("worker") == best.worker).group_by("task").agg(pl.col("cost").sum())
                 .iter_rows())
    return {t: spent.get(t, 0.0) / n for t, n in asked.items()}


def _prompt_cut(rows: pl.DataFrame) -> dict[str, Any] | None:
    """The evaluated rows whose recorded prompt tokens exceed what a replayed call sends (the
    question's UTF-8 bytes + framing: a log's counts often include a system prompt or few-shot
    examples): how many, their recorded and charged prompt tokens (means), and how many of them
    are priced by tokens (no recorded cost_usd), whose cost the cut lowers. None: no row."""
    cut = rows.filter(pl.col("prompt_cut"))
    if not cut.height:
        return None
    return {"rows": cut.height, "of_rows": rows.height,
            "recorded_mean": cut.get_column("prompt_recorded").mean(),
            "charged_mean": cut.get_column("prompt_charged").mean(),
            "priced_rows": int((~cut.get_column("cost_recorded")).sum())}


def _best_by_grader(policies: list[Policy]) -> Policy | None:
    return next((p for p in policies if p.kind == "best_single" and p.info.get("chosen_by") == "grader"), None)


def comparisons(policies: list[Policy], best: Policy | None = None) -> list[dict[str, Any]]:
    """Per artifact (each version, by lambda, floor or budget): the shipped policy against the best single (accuracy)
    and against the best fixed action (the lambda's objective), on the same queries, with paired standard errors.
    `best`: the best single on the queries the artifacts ran on (default: the table's)."""
    best = best or _best_by_grader(policies)
    out = []
    ids = lambda p: (*objective_order(p.info), str(p.info.get("artifact")))  # noqa: E731
    for key in sorted({ids(p) for p in policies if p.kind in ("learned", "fixed")}):
        rows = {p.kind: p for p in policies if p.kind in ("learned", "fixed") and ids(p) == key}
        shipped = next((p for p in rows.values() if p.info.get("shipped")), None)
        kind = shipped.kind if shipped else None
        if shipped is None:  # --no-fixed on an artifact that ships its fixed action: only the learned one ran
            shipped = rows.get("learned") or next(iter(rows.values()))
            kind = f"{shipped.kind} (not shipped; the shipped fixed action was left out)"
        lam = key[2]
        row: dict[str, Any] = {"lambda": lam, "floor": shipped.info.get("floor"), "budget": shipped.info.get("budget"),
                               "version": shipped.info.get("version"), "artifact": shipped.info.get("artifact"),
                               "shipped": kind,
                               "accuracy": shipped.accuracy, "se": shipped.se, "usd": shipped.usd_per_query}
        if best is not None and best.usd_per_query:
            row["cost_share"] = shipped.usd_per_query / best.usd_per_query
            row["vs_best_single"] = paired(shipped, best)
        if "fixed" in rows:
            row["learned_vs_fixed"] = paired(rows["learned"], rows["fixed"], lam) if "learned" in rows else None
            row["shipped_vs_fixed"] = paired(shipped, rows["fixed"], lam)
            diff = row["shipped_vs_fixed"]
            row["within_one_se_of_fixed"] = None if diff is None else diff[0] >= -diff[1]
        out.append(row)
    return out


def check_target(t: Target, policies: list[Policy], best: Policy | None = None) -> dict[str, Any]:
    """Met when some shipped policy reaches the accuracy within the cost; else the closest, with its gap.
    `best`: the best single on the queries the policies ran on (default: the table's)."""
    subset = best is not None
    best = best or _best_by_grader(policies)
    if best is None or best.accuracy is None or not best.usd_per_query:
        return {"name": t.name, "met": None, "why": "no best single by our grader"}
    need, budget = best.accuracy + t.accuracy_delta, t.cost_share * best.usd_per_query
    shipped = [p for p in policies if p.info.get("shipped") and p.accuracy is not None]
    meeting = [p for p in shipped if p.accuracy >= need - 1e-12 and p.usd_per_query <= budget]
    within = [p for p in shipped if p.usd_per_query <= budget]
    pick = (max(meeting, key=lambda p: p.accuracy) if meeting else
            max(within, key=lambda p: p.accuracy) if within else min(shipped, key=lambda p: p.usd_per_query)
            if shipped else None)
    out = {"name": t.name, "met": bool(meeting), "need_accuracy": need, "budget_usd": budget,
           "queries": best.queries if subset else None}
    if pick is not None:
        out.update(policy=pick.name, lambda_=pick.info.get("lambda"), accuracy=pick.accuracy, se=pick.se,
                   usd=pick.usd_per_query, cost_share=pick.usd_per_query / best.usd_per_query,
                   accuracy_gap=pick.accuracy - need, vs_best_single=paired(pick, best))
    return out


def _cost_basis(meta: dict[str, Any]) -> str:
    if not meta["recorded_cost_rows"]:
        return "estimated tokens x prices"
    if meta["recorded_cost_rows"] == meta["rows"]:
        return "recorded cost_usd"
    return "recorded cost_usd where present, else tokens x prices"


def _subset_reference(ps: list[Policy]) -> dict[str, Any] | None:
    """The table policies on the planner's subset, by our grader (by the labels when nothing has a reference)."""
    by = "grader" if any(p.kind == "oracle" and p.info["correct_by"] == "grader" for p in ps) else "label"
    best = next((p for p in ps if p.kind == "best_single" and p.info["chosen_by"] == by), None)
    oracle = next((p for p in ps if p.kind == "oracle" and p.info["correct_by"] == by), None)
    if best is None or oracle is None:  # nothing on the subset to judge by
        return None
    rnd = next(p for p in ps if p.kind == "random")
    if by == "label":
        return {"by": by, "best_single": best.worker, "best_single_accuracy": best.accuracy_labels,
                "best_single_usd": best.usd_per_query, "oracle_accuracy": oracle.accuracy_labels,
                "oracle_usd": oracle.usd_per_query, "random_accuracy": rnd.accuracy_labels,
                "random_usd": rnd.usd_per_query}
    return {"by": by, "best_single": best.worker, "best_single_accuracy": best.accuracy,
            "best_single_usd": best.usd_per_query,
            "oracle_accuracy": oracle.accuracy, "oracle_usd": oracle.usd_per_query,
            "random_accuracy": rnd.accuracy, "random_usd": rnd.usd_per_query}


__all__ = ["EvalConfig", "EvalReport", "Policy", "Target", "evaluate"]
