"""Secret values kept out of every message conductor writes.

A provider or a gateway may echo the request's headers in an error, and litellm
reads keys such as OPENAI_API_KEY from the environment without handing them to
us. So a message is masked against the keys its caller passes and against every
environment variable whose name says it holds a secret, including a piece of a
key left at the edge of a message that was cut.
"""

from __future__ import annotations

import os
import re

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
MIN_ENV_SECRET = 8  # shorter values of such variables (flags, "true") would mask ordinary words
MIN_SECRET = 4
MIN_PIECE = 6  # the shortest piece of a key masked where a message was cut


def env_secrets() -> list[str]:
    """Values of the environment variables named like secrets (`*_API_KEY`, `*_TOKEN`,
    `*PASSWORD*`...); read on every call, so a key set after start-up is covered."""
    return [v for k, v in os.environ.items()
            if len(v) >= MIN_ENV_SECRET and SECRET_NAME.search(k) and not v.startswith(("/", "./", "~"))]


def mask(text: str, *secrets: str | None) -> str:
    """`text` with every secret (those given and `env_secrets()`) replaced by ***, and
    a secret's first or last characters at either end of it (a cut) as well."""
    if not text:
        return text
    for s in sorted({s for s in (*secrets, *env_secrets()) if s and len(s) >= MIN_SECRET}, key=len, reverse=True):
        if s in text:
            text = text.replace(s, "***")
        if text[-MIN_PIECE:] in s:  # else no piece of s ends the text: skip the search
            for k in range(min(len(s) - 1, len(text)), MIN_PIECE - 1, -1):
                if text.endswith(s[:k]):
                    text = text[:-k] + "***"
                    break
        if text[:MIN_PIECE] in s:
            for k in range(min(len(s) - 1, len(text)), MIN_PIECE - 1, -1):
                if text.startswith(s[-k:]):
                    text = "***" + text[k:]
                    break
    return text


def looks_like_a_key(name: str) -> bool:
    """True for a value pasted where the NAME of a variable belongs (`api_key_env:
    gsk_9f8e...`): names are words in capitals, keys long runs of mixed case and digits."""
    digits = sum(c.isdigit() for c in name)
    if "_" not in name and len(name) >= 16 and digits >= 3 and not SECRET_NAME.search(name):  # AKIA... (AWS)
        return True
    return len(name) >= 20 and any(c.islower() for c in name) and digits >= 3
