"""The evaluation report: a Markdown file and an accuracy-against-cost chart."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from conductor.evaluation.policies import Policy
from conductor.tokens import MESSAGE_FRAMING_BOUND

_HEADLINE = ("learned", "fixed", "fixed_cascade", "planner", "oracle", "best_single", "random")


def headline(policies: Sequence[Policy]) -> list[Policy]:
    """The policies of the summary table: learned policies (by lambda), the planner's prior,
    then oracles, best singles, random."""
    return sorted((p for p in policies if p.kind in _HEADLINE), key=lambda p: _HEADLINE.index(p.kind))


def policy_table(policies: Sequence[Policy]) -> str:
    lines = ["| policy | accuracy (our grader) | ± SE | accuracy (labels) | USD / query | calls / query | "
             "tokens / query |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for p in policies:
        lines.append(f"| {p.name} | {_f(p.accuracy, 3)} | {_f(p.se, 3)} | {_f(p.accuracy_labels, 3)} | "
                     f"{_usd(p.usd_per_query)} | {p.calls_per_query:.2f} | {p.tokens_per_query:,.0f} |")
    return "\n".join(lines)


def singles_table(policies: Sequence[Policy]) -> str:
    singles = sorted((p for p in policies if p.kind == "single"), key=lambda p: (-(p.accuracy or 0), p.name))
    lines = ["| worker | accuracy (our grader) | accuracy (labels) | recorded | USD / query | tokens / query |",
             "|---|---:|---:|---:|---:|---:|"]
    for p in singles:
        lines.append(f"| {p.name} | {_f(p.accuracy, 3)} | {_f(p.accuracy_labels, 3)} | {_f(p.coverage, 3)} | "
                     f"{_usd(p.usd_per_query)} | {p.tokens_per_query:,.0f} |")
    return "\n".join(lines)


def markdown(meta: dict[str, Any], policies: Sequence[Policy], chart_name: str | None) -> str:
    n = meta["queries"]
    parts = [
        f"# Evaluation: {meta['dataset']}, split {meta['split']} ({n} queries)",
        "",
        f"- pool: `{meta['pool']}` ({meta['workers']} recorded models)",
        f"- queries: `{meta['queries_path']}`",
        f"- table: `{meta['table']}`",
        *_accuracy_lines(meta),
        *_cost_lines(meta),
        *_shared_lines(meta),
        f"- best single worker: chosen on {meta['selection']}.",
        "- oracle: the cheapest correct recorded response per question; none correct: no call, no cost.",
        "- uniform random: the exact expected value of a worker drawn uniformly among those that "
        "recorded the question.",
    ]
    if meta.get("planner"):
        f = meta["planner"]
        shapes = ", ".join(f"{k} {v}" for k, v in sorted(f["shapes"].items()))
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(f["server_outcomes"].items())) or "none"
        parts.append(f"- embedded planner: run through the pipeline (plan, execute, grade) against the replay "
                     f"server on {f['queries']} of the {n} queries; plan shapes: {shapes}; server: {outcomes}; "
                     f"{f['wall_time_s']:.0f} s; run `{f.get('run_id', '')}` in `{f['run']}`.")
        if f.get("subset_reference"):
            parts.append(_subset_line(f["subset_reference"], f["queries"]))
    else:
        parts.append("- embedded planner: not run (--no-planner).")
    learned = [p for p in policies if p.kind == "learned"]
    if learned:
        parts.append(f"- learned policies: {len(learned)} artifact(s) of `conductor policy train`, each planning "
                     f"greedily (K=1) through the pipeline against the replay server on "
                     f"{learned[0].queries} of the {n} queries; the chart joins those of a lambda sweep in "
                     f"order of lambda. Each artifact also holds the best fixed action on its train logs "
                     f"(*best fixed action*: the best reward at its lambda, or with a floor the cheapest action "
                     f"reaching the best single's train accuracy + floor, or with a budget the most accurate action "
                     f"within that share of the best single's train cost), run the same way; training ships the "
                     f"learned policy only when it beat the fixed action on held-back train queries by more than "
                     f"its margin of paired standard errors (*shipped*). ± SE: the accuracy's standard error; comparisons below are paired (the "
                     f"same queries on both sides).")
        if meta.get("learned_subset_reference"):
            parts.append(_subset_line(meta["learned_subset_reference"], learned[0].queries, random=False))
        parts += _cascade_lines(policies)
    parts += ["", "## Policies", "", policy_table(headline(policies)), ""]
    if chart_name:
        parts += [f"![accuracy against cost]({chart_name})", ""]
    if meta.get("chart_error"):
        parts += [f"The chart could not be drawn ({meta['chart_error']}); every figure is in the tables.", ""]
    elif meta.get("off_chart"):
        lo, hi = DRAWABLE_USD
        shown = "; ".join(f"{o['name']} ({_usd(o['usd'])})" for o in meta["off_chart"])
        parts += [f"Not on the chart, whose log axis shows costs from ${lo:g} to ${hi:g} per query (never $0): "
                  f"{shown}.", ""]
    if learned:
        sub = meta.get("learned_subset_reference") or (meta.get("planner") or {}).get("subset_reference")
        parts += ["## Learned policy: the lambda sweep", "", sweep_table(learned, policies, sub), ""]
    if meta.get("comparisons"):
        parts += ["## The shipped policy against the best single and the best fixed action", "",
                  comparison_table(meta["comparisons"]), ""]
    if meta.get("targets"):
        parts += ["## Targets", "", *target_lines(meta["targets"]), ""]
    parts += ["## Every single worker", "", singles_table(policies), ""]
    parts += [f"Grading took {meta['grading_s']:.1f} s; the whole evaluation {meta['wall_time_s']:.1f} s.", ""]
    return "\n".join(parts)


def _cascade_lines(policies: Sequence[Policy]) -> list[str]:
    """What the best fixed cascade row is, and which tasks plan a single action in it instead."""
    p = next((p for p in policies if p.kind == "fixed_cascade"), None)
    if p is None:
        return []
    line = ("- *best fixed cascade on train*: per task, the cascade most accurate on the first artifact's train logs "
            "among those that cost no more there than the best single worker (chosen by our grader) did on the "
            "task's train questions, run the same way")
    instead = p.info.get("instead") or {}
    if instead:
        line += ("; a task with no such cascade plans its best single action on the same logs instead, so the row "
                 f"is over all its {p.queries} queries: " + "; ".join(
                     f"{t}: `{p.info['choice'][t]}` ({why})" for t, why in instead.items()))
    return [line + "."]


def _accuracy_lines(meta: dict[str, Any]) -> list[str]:
    """What each accuracy column is measured by, on which queries: the two are never compared."""
    n, g = meta["queries"], meta.get("graded_queries", meta["queries"])
    tasks = meta.get("tasks") or {}
    lines = []
    if len(tasks) > 1:
        lines.append("- tasks: " + ", ".join(f"{t} {k}" for t, k in tasks.items())
                     + "; every recorded response is graded with its own question's task.")
    nl = meta.get("labelled_queries", n)
    over = "all the queries" if nl == n else f"the {nl} of the {n} queries whose rows all have one"
    left = ("" if nl == n else f" {meta.get('unlabelled_rows')} row(s) have no label: their {n - nl} queries "
                               f"are left out of it, never counted as wrong.")
    labels = ("*accuracy (labels)* judges the same recorded responses by the table's own `correct` label "
              f"instead, over {over} (the shared README's reference figures use the labels)"
              + (f";{left} A" if left else "; a") + " policy's name says which of the two chose it.")
    if nl == 0:
        labels = (f"No query has a `correct` label on every row ({meta.get('unlabelled_rows')} row(s) with no "
                  f"label), so there is no *accuracy (labels)*: a missing label is never counted as wrong.")
    if g == 0:
        lines.append("- accuracy: no query has a reference, so `conductor.grading` can judge nothing: every "
                     "figure here comes from the recorded labels (*accuracy (labels)*), and policies that run "
                     "through the pipeline (the planner, learned policies) have no accuracy. " + labels)
        return lines + _unrecorded_lines(meta)
    where = "" if g == n else (f" It judges only the {g} of the {n} queries that have a reference; its "
                               f"accuracy is over those {g}.")
    agreement = meta.get("agreement")
    agrees = (f" The two agree on {agreement:.1%} of the {meta.get('graded_rows', meta['rows'])} rows our grader "
              f"judges here." if agreement is not None else "")
    lines.append("- *accuracy (our grader)*: graded by `conductor.grading` (the grader the pipeline's rewards use, "
                 f"the only one that can judge a vote's output).{where} " + labels + agrees)
    return lines + _unrecorded_lines(meta)


def _unrecorded_lines(meta: dict[str, Any]) -> list[str]:
    """Queries no worker of the pool recorded: judged all the same, and wrong for every policy."""
    k = meta.get("unrecorded_queries") or 0
    if not k:
        return []
    return [f"- {k} of the {meta['queries']} queries were recorded by no worker of the pool: every policy counts "
            f"them as wrong, by our grader and by the labels alike, and spends nothing and makes no call on them, "
            f"as the pipeline's runs count them."]


def _shared_lines(meta: dict[str, Any]) -> list[str]:
    """Ids recorded under one question text: the pipeline and the table policies see different rows."""
    groups = meta.get("shared_texts") or []
    if not groups:
        return []
    shown = "; ".join(", ".join(g) for g in groups[:3]) + (f" and {len(groups) - 3} more" if len(groups) > 3 else "")
    return [f"- {len(groups)} question text(s) are recorded under more than one id ({shown}), with one reference "
            f"and task: the replay server sees only the text, so a plan for any of those ids gets the first id's "
            f"recorded answers (a cache hit after the first), while the table policies use each id's own rows."]


def _cost_lines(meta: dict[str, Any]) -> list[str]:
    rows, recorded = meta["rows"], meta.get("recorded_cost_rows", 0)
    if recorded == rows and rows:
        text = (f"- cost: the recorded `cost_usd` of every row ({rows} rows), which the replay server also "
                "charges in the pipeline.")
    elif recorded:
        text = (f"- cost: the recorded `cost_usd` where a row has one ({recorded} of {rows} rows), else tokens "
                "times the pool's prices; the pipeline charges the same.")
    else:
        text = "- cost: tokens times the pool's prices."
    text += (" Tokens: recorded counts where the table has them, else characters / 4 of the question and "
             "of the response (rounded).")
    cut = prompt_cut_text(meta)
    if cut:
        text += f" {cut}"
    return [text + " A question a worker never answered counts as wrong and costs nothing."]


def prompt_cut_text(meta: dict[str, Any]) -> str | None:
    """Recorded prompt tokens charged at the question's size, with the numbers (report and stdout)."""
    c = meta.get("prompt_tokens_cut")
    if not c:
        return None
    priced = c["priced_rows"]
    effect = (f"; {priced} of them have no recorded cost_usd and are priced on the charged count" if priced else
              "; all of them have a recorded cost_usd, which is charged as recorded: only tokens per query shrink")
    return (f"Recorded prompt tokens above the question's UTF-8 bytes + {MESSAGE_FRAMING_BOUND} (what a replayed "
            f"call sends: the question alone, not a few-shot prefix or system prompt the log counted) are charged "
            f"at that bound, as the pipeline charges them: {c['rows']:,} of {c['of_rows']:,} rows, "
            f"{c['recorded_mean']:,.0f} recorded prompt tokens on average, charged {c['charged_mean']:,.0f}{effect}.")


