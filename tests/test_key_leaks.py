"""Keys echoed back by a provider never reach an output, whatever path the message
takes: litellm's own environment keys, refusals, batch-API errors, bodies cut in the
middle of a key, the preflight's model list and its redirects, and URLs with
passwords. Each case is a way a key did leak (audit of 2026-11-27)."""

from __future__ import annotations

import secrets

import orjson
import pyarrow.parquet as pq
import pytest

from conductor.errors import ConductorError
from conductor.runner import RunConfig, run_all
from tests.conftest import run_cli, worker, write_pool
from tests.fakehttp import LoopbackServer, QuietHandler
from tests.test_executor import FixedPlanner, solve

# Not named like a secret, so only the code that knows the pool's key can mask it.
KEY_ENV = "CONDUCTOR_TEST_PROVIDER_A"


def _key() -> str:
    return "gsk_TESTxLEAK" + secrets.token_hex(12)


class EchoServer(LoopbackServer):
    """An OpenAI-compatible endpoint that repeats the request's Authorization header back,
    in the place the first segment of the path names (`/<mode>/v1/...`)."""

    def __init__(self, redirect_to: str | None = None):
        self.auth_seen: list[str] = []
        outer = self

        class Handler(QuietHandler):
            def do_GET(self):
                outer.auth_seen.append(self.headers.get("Authorization") or "")
                mode = self.path.split("/")[1]
                auth = self.headers.get("Authorization") or ""
                if mode == "redirect":
                    self.send_response(307)
                    self.send_header("Location", f"{redirect_to}/models")
                    self.send_header("content-length", "0")
                    self.end_headers()
                elif mode in ("listed", "modelsecho"):
                    ids = ["m"] if mode == "listed" else ["zzz " + auth]
                    self.send(200, {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]})
                else:
                    self.send(404, {"error": {"message": "no /models here"}})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                mode = self.path.split("/")[1]
                auth = self.headers.get("Authorization") or ""
                if mode == "e400":  # a JSON error that repeats the headers
                    return self.send(400, {"error": {"message": f"bad request; you sent {auth}"}})
                if mode == "refusal":  # no content; the refusal repeats the headers
                    return self.send(200, {"id": "x", "object": "chat.completion", "model": "m", "choices": [
                        {"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": None, "refusal": f"I cannot use {auth}"}}]})
                if mode == "page200":  # a gateway page: the key straddles the 200 characters kept
                    return self.send(200, "p" * 173 + auth + " end")
                if mode == "big400":  # over 64 KiB: the key straddles the 1000 characters kept
                    return self.send(400, {"error": {"message": "q" * 950 + auth + "y" * 70_000}})
                return self.send(404, {"error": {"message": "no such mode"}})

        super().__init__(Handler)

    def base(self, mode: str) -> str:
        return f"{self.root}/{mode}/v1"


@pytest.fixture
def echo():
    with EchoServer() as s:
        yield s


def _pieces(key: str, n: int = 10) -> list[str]:
    """Every run of n characters of the key: a key cut in two leaks as a piece."""
    return [key[i:i + n] for i in range(len(key) - n + 1)]


def _leaks(key: str, *texts: str, folder=None) -> list[str]:
    """Where any piece of the key shows: the texts given, and every file of `folder`
    (Parquet read cell by cell, as compression would hide a piece from a byte search)."""
    seen = list(texts)
    for p in sorted(folder.rglob("*")) if folder else ():
        if p.is_file():
            seen.append(str(pq.read_table(p).to_pylist()) if p.suffix == ".parquet" else
                        p.read_bytes().decode("utf-8", "replace"))
    return [piece for piece in _pieces(key) if any(piece in t for t in seen)]


def _run(tmp_path, pool, mode: str, n: int = 2):
    cfg = RunConfig(queries=_queries(tmp_path, n), pool=pool, data_dir=tmp_path / "data", progress=False)
    summary = run_all(cfg, planner=FixedPlanner(solve(mode)))
    out = tmp_path / "data" / "runs" / summary["run_id"]
    return summary, pq.read_table(out / "traces.parquet").to_pylist()


def _queries(tmp_path, n):
    from tests.conftest import SAMPLE

    path = tmp_path / f"q{n}.parquet"
    pq.write_table(pq.read_table(SAMPLE).slice(0, n), path)
    return path


def _pool(tmp_path, echo, where: str, **provider):
    w = worker(where, echo.base(where))
    w["model"] = "openai/m"
    return write_pool(tmp_path / "pool.yaml", echo.base(where), workers=[w],
                      providers={"sim": {"api_key_env": KEY_ENV, "timeout_s": 10, **provider}})


