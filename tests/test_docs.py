"""The README says what the code does: its schema tables are the ones the writers use,
and the commands it lists exist."""

import re

from conductor import schemas
from conductor.cli import build_parser
from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def test_readme_schema_tables_match_the_code():
    block = README.split("<!-- schemas:begin")[1].split("<!-- schemas:end -->")[0]
    block = block.split("\n", 1)[1].strip()
    assert block == schemas.markdown().strip(), "run `python -m conductor.schemas` and paste its output"


def test_every_command_the_readme_names_exists():
    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)
    named = set(re.findall(r"`conductor ([a-z]+)", README))
    assert named and named <= commands, named - commands