def objective(info: dict[str, Any]) -> str:
    """How an artifact was trained, in a few characters: `λ 30`; `floor +0 (λ 137)` for one
    whose fixed action is the cheapest reaching the best single's train accuracy + floor;
    `budget 15% (λ 40)` for the most accurate within that share of the best single's cost."""
    lam = f"λ {info.get('lambda') or 0:.3g}"
    floor, budget = info.get("floor"), info.get("budget")
    if budget is not None:
        return f"budget {budget:.0%} ({lam})"
    return lam if floor is None else f"floor {floor:+g} ({lam})"


def objective_order(info: dict[str, Any]) -> tuple:
    """Sorts artifacts: lambdas, then floors, then budgets, each by its value."""
    floor, budget = info.get("floor"), info.get("budget")
    kind, value = (2, budget) if budget is not None else (1, floor) if floor is not None else (0, 0.0)
    return kind, value, info.get("lambda") or 0.0


def sweep_table(learned: Sequence[Policy], policies: Sequence[Policy], subset: dict | None = None) -> str:
    """One row per lambda: accuracy and cost, against the best single worker chosen by our grader
    (on the same queries: `subset`, the reference figures of a --planner-limit subset)."""
    best = next((p for p in policies if p.kind == "best_single" and p.info.get("chosen_by") == "grader"), None)
    if best is not None and subset and subset.get("by") == "grader":
        from dataclasses import replace

        best = replace(best, accuracy=subset["best_single_accuracy"], usd_per_query=subset["best_single_usd"],
                       queries=learned[0].queries)
    lines = ["| objective | accuracy | USD / query | cost vs best single | calls / query | plan shapes | top action |",
             "|---:|---:|---:|---:|---:|---|---|"]
    twice = _shared_objectives([p.info for p in learned])
    for p in sorted(learned, key=lambda p: objective_order(p.info)):
        ratio = (f"{p.usd_per_query / best.usd_per_query:.0%}"
                 if best and best.usd_per_query and p.usd_per_query is not None else "—")
        shapes = ", ".join(f"{k} {v}" for k, v in sorted(p.info.get("shapes", {}).items()))
        top = next(iter(p.info.get("most_used_actions", {})), "—")
        lines.append(f"| {_objective_of(p.info, twice)} | {_f(p.accuracy, 3)} | {_usd(p.usd_per_query)} | {ratio} | "
                     f"{p.calls_per_query:.2f} | {shapes} | `{top}` |")
    if best:
        on = f" on the same {best.queries} queries" if subset and subset.get("by") == "grader" else ""
        lines.append(f"\nBest single worker (chosen by our grader): {best.worker}, {_f(best.accuracy, 3)} at "
                     f"{_usd(best.usd_per_query)}{on}.")
    return "\n".join(lines)


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| objective | ships | accuracy ± SE | USD / query | cost vs best single | accuracy − best single "
             "(paired SE) | reward: shipped − best fixed (paired SE) | learned − best fixed |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    twice = _shared_objectives(rows)
    for r in rows:
        lines.append(f"| {_objective_of(r, twice)} | {r['shipped']} | {_f(r['accuracy'], 3)} ± {_f(r['se'], 3)} | "
                     f"{_usd(r['usd'])} | {_pct(r.get('cost_share'))} | {_pm(r.get('vs_best_single'))} | "
                     f"{_pm(r.get('shipped_vs_fixed'))} | {_pm(r.get('learned_vs_fixed'))} |")
    return "\n".join(lines)


