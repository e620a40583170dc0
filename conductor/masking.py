"""Secret values kept out of every message conductor writes.

A provider or a gateway may echo the request's headers in an error, and litellm
reads keys such as OPENAI_API_KEY from the environment without handing them to
us. So a message is masked against the keys its caller passes and against every
environment variable whose name says it holds a secret, including a piece of a
key left at the edge of a message that was cut.

A server echoes a key as it saw it, not always as we sent it: in a URL or a form
body (`%2F`, `%2B`, `+`), in JSON written by a serializer that escapes `/` as `\\/`,
or inside a Basic-auth header (base64 of `user:key`). So each key is masked in
those forms too (audit63 F1: a `%2F` form of a key reached every output).
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
from urllib.parse import quote, quote_plus

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
MIN_ENV_SECRET = 8  # shorter values of such variables (flags, "true") would mask ordinary words
MIN_SECRET = 4
MIN_PIECE = 6  # the shortest piece of a key masked where a message was cut
B64_RUN = re.compile(r"[A-Za-z0-9+/_-]+={0,2}")  # standard or URL-safe base64
URLSAFE, STANDARD = str.maketrans("+/", "-_"), str.maketrans("-_", "+/")


def env_secrets() -> list[str]:
    """Values of the environment variables named like secrets (`*_API_KEY`, `*_TOKEN`,
    `*PASSWORD*`...); read on every call, so a key set after start-up is covered."""
    return [v for k, v in os.environ.items()
            if len(v) >= MIN_ENV_SECRET and SECRET_NAME.search(k) and not v.startswith(("/", "./", "~"))]


@functools.lru_cache(maxsize=256)
def echoed_forms(s: str) -> tuple[str, ...]:
    """`s` and the forms a server may echo it in: percent-encoded (with `/` kept or not,
    hex in either case), form-encoded, JSON-escaped (`\\/` or not). Base64 is another matter
    (`_mask_base64`): in `user:key` the key's letters depend on the length of the user."""
    forms = {s}
    for q in (quote(s, safe=""), quote(s), quote_plus(s)):
        forms |= {q, re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), q)}
    j = json.dumps(s)[1:-1]
    forms |= {j, j.replace("/", "\\/")}
    return tuple(forms)


@functools.lru_cache(maxsize=256)
def base64_cores(s: str) -> tuple[str, ...]:
    """The letters every base64 text holding `s` shows, whatever comes before it (`user:`)
    or after: one string for each of the 3 byte offsets `s` may start at, standard and URL-safe."""
    cores = set()
    for o in range(3):
        enc = base64.b64encode(b"\0" * o + s.encode()).decode()
        core = enc[-(-8 * o // 6):8 * (o + len(s.encode())) // 6]  # letters of s's bits alone
        cores |= {core, core.translate(URLSAFE)}
    return tuple(cores)


def mask(text: str, *secrets: str | None) -> str:
    """`text` with every secret (those given and `env_secrets()`) replaced by ***, in the
    forms of `echoed_forms` and in base64, and a secret's first or last characters at
    either end of it (a cut) as well."""
    if not text:
        return text
    keys = {s for s in (*secrets, *env_secrets()) if s and len(s) >= MIN_SECRET}
    for s in sorted({f for k in keys for f in echoed_forms(k)}, key=len, reverse=True):
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
    return _mask_base64(text, keys) if keys else text


def _mask_base64(text: str, keys: set[str]) -> str:
    """`text` with every base64 run that decodes to a key (`Basic dXNlcjpzay0...`) replaced
    by ***. Runs are decoded only when the text holds one of the key's `base64_cores`, at
    each of the 4 alignments (a run may start with other letters, such as `Basic`)."""
    found = [k for k in keys if any(c in text for c in base64_cores(k))]
    if not found:
        return text
    wanted = [k.encode() for k in found]

    def hides_a_key(run: str) -> bool:
        run = run.rstrip("=").translate(STANDARD)
        for start in range(4):
            part = run[start:]
            part = part[:len(part) - 1] if len(part) % 4 == 1 else part + "=" * (-len(part) % 4)
            if any(w in base64.b64decode(part) for w in wanted):
                return True
        return False

    return B64_RUN.sub(lambda m: "***" if hides_a_key(m.group()) else m.group(), text)


def looks_like_a_key(name: str) -> bool:
    """True for a value pasted where the NAME of a variable belongs (`api_key_env:
    gsk_9f8e...`): names are words in capitals, keys long runs of mixed case and digits."""
    digits = sum(c.isdigit() for c in name)
    if "_" not in name and len(name) >= 16 and digits >= 3 and not SECRET_NAME.search(name):  # AKIA... (AWS)
        return True
    return len(name) >= 20 and any(c.islower() for c in name) and digits >= 3
