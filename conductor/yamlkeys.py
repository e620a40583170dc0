"""YAML as people write our files, where PyYAML reads it otherwise.

- A key given twice: PyYAML keeps the last one silently, so a job or pool file whose
  `worker:` or `budget_usd:` appears twice would run with whichever came last. Both file
  loaders refuse them, naming the key and its two lines.
- `1e-3` is a number (YAML 1.2, JSON and Python agree); PyYAML follows YAML 1.1, where
  a float needs a dot (`1.0e-3`), and reads it as the string '1e-3'.
- A syntax error: PyYAML's message spans several lines and names the file "<unicode string>";
  both loaders give `FILE:LINE:COL: problem` on one line instead."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml


class Loader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-3 and 2E6 as floats, from tables of its own (below)."""


# SafeLoader's tables are process-wide dicts that other libraries change in place: lm-format-enforcer,
# which vLLM imports when it checks a structured-output request, makes every date text, so that a
# pool's `2026-13-45` was then accepted as text. Loader's are its own, built from SafeConstructor's
# methods rather than copied, so that a constructor changed before this import is not taken over
# either (the implicit resolvers, below, are copied as they are at import).
_SAFE_TYPES = ("null", "bool", "int", "float", "binary", "timestamp", "omap", "pairs", "set", "str", "seq", "map")
Loader.yaml_constructors = {None: yaml.SafeLoader.construct_undefined,
                            **{f"tag:yaml.org,2002:{t}": getattr(yaml.SafeLoader, f"construct_yaml_{t}")
                               for t in _SAFE_TYPES}}
Loader.yaml_multi_constructors = {}
Loader.yaml_path_resolvers = {}
# the resolvers are copied, list by list, as add_implicit_resolver copies them for a subclass
Loader.yaml_implicit_resolvers = {first: list(found)
                                  for first, found in yaml.SafeLoader.yaml_implicit_resolvers.items()}
Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                             list("-+0123456789"))


def load(text: str):
    """The document, as SafeLoader would read it but with `1e-3` a number."""
    return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader)


class Item(str):
    """A list item in a key path, written as pool messages name it: `[0]`, or `[0] (id)` when the
    item is a mapping with an `id` (`workers[0] (small).price`, not `workers.0.price`)."""


def _item(i: int, node: yaml.Node) -> Item:
    if isinstance(node, yaml.MappingNode):
        for k_node, v_node in node.value:
            if isinstance(k_node, yaml.ScalarNode) and k_node.value == "id" and isinstance(v_node, yaml.ScalarNode):
                return Item(f"[{i}] ({v_node.value})")
    return Item(f"[{i}]")


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
            if (found := duplicate_key(v, key + (_item(i, v),))) is not None:
                return found
    return None


def message(found: tuple[tuple, int, int]) -> str:
    key, first, second = found
    path = "".join(part if isinstance(part, Item) or not n else f".{part}" for n, part in enumerate(key))
    return f"{path}: given twice (lines {first} and {second}); keep one"


def syntax_error(text: str, e: yaml.YAMLError) -> tuple[str, str]:
    """(`:LINE:COL` or "", the problem on one line), for `FILE:LINE:COL: ...` as editors jump to it;
    PyYAML's own text spans several lines and calls the file "<unicode string>". The context
    (what was being read, from where) follows, since for an unclosed quote the problem is at
    the end of the file."""
    if isinstance(e, yaml.reader.ReaderError):  # a control character: it has a position, not a mark
        line = text.count("\n", 0, e.position) + 1
        column = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
        char = e.character if isinstance(e.character, int) else ord(e.character)
        return f":{line}:{column}", f"unacceptable character #x{char:04x}: {e.reason}"
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is None or not problem:
        return "", " ".join(str(e).split())
    context, at = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context:
        problem += f" ({context}" + (f" that starts at line {at.line + 1}, column {at.column + 1}" if at else "") + ")"
    return f":{mark.line + 1}:{mark.column + 1}", problem


def read_file(path: Path, what: str, error: type[Exception]) -> tuple[Any, yaml.Node | None]:
    """A pool or job file's document and node tree (for line numbers); a missing, unreadable
    or invalid file, or a key given twice, is an `error` naming `what` and the file."""
    if not path.exists():
        if path.is_symlink():  # "not found" would send the user looking for a file that is there
            raise error(f"{what} {path}: a symlink to {os.readlink(path)}, which cannot be followed "
                        f"(its target is missing, or the links form a loop)")
        raise error(f"{what} {path}: not found")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else (e.strerror or type(e).__name__)
        raise error(f"{what} {path}: cannot read it ({why})") from None
    try:
        data = load(text)
        node = yaml.compose(text, Loader=Loader)
        twice = duplicate_key(node)  # walks the nodes: an alias of itself (a: &a [*a]) never ends
    except yaml.YAMLError as e:
        where, problem = syntax_error(text, e)
        raise error(f"{what} {path}{where}: not valid YAML: {problem}") from None
    except (ValueError, RecursionError) as e:  # a date such as 2026-13-45, a 5,000-digit integer, deep nesting
        if isinstance(e, RecursionError):
            raise error(f"{what} {path}: a value cannot be read: nested too deep, or an alias inside itself") from None
        why = str(e).split("\n")[0].split(";")[0]
        where, hint = "", ""
        if (bad := _unreadable_scalar(text)) is not None:
            where = f":{bad.start_mark.line + 1}:{bad.start_mark.column + 1}"
            hint = " (YAML reads it as a date; quote it to keep it as text)" if bad.tag.endswith("timestamp") else ""
        raise error(f"{what} {path}{where}: a value cannot be read: {why}{hint}") from None
    if twice is not None:
        raise error(f"{what} {path}:{twice[2]}: {message(twice)}")
    return data, node


def _unreadable_scalar(text: str) -> yaml.ScalarNode | None:
    """The first plain value YAML resolves to a type it then cannot build (a date such as
    2026-13-45, a 5,000-digit integer), for its line: PyYAML's ValueError has no position."""
    try:
        root = yaml.compose(text, Loader=Loader)
    except (yaml.YAMLError, RecursionError):
        return None
    builder = Loader("")
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.ScalarNode):
            try:
                builder.construct_object(node)
            except ValueError:
                return node
        elif isinstance(node, yaml.MappingNode):
            stack.extend(v for pair in reversed(node.value) for v in reversed(pair))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(reversed(node.value))
    return None


def shown_value(value: Any) -> str:
    """A value of a file or a planner's reply for a message, cut when long (a 400-digit number, a
    runaway string): a runaway value must not make a runaway message. Text keeps 40 characters,
    quoted and closed; anything else, the first 20 of its repr."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value):,} characters)"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text):,} characters)"
