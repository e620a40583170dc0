"""A key echoed back encoded is masked like a key echoed as sent (audit63 F1): a gateway's
error repeated it URL-encoded (`%2F`, `%2B`), and every output of the run (stdout, traces,
results, summary, manifest, the work/ journal) held it. A key is masked too in the other
forms a server writes a request in: form-encoded, JSON with `\\/`, base64 (Basic auth)."""

from __future__ import annotations

import base64
import json
import secrets
import threading
from http.server import ThreadingHTTPServer
from urllib.parse import quote, quote_plus

import pyarrow.parquet as pq
import pytest

from tests.conftest import SAMPLE, run_cli, write_pool
from tests.fakehttp import LoopbackServer, QuietHandler

KEY_ENV = "CONDUCTOR_TEST_GATEWAY_B"  # not named like a secret: only the pool's own key masks it


def _key() -> str:
    """A key with `/` and `+`, as AWS-style secrets and base64 tokens have."""
    return "sk-T3st/" + secrets.token_hex(8) + "+Leak/" + secrets.token_hex(6)


def _basic(user: str, key: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()


def _forms(key: str) -> dict[str, str]:
    """How a server may write the key back: each must be gone from what conductor writes."""
    return {"as sent": key, "url": quote(key, safe=""), "url, / kept": quote(key), "form": quote_plus(key),
            "url, lower-case hex": quote(key, safe="").replace("%2F", "%2f").replace("%2B", "%2b"),
            "json \\/": key.replace("/", "\\/"), "base64": base64.b64encode(key.encode()).decode(),
            "basic auth": _basic("gateway-user", key).split()[1].rstrip("=")}


def _leaks(key: str, *texts: str, folder=None) -> list[str]:
    """The forms of the key, or runs of 12 characters of one (a cut), found in the texts given
    or any file of `folder` (Parquet read cell by cell: compression hides bytes)."""
    seen = list(texts)
    for p in sorted(folder.rglob("*")) if folder else ():
        if p.is_file():
            seen.append(str(pq.read_table(p).to_pylist()) if p.suffix == ".parquet" else
                        p.read_bytes().decode("utf-8", "replace"))
    return [f"{name}: {form[i:i + 12]}" for name, form in _forms(key).items() for i in range(len(form) - 11)
            if any(form[i:i + 12] in t for t in seen)]


class _OnPortRange(LoopbackServer):
    def __init__(self, handler):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        port = self.httpd.server_address[1]
        self.root = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)


class EncodingEchoServer(_OnPortRange):
    """An OpenAI-compatible gateway whose 400 repeats the caller's key URL-encoded, in a
    Basic-auth header it forwarded upstream, in base64 alone, and in JSON that escapes `/`."""

    def __init__(self):
        class Handler(QuietHandler):
            def do_GET(self):
                self.send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                key = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                upstream = json.dumps({"api_key": key}).replace("/", "\\/")
                self.send(400, {"error": {"type": "invalid_request_error", "message": (
                    f"rejected GET /v1/check?key={quote(key, safe='')}; forwarded Authorization: "
                    f"{_basic('gateway-user', key)}; token {base64.b64encode(key.encode()).decode()}; "
                    f"upstream said {upstream}")}})

        super().__init__(Handler)


def test_a_key_echoed_url_encoded_and_in_base64_reaches_no_output(tmp_path):
    key = _key()
    with EncodingEchoServer() as gw:
        pool = write_pool(tmp_path / "pool.yaml", "", workers=[{
            "id": "w", "model": "openai/m", "provider": "gw", "api_base": f"{gw.root}/v1",
            "price": {"input_per_mtok": 1, "output_per_mtok": 1}}],
            providers={"gw": {"api_key_env": KEY_ENV, "timeout_s": 10, "max_attempts": 1}})
        queries = tmp_path / "q.parquet"
        pq.write_table(pq.read_table(SAMPLE).slice(0, 3), queries)
        r = run_cli("run", queries, "--pool", pool, "--data-dir", tmp_path / "data", env={KEY_ENV: key})
    assert r.returncode == 4, r.stdout + r.stderr  # every plan failed, and the run says so
    assert "rejected GET /v1/check?key=***" in r.stdout + r.stderr, r.stdout + r.stderr
    (run,) = (tmp_path / "data" / "runs").iterdir()
    assert {p.name for p in run.iterdir()} >= {"traces.parquet", "results.parquet", "summary.json", "manifest.json"}
    error = pq.read_table(run / "traces.parquet").to_pylist()[0]["error"]
    assert "key=***;" in error and "Authorization: Basic ***;" in error and "token ***;" in error, error
    assert '"api_key": "***"' in error, error
    assert _leaks(key, r.stdout, r.stderr, folder=tmp_path / "data") == []


@pytest.mark.parametrize("name", ["url", "url, / kept", "url, lower-case hex", "json \\/", "base64"])
def test_mask_hides_a_key_in_the_forms_a_server_echoes(name):
    from conductor.masking import mask

    key = _key()
    assert mask(f"you sent <{_forms(key)[name]}> here", key) == "you sent <***> here"


def test_mask_hides_a_form_encoded_key_and_basic_auth_of_any_user():
    from conductor.masking import mask

    key = "pass word/" + secrets.token_hex(8)  # a space: `+` in a form body
    assert mask(f"body: user=me&password={quote_plus(key)}&next=1", key) == "body: user=me&password=***&next=1"
    for user in ("", "a", "ab", "svc-account@example.com"):  # every alignment of the key in the base64
        for header in (_basic(user, key), _basic(user, key).rstrip("="),
                       "Basic " + base64.urlsafe_b64encode(f"{user}:{key}".encode()).decode()):
            assert mask(f"Authorization: {header}, end", key) == "Authorization: Basic ***, end", header
    # base64 glued to other letters (no space after a prefix) is found at any alignment
    glued = "xyz" + base64.b64encode(f"u:{key}".encode()).decode()
    assert mask(f"auth={glued}", key) == "auth=***"
    # and text without the key is kept: another user's credentials, a JWT, URLs, words
    text = (f"{_basic('other', 'not-the-key-0123456789')} eyJhbGciOiJIUzI1NiJ9.e30 "
            "https://host/v1/chat%2Fcompletions?a=b+c sk-T3st/ and the \\/ path")
    assert mask(text, key) == text


def test_mask_hides_encoded_forms_of_environment_secrets_and_at_a_cut(monkeypatch):
    from conductor.masking import mask

    env_key = _key()
    monkeypatch.setenv("SOME_GATEWAY_TOKEN", env_key)  # no caller names it: read from the environment
    assert mask(f"url ?k={quote(env_key, safe='')}&x") == "url ?k=***&x"
    assert mask(f"h {_basic('me', env_key)}") == "h Basic ***"
    cut = quote(env_key, safe="")[:20]  # a body cut inside the encoded key
    assert mask(f"url ?k={cut}") == "url ?k=***"
