"""What the commands print about a finished run or evaluation, in one place so every
command lays its summary out the same way."""

from __future__ import annotations

from typing import Any


def key_values(rows: list[tuple[str, Any]]) -> str:
    """Two aligned columns: name, value."""
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_summary(s: dict) -> str:
    """`conductor run`, `conductor policy rollouts` and the demo: one run's summary."""
    def money(x):
        return "unknown" if x is None else f"${x:.6f}"

    def num(x, fmt="{:.1f}"):
        return "n/a" if x is None else fmt.format(x)

    rows = [
        ("run", s["run_id"] + ("  (resumed)" if s.get("resumed") else "")),
        ("queries", s["queries"]),
        ("plans", s["plans"]),
        ("valid plans", f"{s['valid_plans']} ({s['valid_plans'] / max(s['plans'], 1):.1%})"),
        ("plan statuses", ", ".join(f"{k} {v}" for k, v in sorted(s["statuses"].items()))),
        ("calls", f"{s['calls']}  (cache hits {s['cache_hits']})"),
        ("accuracy", "n/a (nothing graded)" if s["accuracy"] is None else f"{s['accuracy']:.3f} over {s['graded']} graded plans"),
        ("cost", _cost(s, money)
                 + (f" (planning {money(s['planning_cost_usd'])})" if s.get("planning_cost_usd") else "")
                 + (f"  ({s['plans_without_price']} plan(s) with unknown price: only their priced calls are "
                    f"counted)" if s["plans_without_price"] else "")
                 + (f"  ({s['planning_calls_without_price']} planning call(s) with unknown price: give the "
                    f"planner's model a price)" if s.get("planning_calls_without_price") else "")),
        ("tokens per query", num(s["tokens_per_query"])),
        ("wall time", num(s["wall_time_s"], "{:.1f} s")),
    ]
    for cap in s.get("spend", []):
        if cap["limit_usd"] is not None:
            rows.append((f"budget {cap['cap']}", f"${cap['spent_usd']:.6f} of ${cap['limit_usd']:.6f}"))
    rows += _lost_in_flight(s)
    rows += [("outputs", s["outputs"]), ("catalog", s.get("catalog", ""))]
    return key_values(rows)


def _cost(s: dict[str, Any], money: Any) -> str:
    """The run's cost; with calls of unknown price it is what the priced calls cost, so a lower
    bound, and says so: a bare total read as the whole cost."""
    partial = "at least " if s["plans_without_price"] or s.get("planning_calls_without_price") else ""
    per = s["cost_per_query_usd"]
    return f"{partial}{money(s['cost_usd'])} total, {partial if per is not None else ''}{money(per)} per query"


def _lost_in_flight(s: dict[str, Any]) -> list[tuple[str, str]]:
    lost = s.get("lost_in_flight") or {}
    if not lost.get("calls"):
        return []
    unpriced = f", {lost['unpriced_calls']} of them with no known price" if lost.get("unpriced_calls") else ""
    return [("lost in flight", f"{lost['calls']} call(s) sent whose answers never came back (a killed process's, "
                               f"cut off by timeout_s, or in a batch that could not be checked; the provider may "
                               f"have billed them): up to "
                               f"${lost['reserved_usd']:.6f} at their worst case{unpriced}; budgets count "
                               f"them at that, cost does not")]


