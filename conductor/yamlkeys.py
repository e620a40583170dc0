"""YAML as people write our files, where PyYAML reads it otherwise.

- A key given twice: PyYAML keeps the last one silently, so a job or pool file whose
  `worker:` or `budget_usd:` appears twice would run with whichever came last. Both file
  loaders refuse them, naming the key and its two lines.
- `1e-3` is a number (YAML 1.2, JSON and Python agree); PyYAML follows YAML 1.1, where
  a float needs a dot (`1.0e-3`), and reads it as the string '1e-3'."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml


class Loader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-3 and 2E6 as floats."""


Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                             list("-+0123456789"))


def load(text: str):
    """The document, as SafeLoader would read it but with `1e-3` a number."""
    return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader)


def duplicate_key(node: yaml.Node | None, key: tuple = ()) -> tuple[tuple, int, int] | None:
    """The first key given twice in one mapping: (key path, first line, second line), 1-based."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[object, int] = {}
        for k_node, v_node in node.value:
            k = k_node.value if isinstance(k_node, yaml.ScalarNode) else str(k_node.value)
            line = k_node.start_mark.line + 1
            if k in seen:
                return key + (k,), seen[k], line
            seen[k] = line
            if (found := duplicate_key(v_node, key + (k,))) is not None:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            if (found := duplicate_key(v, key + (i,))) is not None:
                return found
    return None


def message(found: tuple[tuple, int, int]) -> str:
    key, first, second = found
    return f"{'.'.join(map(str, key))}: given twice (lines {first} and {second}); keep one"


def read_file(path: Path, what: str, error: type[Exception]) -> tuple[Any, yaml.Node | None]:
    """A pool or job file's document and node tree (for line numbers); a missing, unreadable
    or invalid file, or a key given twice, is an `error` naming `what` and the file."""
    if not path.exists():
        raise error(f"{what} {path}: not found")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else (e.strerror or type(e).__name__)
        raise error(f"{what} {path}: cannot read it ({why})") from None
    try:
        data = load(text)
        node = yaml.compose(text, Loader=Loader)
    except yaml.YAMLError as e:
        raise error(f"{what} {path}: not valid YAML: {e}") from None
    if (twice := duplicate_key(node)) is not None:
        raise error(f"{what} {path}:{twice[2]}: {message(twice)}")
    return data, node
