"""The governor's URL: where it comes from, and how it is shown (never with its password)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

from conductor.errors import ConductorError
from conductor.execute.call import CallFailure

ENV = "CONDUCTOR_GOVERNOR"
SCHEMES = ("memory", "redis", "rediss")


def governor_url(pool_value: str | None) -> str:
    """The environment wins over the pool file, so one pool file serves a laptop and a cluster."""
    url = os.environ.get(ENV) or pool_value or "memory://"
    check(url, f"environment variable {ENV}" if os.environ.get(ENV) else "the pool file's governor")
    return url


def check(url: str, where: str) -> None:
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        raise ConductorError(f"{where}: governor URL {redact(url)!r} must start with memory://, redis:// "
                             f"or rediss:// (e.g. redis://127.0.0.1:6379/0)")


def redact(url: str) -> str:
    """The URL with any password replaced by ***, for messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


class GovernorUnavailable(CallFailure):
    """The shared governor could not be reached: the call was not sent. Retried like a
    connection error, then failed as a transient failure that a rerun retries."""

    def __init__(self, url: str, error: BaseException):
        why = str(error) or type(error).__name__
        super().__init__("connection", f"shared governor {redact(url)} unreachable ({why}); the call was not "
                                       f"sent; rerun the same command once the server is back")
