"""Audit 56 (the README's enrichment jobs walked as a new user): direct-mode samples that could only
repeat sample 0, a deleted job's catalog view left over missing files, `--full-refresh` help, the
context-window and budget refusals, and small messages and summary figures that misled."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from tests.conftest import cli, run_cli
from tests.test_enrich_job import GOOD, folder, line_of, write  # noqa: F401 - folder is a fixture
from tests.test_enrich_run_refusals import run_folders, write_job


def sql(data: Path, query: str):
    """`conductor sql` as a user runs it, CSV out."""
    return cli("sql", "--data-dir", data, "--format", "csv", query)


# ---- F2: samples in direct mode --------------------------------------------------------

def test_samples_above_one_in_direct_mode_are_refused_by_check_and_run(fresh_sim, tmp_path):
    """Direct mode sends each sample the same request, so samples 1.. were the response cache's copy
    of sample 0 (an invalid reply included): `samples: 3` did nothing but change every row's hash."""
    path = write_job(tmp_path, fresh_sim.url, samples=3)
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    line = line_of(path.read_text(), "samples:")
    assert f"job.yaml:{line}: samples: direct mode sends every sample of a row the same request" in r.stderr
    assert "set samples: 1" in r.stderr and "mode: planned" in r.stderr
    data = tmp_path / "data"
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 2 and "samples:" in r.stderr and run_folders(data) == []
    assert fresh_sim.log()["total"] == 0
    write_job(tmp_path, fresh_sim.url, samples=1)
    assert cli("job", "check", path).returncode == 0
    planned = yaml.safe_load(path.read_text())
    del planned["worker"]
    planned.update(mode="planned", samples=3)
    path.write_text(yaml.safe_dump(planned, sort_keys=False))
    assert cli("job", "check", path).returncode == 0, cli("job", "check", path).stderr


# ---- F3: a job whose runs were all deleted -------------------------------------------

def test_a_job_whose_runs_are_all_deleted_loses_its_view_and_sql_says_so(fresh_sim, tmp_path):
    """The README lets old run folders be deleted; deleting a retired job's last one left its view
    over files that were gone, and `conductor sql` called them damaged with an `mv` of a missing folder."""
    data = tmp_path / "data"
    for name in ("qa_a", "qa_b"):
        (tmp_path / name).mkdir()
        r = run_cli("job", "run", write_job(tmp_path / name, fresh_sim.url, name=name), "--data-dir", data,
                    "--quiet")
        assert r.returncode == 0, r.stderr
    assert sql(data, "select count(*) as n from qa_b").stdout.split() == ["n", "8"]
    for run in (data / "runs").glob("qa_b-*"):
        shutil.rmtree(run)
    r = sql(data, "select table_name from information_schema.tables order by 1")
    assert r.returncode == 0 and "qa_b" not in r.stdout.split() and "qa_a" in r.stdout.split(), r.stdout + r.stderr
    r = sql(data, "select count(*) from qa_b")
    assert r.returncode == 2, r.stdout
    assert "there is no view qa_b" in r.stderr and "jobs: qa_a" in r.stderr, r.stderr
    assert "damaged" not in r.stderr and "mv " not in r.stderr
    assert sql(data, "select count(*) as n from qa_a").stdout.split() == ["n", "8"]
    # the last job too: every view goes, none is left over missing files
    for run in (data / "runs").glob("qa_a-*"):
        shutil.rmtree(run)
    r = sql(data, "select count(*) from qa_a")
    assert r.returncode == 2 and "there is no view qa_a" in r.stderr and "damaged" not in r.stderr, r.stderr


# ---- F4: --full-refresh pays again ------------------------------------------------------

def test_full_refresh_help_says_it_bypasses_the_cache_and_pays_again():
    """The README says so; `--help` said only "recompute every row, reusing no record"."""
    r = cli("job", "run", "--help")
    text = " ".join(r.stdout.split())
    assert "--full-refresh recompute every row, reusing no record and bypassing the response cache: every row " \
           "is sent and paid for again" in text, text


# ---- F5: the context-window refusal ---------------------------------------------------

def test_context_refusal_says_what_it_counts_and_how_many_rows_past_five(fresh_sim, tmp_path):
    """The prompts (about 20 tokens) were well under the window of 40 the refusal said they exceeded:
    it counts the schema block too, and said nothing of it; past five rows it said "and more"."""
    path = write_job(tmp_path, fresh_sim.url)
    pool = yaml.safe_load((tmp_path / "pool.yaml").read_text())
    pool["workers"][0]["context_tokens"] = 40
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool, sort_keys=False))
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert "8 row(s) have a prompt longer than worker fast's context window (40 tokens), counting each rendered " \
           "prompt plus the fields' JSON Schema block (about" in r.stderr, r.stderr
    assert re.search(r"the longest is about \d+ tokens: id 'r0', 'r1', 'r2', 'r3', 'r4' and 3 more; ", r.stderr)
    data = tmp_path / "data"
    r = cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 2 and "and 3 more" in r.stderr and fresh_sim.log()["total"] == 0
    assert run_folders(data) == []


# ---- F6: small messages and figures ---------------------------------------------------

