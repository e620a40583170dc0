"""The governor's and the shared cache's URLs: where they come from, what is refused
before any use, and how they are shown (never with a password, nor a piece of one).

redis-py reads a URL with urllib: a password holding an unencoded `@`, `#`, `/` or `?`
is cut at that character, the rest is taken for the host, and its errors then quote
that piece ("Error -2 connecting to ss:6379"). A bad port or database number raised a
bare ValueError. So every such URL is refused here, before a client is made.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import parse_qsl

from conductor.errors import ConductorError
from conductor.pool import GOVERNOR_SCHEMES as SCHEMES
from conductor.pool import redact_url as redact
from conductor.execute.call import CallFailure

ENV = "CONDUCTOR_GOVERNOR"
CACHE_ENV = "CONDUCTOR_CACHE"
REDIS_SCHEMES = ("redis", "rediss")
# In every GovernorUnavailable message: the journal tells by it a plan that failed before its call left.
NOT_SENT = "the call was not sent"
EXAMPLE = "e.g. redis://127.0.0.1:6379/0, or redis://:PASSWORD@HOST:6379/0"
# Query parameters redis-py takes from a URL and passes on to its connections (any other is a
# TypeError at the first connection); rediss:// takes the ssl_ ones too.
QUERY = {"db", "password", "username", "client_name", "socket_timeout", "socket_connect_timeout",
         "socket_keepalive", "health_check_interval", "protocol", "max_connections", "timeout"}
SSL_QUERY = {"ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile",
             "ssl_check_hostname", "ssl_min_version", "ssl_ciphers", "ssl_password"}
_PORT = re.compile(r"[0-9]{1,5}")
_DB = re.compile(r"/?|/[0-9]{1,9}")


class SharedURLError(ConductorError):
    """A governor or cache URL that cannot be used as written, or whose server refuses its
    password or database number: a configuration error, found before any call."""


class GovernorDown(ConductorError):
    """The shared governor cannot be reached before the run: it holds the rate limits and
    budgets, so the run cannot go on without it; nothing was called."""


def governor_source() -> str:
    """Where the governor URL comes from, as messages name it."""
    return f"environment variable {ENV}" if os.environ.get(ENV) else "the pool file's `governor:`"


def governor_url(pool_value: str | None) -> str:
    """The environment wins over the pool file, so one pool file serves a laptop and a cluster."""
    url = os.environ.get(ENV) or pool_value or "memory://"
    check(url, governor_source())
    return url


def check(url: str, where: str, schemes: tuple[str, ...] = SCHEMES) -> None:
    """Refuse a URL with another scheme, or a redis:// one redis-py would misread."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in schemes:
        starts = ", ".join(f"{s}://" for s in schemes[:-1]) + f" or {schemes[-1]}://"
        raise SharedURLError(f"{where}: URL {shown_redis(url)!r} must start with {starts} ({EXAMPLE})")
    if scheme in REDIS_SCHEMES:
        check_redis(url, where)


def check_redis(url: str, where: str) -> None:
    """A redis:// or rediss:// URL as redis-py reads it: its user part, host, port, database
    number and query. Messages show the URL masked, never a value from its user part."""
    shown = f"{where}: Redis URL {shown_redis(url)!r}"
    scheme, _, rest = url.partition("://")
    userinfo, at, tail = rest.rpartition("@")
    if at and any(c in userinfo for c in "@#/?"):
        raise SharedURLError(f"{shown}: its password or user name holds a character that must be "
                             f"percent-encoded: write @ as %40, # as %23, / as %2F and ? as %3F")
    if "#" in tail:
        raise SharedURLError(f"{shown} holds a '#': a Redis URL has no fragment; in a password, write # as %23")
    cut = min((i for i in (tail.find("/"), tail.find("?")) if i >= 0), default=len(tail))
    hostport, rest = tail[:cut], tail[cut:]
    path, _, query = rest.partition("?")
    _check_host(hostport, shown)
    if not _DB.fullmatch(path):
        raise SharedURLError(f"{shown}: the database must be a whole number after the host, as in "
                             f"redis://HOST:6379/0")
    _check_query(query, scheme, shown)


def shown_redis(url: str) -> str:
    """As redact, with the value of any query parameter a Redis client does not take masked too: a
    misspelt `pasword=` is not known for a secret by its name. A piece without `=` is masked whole."""
    head, q, query = redact(url).partition("?")
    if not q:
        return head
    known = QUERY | SSL_QUERY
    pieces = [p if p.partition("=")[0] in known else f"{p.partition('=')[0]}=***" if "=" in p else "***"
              for p in query.split("&")]
    return f"{head}?{'&'.join(pieces)}"


def _check_host(hostport: str, shown: str) -> None:
    if hostport.startswith("["):  # an IPv6 address: [::1]:6379
        end = hostport.find("]")
        host, port = hostport[:end + 1], hostport[end + 1:]
        if end < 0 or (port and not port.startswith(":")):
            raise SharedURLError(f"{shown}: its IPv6 address must be in brackets, as in redis://[::1]:6379/0")
        port = port[1:] if port else None
    else:
        host, colon, port = hostport.partition(":")
        port = port if colon else None
    if not host:
        raise SharedURLError(f"{shown} names no host ({EXAMPLE})")
    if port is not None and not (_PORT.fullmatch(port) and 1 <= int(port) <= 65535):
        raise SharedURLError(f"{shown}: the port after the host must be a number from 1 to 65535")


