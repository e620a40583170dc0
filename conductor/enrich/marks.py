"""YAML read with the line of every key, so that an error in a job file can name
`file:line` and the key, as a user would look for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from conductor.errors import InputError
from conductor import yamlkeys


class Located:
    """A parsed YAML document plus the 1-based line of every key path."""

    def __init__(self, path: Path, data: Any, lines: dict[tuple, int], styles: dict[tuple, str | None]):
        self.path = path
        self.data = data
        self.lines = lines
        self.styles = styles

    def line(self, *key: Any) -> int | None:
        """Line of the deepest known prefix of `key` (a missing key points at its parent)."""
        for n in range(len(key), -1, -1):
            if key[:n] in self.lines:
                return self.lines[key[:n]]
        return None

    def error(self, key: tuple | str, message: str) -> InputError:
        key = (key,) if isinstance(key, str) else tuple(key)
        name = ".".join(str(k) for k in key) or "(top level)"
        line = self.line(*key)
        where = f"{self.path}:{line}" if line else str(self.path)
        return InputError(f"job file {where}: {name}: {message}")


def load_located(path: Path) -> Located:
    data, node = yamlkeys.read_file(path, "job file", InputError)
    lines: dict[tuple, int] = {}
    styles: dict[tuple, str | None] = {}
    if node is not None:
        _walk(node, (), lines, styles)
    return Located(path, data, lines, styles)


def _walk(node: yaml.Node, key: tuple, lines: dict, styles: dict) -> None:
    """Record the line of every key (mapping keys by their scalar value, list items by index)."""
    lines.setdefault(key, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for k_node, v_node in node.value:
            k = k_node.value if isinstance(k_node, yaml.ScalarNode) else str(k_node.value)
            sub = key + (k,)
            lines[sub] = k_node.start_mark.line + 1
            if isinstance(v_node, yaml.ScalarNode):
                styles[sub] = v_node.style
                lines[sub + ("<value>",)] = v_node.start_mark.line + 1
            else:
                _walk(v_node, sub, lines, styles)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _walk(v, key + (i,), lines, styles)
