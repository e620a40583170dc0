"""The seeded sample query sets: reproducible from the seed, valid for the loader,
and with references that hold up when recomputed from the prompt text alone."""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter, defaultdict
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conductor.cli import samples as samples_cli
from conductor.queries import COLUMNS, load_queries
from conductor.samples import generate

SOURCE_SETS = ("arithmetic", "choice", "factual", "finance")
PREFIX = {"arithmetic": "arith-", "choice": "choice-", "factual": "fact-", "finance": "fin-"}
REPO_QUERIES = Path(__file__).resolve().parents[1] / "data" / "queries"


@pytest.fixture(scope="module")
def seven(tmp_path_factory) -> dict[str, Path]:
    return generate(tmp_path_factory.mktemp("seed7"), seed=7)


@pytest.fixture(scope="module")
def rows(seven) -> dict[str, list[dict]]:
    return {name: load_queries(path).to_pylist() for name, path in seven.items()}


def test_writes_the_five_files(seven):
    assert sorted(seven) == sorted(SOURCE_SETS + ("sample",))
    for name, path in seven.items():
        assert path.name == f"{name}.parquet" and path.is_file()
        meta = pq.ParquetFile(path).metadata
        assert meta.row_group(0).column(0).compression == "ZSTD"


def test_same_seed_gives_identical_files(seven, tmp_path):
    again = generate(tmp_path, seed=7)
    for name, path in seven.items():
        assert pq.read_table(again[name]).equals(pq.read_table(path)), name
        assert again[name].read_bytes() == path.read_bytes(), name


def test_other_seed_gives_other_content(seven, tmp_path):
    other = generate(tmp_path, seed=8)
    for name, path in seven.items():
        assert not pq.read_table(other[name]).equals(pq.read_table(path)), name


def test_committed_files_match_the_generator(seven):
    """data/queries is what `conductor samples` writes with the default seed."""
    for name, path in seven.items():
        committed = REPO_QUERIES / path.name
        assert committed.is_file(), f"{committed} is missing; run `conductor samples`"
        assert pq.read_table(committed).equals(pq.read_table(path)), f"{committed} is stale; run `conductor samples`"


def test_every_file_loads_with_exactly_the_string_columns(seven):
    for name, path in seven.items():
        raw = pq.read_table(path)
        assert raw.column_names == list(COLUMNS), name
        assert all(str(t) == "string" for t in raw.schema.types), name
        table = load_queries(path)
        assert table.num_rows > 0


def test_rows_are_complete_and_tagged_with_their_set(rows):
    task = {"arithmetic": "math", "choice": "choice", "factual": "exact", "finance": "math"}
    for name in SOURCE_SETS:
        for row in rows[name]:
            assert row["task"] == task[name], row["query_id"]
            assert row["reference"] and row["reference"].strip() == row["reference"], row["query_id"]
            meta = json.loads(row["metadata"])
            assert meta["set"] == name and meta["kind"], row["query_id"]
        prompts = [r["prompt"] for r in rows[name]]
        assert len(set(prompts)) == len(prompts), f"{name} repeats a prompt"


def test_ids_unique_across_sets_and_prefixed(rows):
    ids = [r["query_id"] for name in SOURCE_SETS for r in rows[name]]
    dup = [i for i, n in Counter(ids).items() if n > 1]
    assert not dup, dup
    for name in SOURCE_SETS:
        assert all(r["query_id"].startswith(PREFIX[name]) for r in rows[name]), name


def test_at_least_300_rows_with_references(rows):
    assert sum(1 for name in SOURCE_SETS for r in rows[name] if r["reference"]) >= 300
    assert len(rows["finance"]) >= 50


def test_sample_mixes_every_set_with_rows_unchanged(rows):
    by_id = {r["query_id"]: r for name in SOURCE_SETS for r in rows[name]}
    sample = rows["sample"]
    assert 300 <= len(sample) <= 500
    assert len({r["query_id"] for r in sample}) == len(sample)
    for row in sample:
        assert by_id[row["query_id"]] == row
    assert {json.loads(r["metadata"])["set"] for r in sample} == set(SOURCE_SETS)
    # shuffled: the first 40 rows of a demo run already see all three tasks
    assert {r["task"] for r in sample[:40]} == {"math", "choice", "exact"}


# --- arithmetic -------------------------------------------------------------------

def test_arithmetic_references_have_the_stated_form(rows):
    for row in rows["arithmetic"]:
        if "rounded to two decimal places" in row["prompt"]:
            assert re.fullmatch(r"\d+\.\d\d", row["reference"]), row
        else:
            assert re.fullmatch(r"\d+", row["reference"]), row


