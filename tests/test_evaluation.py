"""`conductor eval` on the shared replay tables: it reproduces the shared README's
reference figures, runs the embedded planner through the real pipeline, and writes
the report (Markdown, JSON, chart); the Dagster asset carries the same report."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from dagster import DagsterInstance, materialize

from conductor.cli import main as cli_main
from conductor.errors import ConductorError
from conductor.evaluation import EvalConfig, evaluate
from conductor.replay.tables import split_of
from tests.conftest import REPLAY

# slow: evaluations run the planner through the pipeline against a replay server
pytestmark = pytest.mark.slow

needs_replay = pytest.mark.skipif(
    not REPLAY.is_dir(), reason=f"shared replay data not found at {REPLAY} (set CONDUCTOR_REPLAY_DIR to its folder)")

PNG = b"\x89PNG\r\n\x1a\n"
PLANNER_QUERIES = 200


def _files(d, dataset):
    pool, queries = d / f"replay-{dataset}.yaml", d / f"{dataset}.parquet"
    assert cli_main(["replay", "pool", "--dataset", dataset, "--replay-dir", str(REPLAY), "--out", str(pool)]) == 0
    assert cli_main(["replay", "queries", "--dataset", dataset, "--replay-dir", str(REPLAY), "--out", str(queries)]) == 0
    return pool, queries


@pytest.fixture(scope="module")
def gsm_report(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval-gsm8k")
    pool, queries = _files(d, "gsm8k")
    report = evaluate(EvalConfig(pool=pool, queries=queries, out=d / "report", planner_limit=PLANNER_QUERIES))
    return report, d


@needs_replay
def test_eval_reproduces_the_reference_figures_on_gsm8k(gsm_report):
    report, _ = gsm_report
    assert report.meta["queries"] == 1319 and report.meta["workers"] == 42  # the full file, every model
    # The reference figures judge responses by the recorded labels.
    best = report.find("best_single", "label")
    assert best.worker == "gpt-4o-2024-08-06"
    assert best.accuracy_labels == pytest.approx(0.962, abs=0.002)
    assert best.usd_per_query == pytest.approx(0.00144, rel=0.02)
    oracle = report.find("oracle", "label")
    assert oracle.accuracy_labels == pytest.approx(0.996, abs=0.002)
    assert oracle.usd_per_query == pytest.approx(0.000024, rel=0.05)
    llama = next(p for p in report.policies if p.kind == "single" and p.worker == "Llama-3.1-405B-Inst_sambanova")
    assert llama.accuracy_labels == pytest.approx(0.960, abs=0.002)
    assert llama.usd_per_query == pytest.approx(0.00074, rel=0.02)
    # Our grader judges the same responses a little differently; both figures are reported.
    by_grader = report.find("best_single", "grader")
    assert 0.955 <= by_grader.accuracy <= 0.975 and best.accuracy == pytest.approx(0.962, abs=0.002)
    assert report.find("oracle", "grader").accuracy == pytest.approx(0.996, abs=0.002)
    rnd = report.find("random")
    assert 0.8 < rnd.accuracy < by_grader.accuracy and rnd.calls_per_query == 1.0
    singles = {p.worker: p for p in report.policies if p.kind == "single"}
    assert all(p.calls_per_query == pytest.approx(p.coverage) for p in singles.values())  # no call where none was recorded
    # One model answered only 681 questions: the others count as wrong, as they would in a run.
    partial = singles.pop("gemini-1.5-flash-exp-0827")
    assert partial.coverage == pytest.approx(681 / 1319) and partial.accuracy < 681 / 1319
    assert all(p.coverage == 1.0 for p in singles.values())


@needs_replay
def test_the_planner_runs_through_the_pipeline_against_the_replay_server(gsm_report):
    report, d = gsm_report
    planner = report.find("planner")
    facts = report.meta["planner"]
    assert planner.queries == facts["queries"] == PLANNER_QUERIES
    assert facts["valid_plans"] == PLANNER_QUERIES and facts["statuses"] == {"ok": PLANNER_QUERIES}
    assert set(facts["shapes"]) <= {"single", "ensemble"} and sum(facts["shapes"].values()) == PLANNER_QUERIES
    assert facts["server_outcomes"] == {"recorded": round(planner.calls_per_query * PLANNER_QUERIES)}
    run = d / "report" / "planner-run" / "runs" / "eval-gsm8k-all"
    rewards = pq.read_table(run / "rewards.parquet").to_pylist()
    assert len(rewards) == PLANNER_QUERIES
    assert planner.accuracy == pytest.approx(sum(bool(r["correct"]) for r in rewards) / PLANNER_QUERIES)
    cost = sum(r["cost_usd"] for r in pq.read_table(run / "results.parquet").to_pylist())
    assert planner.usd_per_query == pytest.approx(cost / PLANNER_QUERIES)
    assert planner.accuracy > report.find("random").accuracy and planner.tokens_per_query > 0


@needs_replay
def test_report_files_table_and_chart(gsm_report):
    report, _ = gsm_report
    text = report.report_path.read_text()
    assert "| oracle (labels) | 0.995 | 0.002 | 0.996 |" in text
    assert "| best single (labels): gpt-4o-2024-08-06 | 0.962 | 0.005 | 0.962 | $0.00144 | 1.00 |" in text
    assert f"| embedded planner (pipeline, {PLANNER_QUERIES} queries) |" in text
    assert "uniform random (expected)" in text and "![accuracy against cost](chart.png)" in text
    assert sum(1 for line in text.splitlines() if line.startswith("| ")) == 2 + 6 + 42  # two headers, the policies, every worker
    chart = report.chart_path.read_bytes()
    assert chart.startswith(PNG) and 20_000 < len(chart) < 400_000
    data = json.loads(report.json_path.read_text())
    assert len(data["policies"]) == 42 + 6 and data["meta"]["dataset"] == "gsm8k"


@needs_replay
def test_eval_command_on_mmlu_pro_reproduces_its_reference_figures(tmp_path, capsys):
    pool, queries = _files(tmp_path, "mmlu_pro")
    out = tmp_path / "report"
    assert cli_main(["eval", "--pool", str(pool), "--queries", str(queries), "--out", str(out), "--no-planner"]) == 0
    printed = capsys.readouterr().out
    assert "mmlu_pro, split all: 3000 queries, 16 workers" in printed
    # The shared README's $0.0067 counts every character of gpt-4o's answers; a replayed call is
    # counted at most max_tokens (1024) completion tokens, as the executor counts it when a plan
    # runs the same worker, and 1% of gpt-4o's answers are longer.
    assert "| best single (labels): gpt4o-2024-05 | 0.726 | 0.008 | 0.708 | $0.00648 |" in printed
    assert "| oracle (labels) | 0.920 | 0.005 | 0.927 | $0.000119 |" in printed
    assert (out / "report.md").exists() and (out / "chart.png").read_bytes().startswith(PNG)
    assert "embedded planner: not run" in (out / "report.md").read_text()


@needs_replay
def test_test_split_picks_the_best_single_worker_on_train_only(gsm_report, tmp_path):
    _, d = gsm_report
    report = evaluate(EvalConfig(pool=d / "replay-gsm8k.yaml", queries=d / "gsm8k.parquet", split="test",
                                 out=tmp_path / "r", planner=False))
    test_ids = [q for q in pq.read_table(d / "gsm8k.parquet").column("query_id").to_pylist()
                if split_of(q) == "test"]
    assert report.meta["queries"] == len(test_ids) and "train split" in report.meta["selection"]
    best = report.find("best_single", "label")
    assert best.queries == len(test_ids) and best.info["chosen_on_queries"] == 1319 - len(test_ids)


@needs_replay
def test_eval_refuses_queries_that_are_not_the_recorded_questions(gsm_report, tmp_path):
    _, d = gsm_report
    t = pq.read_table(d / "gsm8k.parquet").slice(0, 5).to_pylist()
    t[2]["prompt"] += " Think step by step."
    import pyarrow as pa

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(t), bad)
    with pytest.raises(ConductorError, match="1 prompt\\(s\\) differ from the recorded question"):
        evaluate(EvalConfig(pool=d / "replay-gsm8k.yaml", queries=bad, out=tmp_path / "r", planner=False))


@needs_replay
def test_eval_report_asset_carries_the_report_and_chart(gsm_report, tmp_path):
    from assets.evaluation import eval_report
    from assets.resources import StorageResource

    _, d = gsm_report
    config = {"dataset": "gsm8k", "pool": str(d / "replay-gsm8k.yaml"), "queries": str(d / "gsm8k.parquet"),
              "out": str(tmp_path / "dg"), "run_planner": False, "replay_dir": str(REPLAY)}
    with DagsterInstance.ephemeral() as instance:
        result = materialize([eval_report], instance=instance,
                             resources={"storage": StorageResource(data_dir=str(tmp_path / "data"))},
                             run_config={"ops": {"eval_report": {"config": config}}})
        meta = next(e.materialization.metadata for e in result.get_asset_materialization_events())
    assert result.success
    assert "data:image/png;base64," in meta["report"].value and "| oracle (labels) |" in meta["report"].value
    assert meta["chart"].value == str((tmp_path / "dg" / "chart.png").resolve())
    assert meta["oracle_accuracy_labels"].value == pytest.approx(0.996, abs=0.002)


def test_eval_report_asset_skips_without_the_replay_folder(tmp_path):
    from assets.evaluation import eval_report
    from assets.resources import StorageResource

    with DagsterInstance.ephemeral() as instance:
        result = materialize([eval_report], instance=instance,
                             resources={"storage": StorageResource(data_dir=str(tmp_path / "data"))},
                             run_config={"ops": {"eval_report": {"config": {"replay_dir": str(tmp_path / "absent")}}}})
        meta = next(e.materialization.metadata for e in result.get_asset_materialization_events())
    assert result.success
    assert f"the shared replay folder {tmp_path / 'absent'} is absent" in meta["skipped"].value
    assert result.output_for_node("eval_report") == {"skipped": meta["skipped"].value}