def _check_query(query: str, scheme: str, shown: str) -> None:
    """Known parameters only, each with a value redis-py can read; a value is never shown, nor the
    name of a parameter after a secret one (an unencoded & in a password makes its tail one)."""
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS as PARSERS

    known = QUERY | SSL_QUERY if scheme == "rediss" else QUERY
    secret_before = False
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in known:
            what = "a parameter" if secret_before else f"parameter {name!r}"
            raise SharedURLError(f"{shown}: {what} in its query is not one a Redis client takes (it takes "
                                 f"{', '.join(sorted(QUERY))}; rediss:// also ssl_*); in a password, write & as %26")
        secret_before = secret_before or name in ("password", "ssl_password")
        parser = PARSERS.get(name)
        try:
            if parser is not None:
                parser(value)
        except (TypeError, ValueError):
            raise SharedURLError(f"{shown}: the value of {name!r} in its query is not valid "
                                 f"({'a whole number' if parser is int else 'see the redis-py docs'})") from None


def cache_setting() -> str | None:
    """CONDUCTOR_CACHE, checked: a redis:// or rediss:// URL, or a SQLite file in a folder that exists."""
    value = os.environ.get(CACHE_ENV)
    if value:
        check_cache(value)
    return value or None


def check_cache(value: str, where: str = f"environment variable {CACHE_ENV}") -> None:
    """A value with `://` must be a Redis URL (http://... or a typo was taken for a file name);
    a path must name a file (not a folder) in a folder that exists (it was created silently)."""
    if "://" in value:
        if value.partition("://")[0] not in REDIS_SCHEMES:
            raise SharedURLError(f"{where}: {shown_redis(value)!r} is not a redis:// or rediss:// URL; it takes "
                                 f"one of those ({EXAMPLE}) or the path of a SQLite file")
        check(value, where, REDIS_SCHEMES)
        return
    path = Path(value)
    if path.is_dir():
        raise SharedURLError(f"{where}: {value} is a folder; name a file in it for the response cache "
                             f"(e.g. {path / 'cache.sqlite'})")
    if not path.parent.is_dir():
        raise SharedURLError(f"{where}: the folder {path.parent} of the response cache {value} does not "
                             f"exist; create it, or name a file in a folder that exists")


def refusal(error: BaseException, url: str | None = None) -> str | None:
    """What the Redis server refused in the URL `url` (its password or user, its database number),
    or None when the error is one of reaching it (down, hung, the network)."""
    from urllib.parse import parse_qs, urlsplit

    from redis.exceptions import (AuthenticationError, AuthenticationWrongNumberOfArgsError,
                                  NoPermissionError, ResponseError)

    if isinstance(error, (AuthenticationError, AuthenticationWrongNumberOfArgsError)):
        parts = urlsplit(url) if url is not None else None
        if parts is not None and not parts.password and not parse_qs(parts.query).get("password"):
            # no password was given, so none was wrong
            return ("a login without a password (the server requires one and the URL gives none: "
                    "redis://:PASSWORD@HOST:PORT/DB)")
        return "the password or user name"
    if isinstance(error, NoPermissionError):
        return "the user name (its user may not run conductor's commands)"
    if isinstance(error, ResponseError) and "db index" in str(error).lower():
        return "the database number"
    return None


def failed_on_governor(error: str | None) -> bool:
    """Whether a step's or plan's error is a GovernorUnavailable's: its call was never sent."""
    return bool(error) and "shared governor " in error and NOT_SENT in error


def governor_failure_kind(error: str | None) -> str | None:
    """For a GovernorUnavailable's message: "refused" (its URL's password, user or database)
    or "unreachable"; None for any other error. Read from the message, as the journal keeps it."""
    if not failed_on_governor(error):
        return None
    return "refused" if re.search(r"shared governor \S+ refused ", error) else "unreachable"


class GovernorUnavailable(CallFailure):
    """The shared governor could not be used: the call was not sent. Unreachable, it is retried
    like a connection error, then failed as a transient failure that a rerun retries. Refused (a
    wrong password or database number: `refused` says which) it is not retried in the run: every
    attempt would fail alike. Neither uses up a rerun (journal.not_sent)."""

    def __init__(self, url: str, error: BaseException):
        why = str(error) or type(error).__name__
        self.refused = refusal(error, url)
        if self.refused:
            msg = (f"shared governor {redact(url)} refused {self.refused} in its URL ({why}); {NOT_SENT}; "
                   f"fix the URL ({governor_source()}) and rerun the same command")
        else:
            msg = (f"shared governor {redact(url)} unreachable ({why}); {NOT_SENT}; "
                   f"rerun the same command once the server is back")
        super().__init__("connection", msg)

    @property
    def retryable(self) -> bool:
        return not self.refused