@pytest.mark.parametrize("mode", ["refusal", "page200", "big400"])
def test_a_key_echoed_by_the_provider_is_masked_in_every_output(tmp_path, echo, mode, monkeypatch):
    """A refusal's text was written as sent; a body cut before redaction kept the piece
    of the key before the cut (26 of 30 characters)."""
    key = _key()
    monkeypatch.setenv(KEY_ENV, key)
    summary, traces = _run(tmp_path, _pool(tmp_path, echo, mode), mode)
    assert summary["statuses"] == {"error": 2}
    assert "***" in traces[0]["error"], traces[0]["error"]
    assert _leaks(key, str(summary), folder=tmp_path / "data") == []


def test_a_key_litellm_reads_from_the_environment_is_masked(tmp_path, echo, monkeypatch):
    """A provider with no api_key_env: litellm sends OPENAI_API_KEY itself, so no code
    that masked the provider's key knew it, and a 400 repeating it was stored whole."""
    key = "sk-" + _key()
    monkeypatch.setenv("OPENAI_API_KEY", key)
    monkeypatch.setenv("OPENAI_API_BASE", echo.base("e400"))
    pool = write_pool(tmp_path / "pool.yaml", "", workers=[{"id": "e400", "model": "openai/gpt-4o-mini"}],
                      providers={"openai": {"timeout_s": 10}})
    summary, traces = _run(tmp_path, pool, "e400")
    assert summary["statuses"] == {"error": 2} and "Bearer ***" in traces[0]["error"], traces[0]["error"]
    assert _leaks(key, str(summary), folder=tmp_path / "data") == []


def test_batch_api_errors_never_hold_the_key(tmp_path, echo, monkeypatch):
    """Errors of the batch API's own calls (the file upload here) were not redacted at all."""
    key = _key()
    monkeypatch.setenv(KEY_ENV, key)
    pool = _pool(tmp_path, echo, "e400", mode="batch", batch_poll_s=0.2)
    summary, traces = _run(tmp_path, pool, "e400")
    assert summary["statuses"] == {"error": 2}
    assert "could not upload the batch input file" in traces[0]["error"] and "***" in traces[0]["error"]
    assert _leaks(key, str(summary), folder=tmp_path / "data") == []


def test_mask_hides_keys_pieces_at_a_cut_and_secret_named_variables(monkeypatch):
    from conductor.masking import mask

    key, env_key = _key(), _key()
    monkeypatch.setenv("SOME_SERVICE_TOKEN", env_key)
    monkeypatch.setenv("SHORT_TOKEN", "true")  # too short to be a secret: words stay
    assert mask(f"a {key} b {env_key} c true", key) == "a *** b *** c true"
    assert mask(f"cut here: Bearer {key[:20]}", key) == "cut here: Bearer ***"
    assert mask(f"{env_key[7:]} and on") == "*** and on"
    assert mask(key[:12], key) == "***"
    assert mask("gsk_ is a prefix, gsk_TESTx too", key) == "gsk_ is a prefix, gsk_TESTx too"


def test_batch_error_lines_are_masked():
    from conductor.execute.batchfiles import line_result

    key = _key()
    rows = [{"custom_id": "a", "response": {"status_code": 400, "body": {"error": {"message": f"sent {key}"}}}},
            {"custom_id": "b", "error": {"code": "invalid", "message": f"sent Bearer {key}"}},
            {"custom_id": "c", "response": {"status_code": 200, "body": {"choices": [
                {"message": {"content": None, "refusal": f"no: {key}"}}]}}}]
    for row in rows:
        failure = line_result(row, None, key)
        assert key not in str(failure) and "***" in str(failure), str(failure)


def test_the_preflight_neither_prints_nor_forwards_the_key(tmp_path, monkeypatch):
    """Its model list was printed as served (a list repeating the key printed it), and
    urllib passed Authorization along a redirect to another origin."""
    key = _key()
    monkeypatch.setenv(KEY_ENV, key)
    with EchoServer() as other, EchoServer(redirect_to=other.base("listed")) as echo:
        summary, _ = _run(tmp_path, _pool(tmp_path, echo, "redirect"), "redirect")  # the model is listed there
        assert other.auth_seen == [""]  # the key stayed at the origin it was meant for
        assert summary["statuses"] == {"error": 2}
        with pytest.raises(ConductorError) as caught:
            _run(tmp_path, _pool(tmp_path, echo, "modelsecho"), "modelsecho")
    assert "does not serve model 'm'" in str(caught.value) and "Bearer ***" in str(caught.value)
    assert _leaks(key, str(caught.value)) == []


