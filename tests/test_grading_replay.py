"""The graders against real recorded model outputs: on the shared replay tables
they must agree with each benchmark's own correctness label on at least 99% of
rows (GSM8K graded as math, MMLU-Pro as choice)."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from conductor.cli import main as cli_main
from conductor.agreement import check

# slow: grades the 100,000 rows of the shared replay tables
pytestmark = pytest.mark.slow

REPLAY = Path(os.environ.get("CONDUCTOR_REPLAY_DIR") or Path(__file__).resolve().parents[1].parent / "shared" / "replay")
TARGET = 0.99

needs_replay = pytest.mark.skipif(
    not REPLAY.is_dir(), reason=f"../shared/replay not found: {REPLAY} (set CONDUCTOR_REPLAY_DIR to its location)")


@needs_replay
@pytest.mark.parametrize("dataset, rows_at_least", [("gsm8k", 50_000), ("mmlu_pro", 45_000)])
def test_grader_agrees_with_benchmark_labels(dataset, rows_at_least, capsys):
    result = check(REPLAY, dataset)
    with capsys.disabled():
        print(f"\n{dataset}: agreement {result.rate:.4f} over {result.rows} rows, "
              f"{len(result.disagreements)} disagreements, graded in {result.seconds:.1f} s")
    assert result.rows >= rows_at_least  # the whole shared file, not a slice
    assert result.rate >= TARGET, [(d.question_id, d.model, d.reference, d.answer) for d in result.disagreements[:20]]


@needs_replay
def test_check_command_lists_disagreements_and_writes_csv(tmp_path, capsys):
    out = tmp_path / "dis.csv"
    assert cli_main(["graders", "check", "--replay", str(REPLAY), "--limit", "3000", "--out", str(out),
                     "--examples", "1000"]) == 0
    text = capsys.readouterr().out
    assert "gsm8k (math 3000): 3000 rows, agreement" in text
    assert "mmlu_pro (choice 3000): 3000 rows, agreement" in text
    with open(out, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert rows, "the first 3000 rows of each table hold a few disagreements"
    assert set(rows[0]) == {"dataset", "question_id", "model", "task", "kind", "reference", "extracted", "label",
                            "verdict", "detail", "response_tail"}
    for kind in {r["kind"] for r in rows}:  # the kinds are counted on screen
        assert f"  {kind}" in text
    for r in rows:
        assert r["label"] != r["verdict"]
        assert r["question_id"] in text  # every disagreement is also listed on screen


def test_check_command_names_a_missing_folder(tmp_path, capsys):
    assert cli_main(["graders", "check", "--replay-dir", str(tmp_path / "nowhere")]) == 2
    assert f"replay folder {tmp_path / 'nowhere'} not found" in capsys.readouterr().err
    # --dataset chooses among the shared tables: with --table it would be ignored, so it is refused.
    assert cli_main(["graders", "check", "--table", str(tmp_path / "t.parquet"), "--dataset", "gsm8k"]) == 2
    assert "--table checks that one table: leave out --dataset" in capsys.readouterr().err
