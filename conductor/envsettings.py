"""Settings read from environment variables: a value that does not parse or is out of range
is refused naming the variable and what it takes, before anything is paid for."""

from __future__ import annotations

import os
from typing import Callable, TypeVar

from conductor.errors import ConductorError

T = TypeVar("T")


def env_setting(name: str, default: T, convert: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> T:
    """$name converted, else `default` when unset or blank."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = convert(raw)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ConductorError(f"{name}={raw!r}: expected {expected}")
    return value