def test_a_null_join_key_is_named_as_empty_not_as_python_none(folder):
    """`(keys None; ids 'n2')` printed Python's None and did not say that the key was empty."""
    pq.write_table(pa.table({"note_id": ["n1", "n2", "n3"], "kind": ["memo", "memo", "mail"], "cid": ["a", None, "z"],
                             "body": ["all fine", "it broke", "so so"], "gold_mood": ["good", "bad", None]}),
                   folder / "in.parquet")
    pq.write_table(pa.table({"cid": ["a", "b"], "company": ["Acme", "Bolt"]}), folder / "l.parquet")
    text = GOOD.replace("  carry: [kind]", "  carry: [kind]\n  join:\n    - {path: l.parquet, on: cid}")
    r = cli("job", "check", write(folder, text))
    assert r.returncode == 2, r.stdout
    assert "1 row(s) have an empty 'cid' (ids 'n2'): fill their key in, or filter them out of the input" in r.stderr
    assert "1 row(s) have no match on 'cid' (keys 'z'; ids 'n3')" in r.stderr and "None" not in r.stderr


def test_an_enum_value_yaml_reads_as_an_integer_says_an_int(folder):
    text = GOOD.replace("values: [good, bad]", "values: [1, bad]")
    r = cli("job", "check", write(folder, text))
    assert r.returncode == 2 and "YAML reads 1 as an int: quote them" in r.stderr, r.stderr


def test_fields_with_every_entry_commented_out_are_refused_not_a_plain_text_job(folder):
    """`fields:` left null made a plain-text job, shown only as "plain text" in the check line."""
    text = GOOD.replace("  summary:", "#  summary:").replace("  mood:", "#  mood:").replace("  amount:", "#  amount:")
    text = text[:text.index("references:")] + "pool: pool.yaml\nmode: direct\nworker: fast\n"
    r = cli("job", "check", write(folder, text))
    assert r.returncode == 2, r.stdout
    assert f"job.yaml:{line_of(text, 'fields:')}: fields: is empty (every field commented out?)" in r.stderr
    assert "remove the `fields` key for a plain-text job" in r.stderr
    r = cli("job", "check", write(folder, text.replace("fields:\n", "")))
    assert r.returncode == 0 and "plain text" in r.stdout, r.stderr


def test_a_budget_below_one_calls_worst_case_is_refused_by_check_and_run(fresh_sim, tmp_path):
    """`job run` made a run folder, marked every row budget_exhausted and said "rerun to finish",
    which no rerun could: each call's worst case (max_tokens 256 at $2/Mtok, $0.000512 and up) was
    above the budget."""
    path = write_job(tmp_path, fresh_sim.url, budget_usd=0.0005)
    r = cli("job", "check", path)
    assert r.returncode == 2, r.stdout
    assert re.search(r"the job's budget_usd \(\$0\.0005\) is below the worst case of one call for 8 row\(s\) "
                     r"\(from \$0\.000[5-7]\d*: .*max_tokens 256 .*\), so no run could send them: "
                     r"id 'r0', 'r1', 'r2', 'r3', 'r4' and 3 more", r.stderr), r.stderr
    data = tmp_path / "data"
    r = run_cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 2 and "below the worst case of one call" in r.stderr, r.stderr
    assert run_folders(data) == [] and fresh_sim.log()["total"] == 0
    write_job(tmp_path, fresh_sim.url)  # no budget in the job: the provider's cap is checked the same way
    pool = yaml.safe_load((tmp_path / "pool.yaml").read_text())
    pool["providers"]["sim"]["budget_usd"] = 0.0004
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool, sort_keys=False))
    r = cli("job", "check", path)
    assert r.returncode == 2 and "provider sim's budget_usd ($0.0004) in pool" in r.stderr, r.stderr


def test_a_budget_stopped_runs_summary_computed_leaves_the_stopped_rows_out(fresh_sim, tmp_path):
    """The CLI printed `computed 0, stopped by a budget 60` while runs.summary said computed 60:
    SQL over summary->>'computed' overstated the work done."""
    data = tmp_path / "data"
    path = write_job(tmp_path, fresh_sim.url, budget_usd=0.00082)  # one worst case fits, two do not
    r = run_cli("job", "run", path, "--data-dir", data, "--quiet")
    assert r.returncode == 3, r.stderr
    m = re.search(r"^rows +8  \(computed (\d+), stopped by a budget (\d+), reused 0 at \$0\)$", r.stdout, re.M)
    assert m, r.stdout
    computed, stopped = int(m.group(1)), int(m.group(2))
    assert computed >= 1 and stopped >= 1 and computed + stopped == 8
    q = sql(data, "select (summary->>'computed')::int as c, summary->'statuses'->>'budget_exhausted' as s "
                  "from runs where run_id like 'notes-%'")
    assert q.stdout.split() == ["c,s", f"{computed},{stopped}"], q.stdout + q.stderr
    done = sql(data, "select count(*) as n from notes where status <> 'budget_exhausted' and not reused")
    assert done.stdout.split() == ["n", str(computed)]
    (run,) = run_folders(data)
    assert orjson.loads((data / "runs" / run / "summary.json").read_bytes())["computed"] == computed


def test_sql_without_runs_names_job_run_too(tmp_path):
    """`conductor sql` before the first job run said only "run `conductor run` first"."""
    r = cli("sql", "--data-dir", tmp_path / "data", "select 1")
    assert r.returncode == 2 and "run `conductor run` or `conductor job run` first" in r.stderr, r.stderr
