"""Job files `job check` passed and `job run` then refused or crashed on (audit 50): each is
refused by `job check` (and so by `job run`, which loads the file the same way) with the file,
the line and the key, and never with a traceback."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import cli
from tests.test_enrich_job import GOOD, folder, line_of, refused, write  # noqa: F401 - folder is a fixture

HUGE = "1" + "0" * 400


def checked(folder: Path, text: str):
    """`conductor job check` on the text, as a user runs it."""
    return cli("job", "check", write(folder, text))


def test_huge_numbers_are_refused_at_their_line(folder):
    """`budget_usd: 10**400` and `rel_tol: 10**400` crashed in float() (OverflowError);
    `seed` and `max_steps` past 64 bits passed `job check` and crashed `job run` in orjson."""
    cases = [(GOOD + f"budget_usd: {HUGE}\n", "budget_usd", "budget_usd: must be a finite number >= 0"),
             (GOOD.replace("score: exact}", f"score: numeric, rel_tol: {HUGE}}}"), "rel_tol",
              "references.mood.rel_tol: must be a finite number >= 0"),
             (GOOD + f"seed: {10 ** 30}\n", "seed:", "seed: must be an integer from 0 to 9223372036854775807"),
             (GOOD + f"max_steps: {10 ** 30}\n", "max_steps:", "max_steps: must be an integer from 1 to")]
    for text, needle, words in cases:
        r = checked(folder, text)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"job.yaml:{line_of(text, needle)}: {words}" in r.stderr, r.stderr
        assert len(r.stderr) < 400  # the 400 digits are cut, not printed whole
    data = folder / "data"
    r = cli("job", "run", write(folder, GOOD + f"seed: {10 ** 30}\n"), "--data-dir", data, "--quiet")
    assert r.returncode == 2 and "seed: must be an integer" in r.stderr and not (data / "runs").exists()


def test_samples_past_the_runners_limit_are_refused_by_check_naming_the_key(folder):
    """`samples: 5000` passed `job check`; `job run` then blamed `--samples`, a flag never given."""
    text = GOOD + "samples: 5000\n"
    r = checked(folder, text)
    assert r.returncode == 2, r.stdout
    assert f"job.yaml:{line_of(text, 'samples:')}: samples: must be an integer from 1 to 4096 (got 5000)" in r.stderr
    assert "--samples" not in r.stderr
    planned = GOOD.replace("mode: direct\nworker: fast\n", "mode: planned\n")  # direct mode takes samples: 1 only
    assert checked(folder, planned + "samples: 4096\n").returncode == 0


def test_an_unknown_planner_option_is_refused_by_check_at_its_line(folder):
    """The planner factory judged its options only in `job run`, with no file or line."""
    planned = GOOD.replace("mode: direct\nworker: fast\n", "mode: planned\n")
    text = planned + "planner:\n  name: embedded\n  polcy: none\n"
    r = checked(folder, text)
    assert r.returncode == 2, r.stdout
    assert f"job.yaml:{line_of(text, 'polcy')}: planner.polcy: planner embedded: unknown option(s) polcy" in r.stderr
    assert checked(folder, planned + "planner:\n  name: embedded\n  policy: none\n").returncode == 0


def test_a_worker_without_a_price_under_a_budget_is_refused_by_check(folder):
    """`job run` refused it only after planning, in a run folder of its own."""
    text = GOOD + "budget_usd: 1.0\n"
    r = checked(folder, text)
    assert r.returncode == 2, r.stdout
    assert f"job.yaml:{line_of(text, 'worker: fast')}: worker: worker 'fast' has no known price" in r.stderr
    assert "job's budget_usd" in r.stderr and "price: {input_per_mtok, output_per_mtok}" in r.stderr
    judged = GOOD.replace("worker: fast\n", "worker: fast\nquality:\n  judge: {worker: fast, rubric: be right}\n")
    pool = folder / "pool.yaml"
    pool.write_text(pool.read_text().replace("{max_concurrency: 4}", "{max_concurrency: 4, budget_usd: 2}"))
    r = checked(folder, judged)
    assert r.returncode == 2 and "provider sim's budget_usd" in r.stderr, r.stderr
    pool.write_text(pool.read_text().replace('/v1"}', '/v1", price: {input_per_mtok: 1, output_per_mtok: 2}}'))
    assert checked(folder, judged + "budget_usd: 1.0\n").returncode == 0


def test_unknown_keys_under_quality_and_the_judge_are_refused(folder):
    """A typo there kept a default silently (0.95 for min_valid_shar), or went unseen (rubrik)."""
    text = GOOD + "quality:\n  min_valid_shar: 0.99\n"
    assert (f"job.yaml:{line_of(text, 'min_valid_shar')}: quality.min_valid_shar: unknown key "
            f"(allowed: min_valid_share, judge)") in refused(folder, text)
    text = GOOD + "quality:\n  judge:\n    worker: fast\n    rubric: be right\n    rubrik: be kind\n"
    assert (f"job.yaml:{line_of(text, 'rubrik')}: quality.judge.rubrik: unknown key "
            f"(allowed: worker, rubric)") in refused(folder, text)
    text = GOOD.replace("description: two fields from a note", "description: [1, 2]")
    assert f"job.yaml:{line_of(text, 'description')}: description: must be a string" in refused(folder, text)


def test_job_queries_out_is_a_parquet_file_it_can_write(folder, tmp_path):
    """An existing folder and an unwritable path gave tracebacks; `q.csv` got Parquet under a CSV name."""
    job = write(folder, GOOD)
    (tmp_path / "nodir").mkdir()
    for out, words in ((tmp_path / "nodir", "is a folder; give a file name"),
                       (Path("/proc/x.parquet"), "cannot write it (No such file or directory)"),
                       (tmp_path / "q.csv", "the query set is written as Parquet; give a .parquet name")):
        r = cli("job", "queries", job, "--out", out)
        assert r.returncode == 2 and f"conductor: error: --out {out}: {words}" in r.stderr, r.stderr
    assert not (tmp_path / "q.csv").exists()
    r = cli("job", "queries", job, "--out", tmp_path / "q.parquet")
    assert r.returncode == 0 and (tmp_path / "q.parquet").exists(), r.stderr


def test_a_ragged_csv_line_and_a_cut_json_line_are_named(folder):
    """polars named no line, and advised `truncate_ragged_lines`, which a job file cannot set."""
    (folder / "in.csv").write_text("note_id,kind,body,gold_mood\nn1,memo,fine,good\nn2,memo,a,b,c\n")
    r = checked(folder, GOOD.replace("path: in.parquet", "path: in.csv"))
    assert r.returncode == 2, r.stdout
    assert f"input {folder / 'in.csv'}: line 3 has 5 fields, the header 4" in r.stderr
    assert "truncate_ragged_lines" not in r.stderr and r.stderr.count("\n") == 1
    (folder / "in.jsonl").write_text('{"note_id": "n1", "kind": "k", "body": "b", "gold_mood": null}\n'
                                     '{"note_id": "n2", "kind": ')
    r = checked(folder, GOOD.replace("path: in.parquet", "path: in.jsonl"))
    assert r.returncode == 2, r.stdout
    assert f"input {folder / 'in.jsonl'}: line 2 is not valid JSON" in r.stderr


def test_a_model_planner_is_checked_as_the_run_builds_it(folder):
    """audit51 N4: `job check` built the planner without the job's max_steps and never looked for
    its worker in the pool; `job run` then refused, without file or line."""
    planned = GOOD.replace("mode: direct\nworker: fast\n", "mode: planned\n")
    cases = [(planned + "max_steps: 50\nplanner: {name: llm, model: openai/fast}\n", "max_steps:",
              "max_steps: LLM planner: max_steps must be a whole number from 1 to 20 (got 50)"),
             (planned + "planner: {name: llm, worker: nosuch}\n", "nosuch",
              "planner.worker: LLM planner: worker 'nosuch' is not in the pool (known: fast)"),
             (planned + "planner: {name: llm, worker: fast}\n", "worker: fast}",
              "planner.worker: LLM planner: worker fast must be of kind planner"),
             # review41b 1: job check passed this, and job run refused it in conductor run's words
             (planned + "max_steps: 5\nplanner: {name: llm, model: openai/fast, max_steps: 3}\n", "max_steps: 3",
              "planner.max_steps: planner.max_steps 3 differs from the job's max_steps 5")]
    for text, needle, words in cases:
        r = checked(folder, text)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"job.yaml:{line_of(text, needle)}: {words}" in r.stderr, r.stderr
    assert checked(folder, planned + "max_steps: 20\nplanner: {name: llm, model: openai/fast}\n").returncode == 0
    assert checked(folder, planned + "max_steps: 4\nplanner: {name: llm, model: openai/fast, max_steps: 4}\n"
                   ).returncode == 0