def test_shopping_change_recomputed(rows):
    shopping = [r for r in rows["arithmetic"] if json.loads(r["metadata"])["kind"] == "shopping"]
    assert shopping
    for row in shopping:
        m = re.search(r"buys (\d+) .+? at \$(\d+) each and (\d+) .+? at \$(\d+) each, and pays with a \$(\d+) bill",
                      row["prompt"])
        q1, p1, q2, p2, bill = map(int, m.groups())
        assert int(row["reference"]) == bill - q1 * p1 - q2 * p2 > 0


# --- multiple choice ----------------------------------------------------------------

def parse_options(prompt: str) -> dict[str, str]:
    block = prompt.split("Options:\n", 1)[1].split("\n\n", 1)[0]
    return dict(re.fullmatch(r"([A-E])\) (.+)", line).groups() for line in block.splitlines())


def test_choice_reference_is_one_of_the_options(rows):
    for row in rows["choice"]:
        options = parse_options(row["prompt"])
        assert list(options) in (list("ABCD"), list("ABCDE")), row["prompt"]
        assert len(set(options.values())) == len(options), row["prompt"]
        assert row["reference"] in options, row


def test_choice_answers_are_correct(rows):
    days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
    checked = Counter()
    for row in rows["choice"]:
        kind, prompt = json.loads(row["metadata"])["kind"], row["prompt"]
        options = parse_options(prompt)
        picked = options[row["reference"]]
        if kind == "product":
            a, b = map(int, re.search(r"What is (\d+) × (\d+)\?", prompt).groups())
            assert int(picked) == a * b
        elif kind == "prime":
            prime = [v for v in options.values() if all(int(v) % d for d in range(2, math.isqrt(int(v)) + 1))]
            assert prime == [picked]
        elif kind == "day_of_week":
            start, n = re.search(r"today is (\w+), .* be (\d+) days", prompt).groups()
            assert picked == days[(days.index(start) + int(n)) % 7]
        elif kind == "largest_fraction":
            assert Fraction(picked) == max(Fraction(v) for v in options.values())
        else:
            continue
        checked[kind] += 1
    assert set(checked) == {"product", "prime", "day_of_week", "largest_fraction"}


# --- factual ------------------------------------------------------------------------

def test_factual_answers_are_short_and_spot_checked(rows):
    """Checked against facts typed here again, so a shifted table row shows up."""
    symbols = {"iron": "Fe", "gold": "Au", "sodium": "Na", "potassium": "K", "silver": "Ag", "lead": "Pb",
               "tin": "Sn", "mercury": "Hg", "copper": "Cu", "oxygen": "O"}
    capitals = {"France": "Paris", "Japan": "Tokyo", "Australia": "Canberra", "Canada": "Ottawa",
                "Turkey": "Ankara", "Morocco": "Rabat", "Pakistan": "Islamabad", "New Zealand": "Wellington"}
    planets = ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]
    ordinals = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"]
    assert len(rows["factual"]) >= 90
    hits = 0
    for row in rows["factual"]:
        prompt, ref = row["prompt"], row["reference"]
        assert 0 < len(ref) <= 30 and "\n" not in ref, row
        if (m := re.search(r"chemical symbol of (\w+)\?", prompt)) and m[1] in symbols:
            assert ref == symbols[m[1]], prompt
        elif (m := re.search(r"capital city of (.+?)\?", prompt)) and m[1] in capitals:
            assert ref == capitals[m[1]], prompt
        elif m := re.search(r"which planet is the (\w+)\?", prompt):
            assert ref == planets[ordinals.index(m[1])], prompt
        elif m := re.search(r"position of (\w+) among the planets", prompt):
            assert ref == str(planets.index(m[1]) + 1), prompt
        else:
            continue
        hits += 1
    assert hits >= 10


# --- finance ------------------------------------------------------------------------

def parse_figures(prompt: str) -> dict[int, dict[str, int]]:
    """Every figure in the prompt, by fiscal year, from either layout."""
    figures: dict[int, dict[str, int]] = defaultdict(dict)
    years, current = None, None
    for line in prompt.splitlines():
        if line.startswith("| Line item"):
            years = [int(cell.strip().removeprefix("FY")) for cell in line.strip().strip("|").split("|")[1:]]
        elif line.startswith("|") and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            for year, cell in zip(years, cells[1:]):
                figures[year][cells[0]] = int(cell.replace(",", ""))
        elif m := re.match(r"Fiscal (\d{4}) ", line):
            current = int(m[1])
        elif m := re.match(r"- (.+): ([\d,]+)$", line):
            figures[current][m[1]] = int(m[2].replace(",", ""))
    return figures


