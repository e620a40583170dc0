"""The Makefile is the only setup a newcomer runs: a wrong Python must stop it with advice,
before a venv that pip would then refuse to install into is made."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_with_an_unsupported_python_names_it_and_makes_no_venv(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    fake = tmp_path / "python3.13"
    fake.write_text("#!/bin/sh\n# a Python outside 3.11-3.12: the version check exits 1\nexit 1\n")
    fake.chmod(0o755)
    p = subprocess.run(["make", "demo", f"PY={fake}"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert f"PY={fake} is missing or not Python 3.11 or 3.12" in p.stderr
    assert "make demo PY=python3.11" in p.stderr
    assert not (tmp_path / ".venv").exists()