def _shared_objectives(infos: Sequence[dict[str, Any]]) -> set[str]:
    """Objectives held by more than one artifact: their rows need the artifact's version to be told apart."""
    seen: dict[str, set] = {}
    for i in infos:
        seen.setdefault(objective(i), set()).add(i.get("artifact"))
    return {o for o, arts in seen.items() if len(arts) > 1}


def _objective_of(info: dict[str, Any], twice: set[str]) -> str:
    o = objective(info)
    return f"{o}, v{info['version']:04d}" if o in twice and isinstance(info.get("version"), int) else o


def target_lines(targets: Sequence[dict[str, Any]]) -> list[str]:
    out = []
    for t in targets:
        if t.get("met") is None:
            out.append(f"- {t['name']}: not checked ({t.get('why')}).")
            continue
        verdict = "**met**" if t["met"] else "**not met**"
        if "accuracy" not in t:
            out.append(f"- {t['name']}: {verdict} (no shipped policy).")
            continue
        over = (f"; the best single on the same {t['queries']} queries the policies ran on" if t.get("queries")
                else "")
        out.append(f"- {t['name']} (needs {t['need_accuracy']:.4f} at ≤ {_usd(t['budget_usd'])}{over}): {verdict}. "
                   f"{'Meets it' if t['met'] else 'Closest'}: {t['policy']}, {t['accuracy']:.4f} ± {t['se']:.4f} at "
                   f"{_usd(t['usd'])} ({t['cost_share']:.1%} of the best single's cost); accuracy gap "
                   f"{t['accuracy_gap']:+.4f}; against the best single on the same queries "
                   f"{_pm(t.get('vs_best_single'))}.")
    return out