def expected(kind: str, f: dict[int, dict[str, int]], year: int, prev: int) -> tuple[Decimal, bool]:
    """(exact ratio, answer is a percentage), written from the textbook definitions."""
    y = f[year]
    ratios = {
        "gross_margin": lambda: (Decimal(y["Revenue"] - y["Cost of goods sold"]) / y["Revenue"], True),
        "operating_margin": lambda: (Decimal(y["Revenue"] - y["Cost of goods sold"] - y["Operating expenses"])
                                     / y["Revenue"], True),
        "net_margin": lambda: (Decimal(y["Net income"]) / y["Revenue"], True),
        "revenue_growth": lambda: (Decimal(y["Revenue"]) / f[prev]["Revenue"] - 1, True),
        "effective_tax_rate": lambda: (Decimal(y["Income tax expense"]) / (y["Net income"] + y["Income tax expense"]),
                                       True),
        "interest_coverage": lambda: (Decimal(y["Revenue"] - y["Cost of goods sold"] - y["Operating expenses"])
                                      / y["Interest expense"], False),
        "current_ratio": lambda: (Decimal(y["Total current assets"]) / y["Total current liabilities"], False),
        "quick_ratio": lambda: (Decimal(y["Total current assets"] - y["Inventory"]) / y["Total current liabilities"],
                                False),
        "debt_to_equity": lambda: (Decimal(y["Short-term debt"] + y["Long-term debt"]) / y["Shareholders' equity"],
                                   False),
        "return_on_equity": lambda: (Decimal(y["Net income"]) / y["Shareholders' equity"], True),
    }
    return ratios[kind]()


def test_finance_references_recomputed_from_the_prompt(rows):
    checked = Counter()
    for row in rows["finance"]:
        kind = json.loads(row["metadata"])["kind"]
        question = row["prompt"].split("Question: ", 1)[1]
        mentioned = [int(y) for y in re.findall(r"fiscal (\d{4})", question)]
        year, prev = (mentioned[1], mentioned[0]) if kind == "revenue_growth" else (mentioned[0], None)
        figures = parse_figures(row["prompt"])
        value, percent = expected(kind, figures, year, prev)
        if percent:
            assert "as a percentage rounded to one decimal place" in question, row["query_id"]
            want = (value * 100).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)
        else:
            assert "rounded to two decimal places" in question, row["query_id"]
            want = value.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
        assert row["reference"] == str(want), (row["query_id"], kind, row["reference"], str(want))
        checked[kind] += 1
    assert checked["gross_margin"] >= 5 and checked["current_ratio"] >= 5
    assert len(checked) >= 8


def test_finance_statements_add_up(rows):
    for row in rows["finance"]:
        for year, y in parse_figures(row["prompt"]).items():
            if "Revenue" in y:
                assert y["Net income"] == (y["Revenue"] - y["Cost of goods sold"] - y["Operating expenses"]
                                           - y["Interest expense"] - y["Income tax expense"]), (row["query_id"], year)
            if "Total assets" in y:
                assert y["Total current assets"] == y["Cash and equivalents"] + y["Accounts receivable"] + y["Inventory"]
                assert y["Total assets"] == y["Total current assets"] + y["Property, plant and equipment, net"]
                assert y["Total current liabilities"] == y["Accounts payable"] + y["Short-term debt"] + y[
                    "Accrued liabilities"]
                assert y["Total liabilities"] == y["Total current liabilities"] + y["Long-term debt"]
                assert y["Total assets"] == y["Total liabilities"] + y["Shareholders' equity"] > 0, row["query_id"]


def test_finance_uses_both_layouts(rows):
    tables = sum("| Line item |" in r["prompt"] for r in rows["finance"])
    assert 0 < tables < len(rows["finance"])


# --- command line -------------------------------------------------------------------

def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="conductor")
    samples_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_writes_and_reports_counts(tmp_path, capsys):
    out = tmp_path / "queries"
    args = _cli(["samples", "--out", str(out), "--seed", "3"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    for name, n, tasks in [("arithmetic", 120, "math 120"), ("choice", 100, "choice 100"),
                           ("factual", 100, "exact 100"), ("finance", 80, "math 80"),
                           ("sample", 400, "choice 100, exact 100, math 200")]:
        assert re.search(rf"{name}\.parquet\s+{n} rows\s+\({tasks}\)", printed), printed
        assert (out / f"{name}.parquet").is_file()


def test_cli_rejects_a_file_as_output_folder(tmp_path):
    from conductor.errors import ConductorError

    target = tmp_path / "not-a-folder"
    target.write_text("x")
    args = _cli(["samples", "--out", str(target)])
    with pytest.raises(ConductorError, match="not a folder"):
        args.func(args)