def job_summary(s: dict[str, Any]) -> str:
    """`conductor job run`: one enrichment run's summary."""
    m = s["metrics"]
    stopped = s["statuses"].get("budget_exhausted", 0)  # rows to compute that a budget stopped (not in computed)
    unpriced = s.get("unpriced_rows") or 0  # never a silent $0: their cost is unknown, not in the figure
    rows = [("job", s["job"]),
            ("run", s["run_id"] + ("  (complete already: nothing executed, nothing written)" if s.get("kept") else "")
             + _resumed(s.get("resumed_kept"))),
            ("rows", f"{s['rows']}  (computed {s['computed']}, "
                     + (f"stopped by a budget {stopped}, " if stopped else "") + f"reused {s['reused']} at $0)"),
            ("valid", f"{s['valid']} ({m['valid_share']:.1%})"),
            ("statuses", ", ".join(f"{k} {v}" for k, v in sorted(s["statuses"].items()))),
            ("calls", s["calls"]),
            ("cost", f"${s['cost_usd']:.6f}" + (f"  ({unpriced} row(s) with unknown price)" if unpriced else ""))]
    if m.get("overall") is not None:
        rows.append(("overall score", f"{m['overall']:.3f} over {m['scored_rows']} rows with references"))
    for name, f in m["fields"].items():
        parts = [f"null {f['null_share']:.1%}" if f.get("null_share") is not None else "no valid record"]
        if f.get("accuracy") is not None:
            parts.insert(0, f"accuracy {f['accuracy']:.3f}" + "".join(
                f", {k} {f[k]:.3f}" for k in ("em", "f1", "jaccard") if f.get(k) is not None))
        if f.get("mean_confidence") is not None:
            parts.append(f"confidence {f['mean_confidence']:.3f}")
        rows.append((f"  {name}", "; ".join(parts)))
    if m.get("judge"):
        j = m["judge"]
        left = s.get("judge_budget_exhausted") or 0
        rows.append(("judge", (f"mean score {j['mean_score']:.3f} over {j['judged_rows']} rows without references"
                               f" (${s.get('judge_cost_usd') or 0:.6f})" if j["mean_score"] is not None
                               else "no row judged")
                     + (f"; {left} record(s) the budget left unjudged or not yet rescored" if left else "")))
    for a in s.get("abandoned_runs") or ():
        lost = a.get("lost_in_flight") or {}
        rows.append(("abandoned", f"interrupted run {a['run_id']}: ${a['cost_usd']:.6f} for {a['calls']} calls paid "
                                  f"there" + (f", and {lost['calls']} sent when it was killed whose answers were never "
                                              f"recorded (up to ${lost['reserved_usd']:.6f})"
                                              if lost.get("calls") else "")
                     + (f"; its batches in flight ({', '.join(a['batches_in_flight'])}) were handed to this run: "
                        f"the rows it asks again are answered from them, paid once (here)"
                        if a.get("batches_in_flight") else "")
                     + " (status abandoned; this run reused its answers from the cache)"))
    rows += _lost_in_flight(s)
    rows += [("wall time", f"{s['wall_time_s']:.1f} s"), ("records", s["records_path"]),
             ("catalog", f"{s.get('catalog', '')} (view {s['job']})")]
    out = key_values(rows)
    if s.get("failures"):
        out += "\n\nrows without a valid record (a rerun retries them):\n" + "\n".join(
            f"  {f['rows']} {f['status']}: {f['error']}" for f in s["failures"])
        if (rest := s.get("failures_not_shown") or {}).get("rows"):
            out += (f"\n  ... and {rest['rows']} more row(s) under {rest['groups']} other cause(s): see the status "
                    f"and error columns of {s['records_path']}")
    return out


def _resumed(r: dict[str, Any] | None) -> str:
    """A job run that continued an interrupted one says so, as `conductor run` marks `(resumed)`."""
    if not r:
        return ""
    return (f"  (resumed: {r['calls']} call(s) answered before it was interrupted, ${r['cost_usd']:.6f}, kept "
            f"and counted below)")


def eval_report(report: Any, *, learned: bool = False) -> str:
    """`conductor eval` and `conductor policy eval`: the headline table and where the report is.
    With learned policies, the comparisons and targets follow the table."""
    from conductor.evaluation.report import comparison_table, headline, policy_table, target_lines

    m = report.meta
    if learned:
        head = f"{m['dataset']}, split {m['split']}: {m['queries']} queries, {m['workers']} workers\n"
    else:
        agrees = _agreement(m)
        if m.get("unlabelled_rows"):  # a missing label is left out, never counted as wrong
            agrees += (f"; {m['unlabelled_rows']} row(s) with no label: {m['queries'] - m['labelled_queries']} "
                       f"queries left out of accuracy (labels)")
        if m.get("unrecorded_queries"):  # judged all the same: wrong for every policy
            agrees += (f"; {m['unrecorded_queries']} queries recorded by no worker of the pool, "
                       f"wrong for every policy")
        tasks = ", ".join(f"{t} {k}" for t, k in m["tasks"].items())
        head = (f"{m['dataset']}, split {m['split']}: {m['queries']} queries, {m['workers']} workers "
                f"(tasks: {tasks}; {agrees}; recorded cost_usd on {m['recorded_cost_rows']} of {m['rows']} rows)\n")
    lines = [head, policy_table(headline(report.policies))]
    if learned:
        if m.get("comparisons"):
            lines.append("\n" + comparison_table(m["comparisons"]))
        lines += target_lines(m.get("targets") or [])
    drawn = (f"{report.chart_path}" if not m.get("chart_error") else
             f"not drawn ({m['chart_error']})" + (f"; {report.chart_path} says so" if report.chart_path else ""))
    lines.append(f"\nreport {report.report_path}\nchart  {drawn}\ndata   {report.json_path}")
    return "\n".join(lines)


def _agreement(m: dict[str, Any]) -> str:
    """How our grader compares with the labels. With none compared, says why, truthfully: labelled
    rows may well exist, as the labels' figures leave out every query with an unlabelled row."""
    if m["agreement"] is not None:
        return f"grader agrees with the labels on {m['agreement']:.1%} of {m['graded_rows']} rows"
    if not m.get("graded_queries", 1):
        return "no reference: accuracy from the recorded labels only"
    if not m.get("labelled_queries"):
        labelled = m["rows"] - (m.get("unlabelled_rows") or 0)
        return (f"no query has a label on every row ({labelled} row(s) labelled), so nothing is compared "
                f"with the labels")
    return "no query with a label on every row has a reference, so nothing is compared with the labels"
