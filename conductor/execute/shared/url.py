"""The governor's URL: where it comes from, and how it is shown (never with its password)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from conductor.errors import ConductorError
from conductor.pool import GOVERNOR_SCHEMES as SCHEMES
from conductor.pool import redact_url as redact
from conductor.execute.call import CallFailure

ENV = "CONDUCTOR_GOVERNOR"


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


class GovernorUnavailable(CallFailure):
    """The shared governor could not be reached: the call was not sent. Retried like a
    connection error, then failed as a transient failure that a rerun retries."""

    def __init__(self, url: str, error: BaseException):
        why = str(error) or type(error).__name__
        super().__init__("connection", f"shared governor {redact(url)} unreachable ({why}); the call was not "
                                       f"sent; rerun the same command once the server is back")
