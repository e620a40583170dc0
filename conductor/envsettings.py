"""Settings read from environment variables: a value that does not parse or is out of range
is refused naming the variable and what it takes, before anything is paid for."""

from __future__ import annotations

import os
from typing import Callable, Mapping

from conductor.errors import ConductorError


def env_number(env: Mapping[str, str] | None, name: str, default, allowed: str, ok: Callable[[float], bool],
               kind: type = float):
    """env[name] (default: os.environ) as a number (`default` when unset or empty); a bad value is an
    error naming the variable, its value and what is `allowed`, not a bare ValueError from deep in
    the loader."""
    raw = (os.environ if env is None else env).get(name, "")
    if not raw.strip():
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ConductorError(f"{name}={raw!r}: expected {allowed}")
    return value