def _pm(pair: Any) -> str:
    return "—" if not pair else f"{pair[0]:+.4f} ({pair[1]:.4f})"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def chart(policies: Sequence[Policy], path: Path, title: str, by: str = "grader",
          cost_basis: str = "estimated tokens x list prices") -> Path:
    """Accuracy (our grader, or with `by="labels"` the labels') against mean USD per query,
    log x, every policy labeled. One kind of accuracy per chart: the two are never mixed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import Bbox

    fig, ax = plt.subplots(figsize=(10, 7), dpi=100)
    policies = [_plotted(p, by) for p in policies]
    plotted = [p for p in policies if p.accuracy is not None and _drawable(p.usd_per_query)]
    for kind, (marker, color, size, legend) in _STYLES.items():
        ps = [p for p in plotted if p.kind == kind]
        if ps:
            ax.scatter([p.usd_per_query for p in ps], [p.accuracy for p in ps], marker=marker, c=color, s=size,
                       label=legend, zorder=2 if kind == "single" else 3, edgecolors="none")
    sweep = sorted((p for p in plotted if p.kind == "learned" and objective_order(p.info)[0] == 0),
                   key=lambda p: p.info.get("lambda", 0.0))
    if len(sweep) > 1:
        ax.plot([p.usd_per_query for p in sweep], [p.accuracy for p in sweep], color=_STYLES["learned"][1],
                linewidth=1.2, alpha=0.8, zorder=3)
    ax.set_xscale("log")
    xs = [p.usd_per_query for p in plotted] or [1e-4]
    ax.set_xlim(min(xs) / 1.6, max(xs) * 2.2)  # room for the labels of the outermost points
    ax.set_xlabel(f"mean USD per query ({cost_basis}, log scale)")
    ax.set_ylabel("accuracy (conductor.grading)" if by == "grader" else "accuracy (recorded labels)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    if ax.get_legend_handles_labels()[0]:  # nothing drawn (every policy at $0): no legend, no matplotlib warning
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    # Labels: the named policies first, then the single workers, each at the first
    # nearby offset where it overlaps no label placed before it.
    order = sorted(plotted, key=lambda p: p.kind == "single")
    twice = {k: _shared_objectives([p.info for p in plotted if p.kind == k]) for k in ("learned", "fixed")}
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    placed = []  # label boxes so far, and a small box around every marker
    for p in plotted:
        x, y = ax.transData.transform((p.usd_per_query, p.accuracy))
        placed.append(Bbox.from_extents(x - 3, y - 3, x + 3, y + 3))
    for p in order:
        special = p.kind != "single"
        color = _STYLES[p.kind][1] if special else "#555555"
        text = _short(p, twice.get(p.kind, set()))
        for dx, dy in _OFFSETS:
            ann = ax.annotate(text, (p.usd_per_query, p.accuracy), textcoords="offset points", xytext=(dx, dy),
                              fontsize=7.5 if special else 5.5, color=color, zorder=4,
                              ha="left" if dx >= 0 else "right", va="center")
            box = ann.get_window_extent(renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(b) for b in placed):
                break
            ann.remove()
        else:
            ann = ax.annotate(text, (p.usd_per_query, p.accuracy), textcoords="offset points", xytext=(4, 0),
                              fontsize=7.5 if special else 5.5, color=color, zorder=4, va="center")
            box = ann.get_window_extent(renderer)
        placed.append(box)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


# The costs the log axis can show: beyond, matplotlib's ticks overflow (a price of 1e300 per
# million tokens). A cost outside (and $0, which a log axis has no place for) is left off the
# chart and named in the report (`off_chart`).
DRAWABLE_USD = (1e-100, 1e100)


def _drawable(usd: float | None) -> bool:
    return usd is not None and DRAWABLE_USD[0] <= usd <= DRAWABLE_USD[1]  # False for NaN


def off_chart(policies: Sequence[Policy], by: str = "grader") -> list[dict[str, Any]]:
    """The policies the chart has an accuracy for but no place on its cost axis: name and cost."""
    shown = [_plotted(p, by) for p in policies]
    return [{"name": p.name, "usd": p.usd_per_query} for p in shown
            if p.accuracy is not None and p.usd_per_query is not None and not _drawable(p.usd_per_query)]


def placeholder(path: Path, reason: str) -> Path | None:
    """When the chart cannot be drawn: an image that says so (None, and no stale chart, if even that fails)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(8, 2), dpi=100)
        fig.text(0.5, 0.5, f"chart not drawn: {reason}"[:200], ha="center", va="center", fontsize=9, wrap=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
        return path
    except Exception:  # noqa: BLE001 - the report is written without any chart
        path.unlink(missing_ok=True)
        return None


def _plotted(p: Policy, by: str) -> Policy:
    """The policy with the chart's accuracy in `accuracy` (the labels' when `by` says so)."""
    if by == "grader":
        return p
    from dataclasses import replace

    return replace(p, accuracy=p.accuracy_labels)


_STYLES = {  # kind -> marker, color, size, legend
    "single": ("o", "#8c8c8c", 16, "single worker"),
    "best_single": ("D", "#1f77b4", 40, "best single worker"),
    "oracle": ("*", "#2ca02c", 120, "per-question oracle"),
    "random": ("s", "#ff7f0e", 40, "uniform random (expected)"),
    "planner": ("P", "#d62728", 90, "embedded planner (prior)"),
    "learned": ("o", "#9467bd", 55, "learned policy (lambda sweep)"),
    "fixed": ("v", "#8c564b", 50, "best fixed action on train (per lambda)"),
    "fixed_cascade": ("X", "#e377c2", 90, "best fixed cascade on train"),
}
_OFFSETS = [(5, 0), (-5, 0), (5, 7), (5, -7), (-5, 7), (-5, -7), (5, 14), (5, -14), (-5, 14), (-5, -14),
            (5, 21), (5, -21)]


def _short(p: Policy, twice: set[str] = frozenset()) -> str:
    """The chart label; `twice`: objectives more than one artifact holds, labeled with their version."""
    if p.kind == "best_single":
        return f"best single ({'labels' if p.info.get('chosen_by') == 'label' else 'grader'})"
    if p.kind == "oracle":
        return f"oracle ({'labels' if p.info.get('correct_by') == 'label' else 'grader'})"
    if p.kind == "planner":
        return "embedded planner (prior)"
    if p.kind == "learned":
        return f"learned {_objective_of(p.info, twice)}" + (" (shipped)" if p.info.get("shipped") else "")
    if p.kind == "fixed":
        return f"fixed {_objective_of(p.info, twice)}" + (" (shipped)" if p.info.get("shipped") else "")
    if p.kind == "fixed_cascade":  # some tasks may plan a single action instead (the name says which)
        return "best fixed cascade" + (" (or single, per task)" if p.info.get("instead") else "")
    if p.kind == "random":
        return "uniform random"
    return p.name[:30]


def _f(x: float | None, digits: int) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _subset_line(r: dict, queries: int, random: bool = True) -> str:
    """The reference figures on the subset a planner or policy was run on."""
    rand = (f", uniform random {r['random_accuracy']:.3f} at {_usd(r['random_usd'])}" if random else "")
    return (f"  On the same {queries} queries: best single ({r['best_single']}) "
            f"{r['best_single_accuracy']:.3f} at {_usd(r['best_single_usd'])}, oracle "
            f"{r['oracle_accuracy']:.3f} at {_usd(r['oracle_usd'])}{rand} "
            f"({'labels' if r.get('by') == 'label' else 'our grader'}).")


def _usd(x: float | None) -> str:
    """Three significant digits, in scientific notation only from a million dollars: $0.00144,
    $0.0000240, $1.9e+296 (a price far off), $inf."""
    if x is None:
        return "—"
    if math.isnan(x):
        return "—"
    if x <= 0:
        return "$0"
    if x >= 1e6:  # a million dollars a query or more (a price far off, or infinite): its order of magnitude
        return f"${x:.3g}" if math.isfinite(x) else "$inf"
    return f"${x:.{max(0, 2 - math.floor(math.log10(x)))}f}"
