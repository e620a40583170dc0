"""The command line starts without the heavy stacks: `conductor --help` (and every
command's --help) imports no litellm, Dagster, vLLM or polars, so a mistyped
command or a `conductor sql` is answered at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("litellm", "dagster", "vllm", "polars", "torch")
COMMANDS = ("eval", "export", "graders", "job", "policy", "replay", "run", "samples", "sim", "sql")


def _imported(args: list[str]) -> set[str]:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "conductor", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("args", [["--help"], *[[c, "--help"] for c in COMMANDS]], ids=lambda a: " ".join(a))
def test_help_imports_no_heavy_library(args):
    heavy = sorted(n for n in _imported(args) if n.split(".")[0] in HEAVY)
    assert not heavy, f"conductor {' '.join(args)} imported {heavy}"


def test_sql_imports_no_heavy_library(tmp_path):
    (tmp_path / "runs").mkdir()
    heavy = sorted(n for n in _imported(["sql", "select 1", "--data-dir", str(tmp_path)])
                   if n.split(".")[0] in HEAVY)
    assert not heavy, f"conductor sql imported {heavy}"


def test_a_run_on_an_openai_compatible_pool_never_imports_litellm(tmp_path, sim, sample_queries):
    """Workers with an api_base and an openai/ model are called by the direct client and
    checked by the preflight without litellm, so such a run does not pay its seconds of import."""
    from tests.conftest import write_pool

    pool = write_pool(tmp_path / "pool.yaml", sim.url)
    imported = _imported(["run", str(sample_queries), "--pool", str(pool), "--data-dir", str(tmp_path / "data"),
                          "--quiet"])
    assert "conductor.runner" in imported
    assert not sorted(n for n in imported if n.split(".")[0] == "litellm")
