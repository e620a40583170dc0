"""Conductor reads its YAML files the same whatever another library did to PyYAML's SafeLoader. vLLM, when
it checks a structured-output request, imports lm-format-enforcer, which makes every date text in
SafeLoader's process-wide table: after the vLLM planner's test, a pool's `version: 2026-13-45` was
accepted as the text '2026-13-45' instead of being refused at its line (a test-order failure)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import yaml

from conductor import yamlkeys
from conductor.errors import PoolError
from conductor.pool import load_pool
from tests.conftest import REPO

TIMESTAMP, STR = "tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:str"
DOC = "a: 2026-01-02\nb: 1e-3\nc: !!binary aGk=\nd: !!set {x: null}\ne: ~\nf: yes\ng: 0x1F\nh: 1_000\ni: .inf\n"


def _clean_read() -> str:
    """How a fresh interpreter reads DOC: what conductor read before any library changed PyYAML."""
    code = f"from conductor import yamlkeys; print(repr(yamlkeys.load({DOC!r})))"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def _refused_at_its_line(tmp_path) -> None:
    pool = tmp_path / "pool.yaml"
    pool.write_text("workers:\n  - id: w\n    model: openai/x\n    description: 2026-13-45\n")
    with pytest.raises(PoolError, match=r"pool\.yaml:4:18: a value cannot be read: month must be in 1\.\.12"):
        load_pool(pool)
    with pytest.raises(ValueError, match="month must be in 1..12"):
        yamlkeys.load("v: 2026-13-45")


def test_a_library_that_makes_dates_text_in_safeloader_changes_nothing_conductor_reads(tmp_path, monkeypatch):
    clean = _clean_read()
    # lm-format-enforcer's own change (lmformatenforcer/external/jsonschemaobjectutil.py), undone after the test
    monkeypatch.setitem(yaml.SafeLoader.yaml_constructors, TIMESTAMP, yaml.SafeLoader.yaml_constructors[STR])
    # and the same done to the shared resolver lists in place: dates no longer recognized at all
    for first, found in yaml.SafeLoader.yaml_implicit_resolvers.items():
        monkeypatch.setitem(yaml.SafeLoader.yaml_implicit_resolvers, first, [r for r in found if r[0] != TIMESTAMP])
    assert yaml.safe_load("v: 2026-13-45") == {"v": "2026-13-45"}  # the change took

    _refused_at_its_line(tmp_path)
    assert repr(yamlkeys.load(DOC)) == clean  # every other type read as before


@pytest.mark.skipif(importlib.util.find_spec("lmformatenforcer") is None, reason="lm-format-enforcer not installed")
@pytest.mark.parametrize("imports", ["from conductor import yamlkeys; import lmformatenforcer",
                                     "import lmformatenforcer; from conductor import yamlkeys"])
def test_importing_lm_format_enforcer_before_or_after_conductor_leaves_its_dates_alone(imports):
    """The real culprit, in a process of its own (its change cannot be undone)."""
    code = (f"{imports}\nimport yaml\n"
            "if yaml.safe_load('v: 2026-13-45') != {'v': '2026-13-45'}:\n    print('unchanged')\n"
            "try:\n    yamlkeys.load('v: 2026-13-45')\nexcept ValueError as e:\n    print('refused:', e)\n"
            "else:\n    print('accepted')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    if r.stdout.startswith("unchanged"):
        pytest.skip("this lm-format-enforcer no longer changes SafeLoader")
    assert r.stdout.strip() == "refused: month must be in 1..12", r.stdout