def test_passwords_in_governor_and_store_urls_are_never_shown(tmp_path, sample_queries, fresh_sim):
    from conductor.pool import redact_url

    assert redact_url("redis://127.0.0.1:1/0?password=Pw0rdSECRET77&db=2") == \
        "redis://127.0.0.1:1/0?password=***&db=2"
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    down = run_cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet",
                   env={"CONDUCTOR_GOVERNOR": "redis://127.0.0.1:9/0?password=Pw0rdSECRET77"})
    assert down.returncode != 0 and "password=***" in down.stdout + down.stderr, down.stderr
    store = run_cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet",
                    "--store", "s3://AKIAEXAMPLEACCESS:S3cretAccessKEY42@runs/dev")
    assert store.returncode == 2 and "credentials in it" in store.stderr and "Traceback" not in store.stderr
    token = run_cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet",
                    "--store", "s3://runs/dev?token=TokSECRET9931")  # was echoed, and then ignored
    assert token.returncode == 2 and "with a query or fragment" in token.stderr, token.stderr
    found = down.stdout + down.stderr + store.stdout + store.stderr + token.stdout + token.stderr
    found += "".join(p.read_bytes().decode("utf-8", "replace") for p in (tmp_path / "data").rglob("*.json*"))
    assert "Pw0rdSECRET77" not in found and "S3cretAccessKEY42" not in found and "AKIAEXAMPLE" not in found
    assert "TokSECRET9931" not in found


@pytest.mark.parametrize("upper", [False, True], ids=["mixed-case", "AWS-style capitals"])
def test_a_key_pasted_in_place_of_a_variable_name_is_refused_unshown(tmp_path, sample_queries, upper):
    key = "AKIA" + secrets.token_hex(8).upper() if upper else _key()  # AKIA...: once taken for a name, echoed
    pool = tmp_path / "pool.yaml"
    pool.write_text(f"providers:\n  p: {{api_key_env: {key}}}\nworkers:\n"
                    f"  - {{id: w, model: openai/m, provider: p, api_base: 'http://127.0.0.1:9/v1'}}\n")
    r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data")
    assert r.returncode == 2 and "providers.p.api_key_env: must be the NAME" in r.stderr, r.stderr
    assert _leaks(key, r.stdout, r.stderr) == []


@pytest.mark.parametrize("var", ["GW_TOKEN", "MYSIM_AUTH"])
def test_a_token_expanded_into_api_base_is_never_shown(tmp_path, echo, sample_queries, var):
    """The summary's "failures by worker" printed the endpoint as expanded (audit 26); then it was
    masked only when the variable was named like a secret (audit50 F1: MYSIM_AUTH, the provider's
    own key, in the summary, the manifest and the catalog). Such a variable now shows its name."""
    token = "gwtok" + secrets.token_hex(10)
    pool = tmp_path / "pool.yaml"
    pool.write_text(f"providers:\n  gw: {{timeout_s: 10, max_attempts: 1, api_key_env: {var}}}\nworkers:\n"
                    f"  - {{id: w, model: openai/m, provider: gw, api_base: '{echo.root}/e400/${{{var}}}/v1',\n"
                    "     price: {input_per_mtok: 1, output_per_mtok: 1}}\n")
    r = run_cli("run", _queries(tmp_path, 3), "--pool", pool, "--data-dir", tmp_path / "data", "--quiet",
                env={var: token})
    assert r.returncode == 4 and f"/e400/${{{var}}}/v1" in r.stdout, r.stdout + r.stderr
    assert _leaks(token, r.stdout, r.stderr, folder=tmp_path / "data") == []

    pool.write_text(f"providers:\n  gw: {{api_key_env: {var}}}\n"
                    f"workers:\n  - {{id: w, model: openai/m, provider: gw, api_base: '${{{var}}}'}}\n")
    r = run_cli("run", _queries(tmp_path, 3), "--pool", pool, "--data-dir", tmp_path / "data2", env={var: token})
    assert r.returncode == 2 and f"must start with http:// or https:// (got '${{{var}}}')" in r.stderr, r.stderr
    assert _leaks(token, r.stdout, r.stderr) == []


def test_a_token_typed_into_a_planner_url_is_masked_in_the_manifest(tmp_path, sample_queries, fresh_sim):
    """`--planner-option api_base=...` was kept as typed in manifest.json (audit 26). The endpoint
    answers (the preflight refuses an unreachable one before the run folder), but not at that
    path, so planning fails after the manifest is written."""
    token = "plntok" + secrets.token_hex(10)
    pool = write_pool(tmp_path / "pool.yaml", fresh_sim.url)
    port = fresh_sim.url.rsplit(":", 1)[1].split("/")[0]
    r = run_cli("run", sample_queries, "--pool", pool, "--data-dir", tmp_path / "data", "--quiet", "--planner", "llm",
                "--planner-option", "model=openai/planner",
                "--planner-option", f"api_base=http://me:{token}@127.0.0.1:{port}/v1?api_key={token}")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    (manifest,) = (tmp_path / "data" / "runs").glob("*/manifest.json")
    shown = orjson.loads(manifest.read_bytes())["inputs"]["planner_options"]
    assert shown == {"model": "openai/planner", "api_base": f"http://me:***@127.0.0.1:{port}/v1?api_key=***"}
    assert _leaks(token, r.stdout, r.stderr, folder=tmp_path / "data") == []
