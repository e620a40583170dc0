"""Pool files: what loads, and that every bad field is named in the error."""

import re

import pytest

from conductor.errors import PoolError
from conductor.pool import load_pool, parse_pool


def _pool(**worker):
    return {"workers": [{"id": "w", "model": "openai/w", **worker}]}


def test_full_pool_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_SIM_URL", "http://127.0.0.1:9999/v1")
    f = tmp_path / "pool.yaml"
    f.write_text("""
providers:
  acme: {rpm: 600, tpm: 100000, max_concurrency: 8, budget_usd: 2.5, api_key_env: ACME_KEY}
  anthropic: {}
workers:
  - id: small
    provider: acme
    model: openai/small
    api_base: ${MY_SIM_URL}
    description: cheap
    skills: {math: 0.6, choice: null}
    price: {input_per_mtok: 0.15, output_per_mtok: 0.6}
    params: {temperature: 0, max_tokens: 256}
  - id: tagged
    model: anthropic/claude
    skills: [math, choice]
  - id: vote
    kind: function
""")
    pool = load_pool(f)
    small = pool.worker("small")
    assert small.api_base == "http://127.0.0.1:9999/v1"
    assert small.price.input == pytest.approx(0.15e-6)
    assert small.skill("math") == 0.6 and small.skill("choice") is None
    assert pool.providers["acme"].budget_usd == 2.5
    assert pool.worker("tagged").provider == "anthropic"  # defaults to the model's prefix
    assert pool.worker("vote").function == "vote"
    assert pool.provider_of(small).api_key_env == "ACME_KEY"


@pytest.mark.parametrize("raw, field", [
    ({"workers": []}, "workers: must be a non-empty list"),
    ({"workers": [{"model": "openai/x"}]}, r"workers\[0\].id: required"),
    ({"workers": [{"id": "a", "model": "x"}, {"id": "a", "model": "y"}]}, r"workers\[1\].id: duplicate"),
    (_pool(model=None), r"workers\[0\] \(w\).model: required"),
    (_pool(kind="robot"), r"\.kind: must be one of"),
    (_pool(price={"input_per_mtok": -1, "output_per_mtok": 1}), r"\.price.input_per_mtok: must be at least 0"),
    (_pool(price={"input_per_mtok": 1}), r"\.price.output_per_mtok: required"),
    (_pool(price={"input_per_mtok": 1, "output_per_mtok": 1, "input_per_token": 1}), r"\.price: give prices per token or per million tokens, not both"),
    (_pool(skills={"math": 1.5}), r"\.skills.math: expected accuracy must be a number in \[0, 1\]"),
    (_pool(skills="math"), r"\.skills: must be a list"),
    (_pool(api_base="ftp://x"), r"\.api_base: must start with http"),
    (_pool(api_base="${SURELY_NOT_SET_VAR}"), r"environment variable SURELY_NOT_SET_VAR is not set"),
    (_pool(params={"api_key": "sk-123"}), r"\.params.api_key: not allowed here \(use the provider's api_key_env\)"),
    (_pool(colour="red"), r"workers\[0\] \(w\).colour: unknown field \(allowed: api_base, context_tokens, "
                          r"description, function, id, kind, max_call_usd, model, params, price, provider, "
                          r"simulate, skills, system\)"),  # not the derived api_base_shown
    ({"workers": [{"id": "w", "model": "m", "provider": "p"}], "providers": {"p": {"rpm": 0}}}, r"providers.p.rpm: must be greater than 0"),
    ({"workers": [{"id": "w", "model": "m", "provider": "p"}], "providers": {"p": {"rpm": float("nan")}}},
     r"providers.p.rpm: must be a finite number \(got nan\)"),
    ({"workers": [{"id": "w", "model": "m", "provider": "p"}], "providers": {"p": {"budget_usd": float("inf")}}},
     r"providers.p.budget_usd: must be a finite number \(got inf\)"),
    (_pool(price={"input_per_mtok": float("nan"), "output_per_mtok": 1}), r"\.price.input_per_mtok: must be a finite number"),
    ({"workers": [{"id": "w", "model": "m"}], "providers": {"p": {"api_key_env": "sk-abc def"}}}, r"providers.p.api_key_env: must be the NAME"),
    ({"workers": [{"id": "w", "model": "m"}], "providers": {"p": {"budget": 3}}}, r"providers.p.budget: unknown field"),
    # audit58 F4: a name with a space is a bad name, not a key to revoke
    ({"workers": [{"id": "w", "model": "m"}], "providers": {"p": {"api_key_env": "my key"}}},
     r"providers.p.api_key_env: must be the NAME of an environment variable: letters, digits and _, not starting "
     r"with a digit \(the value is not shown here\)$"),
    ({"workers": [{"id": "w", "model": "m"}], "providers": {"p": {"api_key_env": "gsk-" + "9f8eA7b6C5d4E3f2G1h0"}}},  # made up, split: no key-shaped text committed
     r"providers.p.api_key_env: must be the NAME of an environment variable, not a key .*revoke it\)$"),
    ({"workers": [{"id": "w", "model": "m", "provider": "p"}], "providers": {"p": {"max_concurrency": 2.5}}},
     r"providers.p.max_concurrency: must be a whole number \(got 2.5\)"),
    # A mistyped provider would get default limits and no budget: refused, with the near name.
    ({"workers": [{"id": "w", "model": "m", "provider": "sim-larg"}], "providers": {"sim-large": {"budget_usd": 5}}},
     r"workers\[0\] \(w\).provider: 'sim-larg' is not under providers: \(did you mean 'sim-large'\?\)"),
    (_pool(params={"max_tokens": "512"}), r"\.params.max_tokens: must be a whole number of tokens, at least 1 \(got '512'\)"),
    (_pool(params={"max_tokens": -5}), r"\.params.max_tokens: must be a whole number of tokens, at least 1 \(got -5\)"),
    ([1, 2], "the top level must be a mapping"),
    # YAML's `id: |` block gives "abc\n": a regex `$` let it through, and structured plans named "abc"
    ({"workers": [{"id": "abc\n", "model": "openai/x"}]}, r"workers\[0\].id: required, letters, digits"),
    ({"workers": [{"id": "w", "model": "m"}], "providers": {"p": {"api_key_env": "KEY\n"}}},
     r"providers.p.api_key_env: must be the NAME"),
    # audit50: a 400-digit number was an OverflowError traceback; 0.5 tokens turned the context check off;
    # a version from elsewhere was taken; a 30-digit seed broke the run's hash
    ({"workers": [{"id": "w", "model": "m", "provider": "p"}], "providers": {"p": {"max_concurrency": 10**400}}},
     r"providers.p.max_concurrency: too large \(got 10000000000000000000\.\.\. \(401 characters\)\)"),
    ({"workers": [{"id": "w", "model": "m", "provider": "p"}], "providers": {"p": {"rpm": 10**400}}},
     r"providers.p.rpm: too large"),
    (_pool(context_tokens=0.5), r"\.context_tokens: must be a whole number of tokens \(got 0.5\)"),
    ({**_pool(), "version": 99}, r"version: this conductor reads pool files of version 1 \(got 99\)"),
    (_pool(params={"seed": 10**30}), r"\.params.seed: a whole number too large to send"),
    (_pool(params={"logit_bias": {"50256": -10**20}}), r"\.params.logit_bias.50256: a whole number too large"),
    ({**_pool(), "version": True}, r"version: this conductor reads pool files of version 1 \(got True\)"),
    # params were sent as given: a provider's 400 failed every call of the run, or a clash with what the
    # executor sets (its retries, its timeout) was a TypeError on every call
    (_pool(params={"temperature": "hot"}), r"\.params.temperature: must be a number from 0 to 2 \(got 'hot'\)"),
    (_pool(params={"temperature": "0.7"}), r"\.params.temperature: must be a number from 0 to 2 \(got '0.7'\)"),
    (_pool(params={"top_p": 5}), r"\.params.top_p: must be a number from 0 to 1 \(got 5\)"),
    (_pool(params={"stop": ["###", 3]}), r"\.params.stop: must be a string or a list of strings"),
    (_pool(params={"n": 4}), r"\.params.n: must be 1 \(one answer is kept per step"),
    (_pool(params={"seed": 1.5}), r"\.params.seed: must be a whole number"),
    (_pool(params={"num_retries": 5}), r"\.params.num_retries: not allowed here \(the executor retries"),
    (_pool(params={"stream": True}), r"\.params.stream: not allowed here \(answers are read whole\)"),
])
def test_bad_pool_names_the_field(raw, field):
    with pytest.raises(PoolError, match=field):
        parse_pool(raw)


def test_a_pool_file_that_is_a_folder_or_not_text_is_named(tmp_path):
    with pytest.raises(PoolError, match=r"pool file .*folder: cannot read it \(Is a directory\)"):
        load_pool(tmp_path / "folder" if (tmp_path / "folder").mkdir() is None else None)
    f = tmp_path / "latin.yaml"
    f.write_bytes("workers: [{id: caf\xe9, model: openai/x}]".encode("latin-1"))
    with pytest.raises(PoolError, match=r"latin.yaml: cannot read it \(not UTF-8 text\)"):
        load_pool(f)
    (tmp_path / "loop.yaml").symlink_to("loop.yaml")  # "not found" sent users looking for a file that is there
    with pytest.raises(PoolError, match=r"loop.yaml: a symlink to loop.yaml, which cannot be followed"):
        load_pool(tmp_path / "loop.yaml")


def test_params_the_checks_do_not_know_are_sent_as_given():
    pool = parse_pool(_pool(params={"temperature": 0.2, "top_k": 40, "n": 1, "stop": "\n\n", "min_p": "0.1",
                                    "response_format": {"type": "json_object"}}))
    assert pool.worker("w").params["min_p"] == "0.1" and pool.worker("w").params["top_k"] == 40


def test_integer_keys_in_params_are_sent_as_json_sends_them():
    """logit_bias with integer token ids, as YAML reads them, was a TypeError hashing the pool."""
    pool = parse_pool(_pool(params={"logit_bias": {50256: -100}}))
    assert pool.worker("w").params == {"logit_bias": {"50256": -100}} and pool.identity_hash()


def test_a_variable_name_with_digits_is_not_taken_for_a_key():
    from conductor.masking import looks_like_a_key

    aws_style = "AKIA" + "Q3EGRT7XMPL4ZK2B"  # split, so that key scanners do not take the test for a leak
    assert looks_like_a_key(aws_style) and not looks_like_a_key("GEMINIAPIKEY2025")


@pytest.mark.parametrize("text, why", [
    ("version: 2026-13-45\n", ":1:10: a value cannot be read: month must be in 1..12 (YAML reads it as a date; "
                              "quote it to keep it as text)"),
    # audit58 F4: the line of the value, not only what was wrong with it
    ("workers:\n  - id: w\n    model: openai/x\n    description: 2026-13-45\n",
     ":4:18: a value cannot be read: month must be in 1..12 (YAML reads it as a date"),
    (f"version: {'9' * 5000}\n", ":1:10: a value cannot be read: Exceeds the limit (4300 digits)"),
    ("x: " + "[" * 3000 + "]" * 3000 + "\n", ": a value cannot be read: nested too deep"),
    ("a: &a [*a]\n", ": a value cannot be read: nested too deep, or an alias inside itself")])
def test_a_value_yaml_cannot_build_is_named_not_a_traceback(tmp_path, text, why):
    f = tmp_path / "pool.yaml"
    f.write_text(text)
    with pytest.raises(PoolError, match=re.escape(f"pool file {f}{why}")):
        load_pool(f)


@pytest.mark.parametrize("key", ["batch_poll_s", "batch_collect_s", "batch_max_wait_s", "batch_price_factor",
                                 "batch_max_requests", "batch_budget_rounds", "batch_retry",
                                 "batch_completion_window"])
def test_a_null_batch_option_takes_its_default(key):
    """audit58 F1, F2: `batch_poll_s: null` was a TypeError traceback, `batch_max_requests: null`
    a limit of 0 that left the run waiting for ever."""
    default = parse_pool({"providers": {"p": {"mode": "batch"}},
                          "workers": [{"id": "w", "model": "openai/w", "provider": "p"}]}).providers["p"]
    got = parse_pool({"providers": {"p": {"mode": "batch", key: None}},
                      "workers": [{"id": "w", "model": "openai/w", "provider": "p"}]}).providers["p"]
    assert getattr(got, key) == getattr(default, key) and getattr(got, key) not in (None, 0)


def test_a_null_provider_key_takes_its_default():
    p = parse_pool({"providers": {"p": {k: None for k in ("mode", "rpm", "tpm", "budget_usd", "max_concurrency",
                                                          "timeout_s", "max_attempts", "api_key_env")}},
                    "workers": [{"id": "w", "model": "openai/w", "provider": "p"}]}).providers["p"]
    assert (p.mode, p.rpm, p.tpm, p.budget_usd, p.max_concurrency, p.timeout_s, p.max_attempts, p.api_key_env) == \
        ("online", None, None, None, 16, 120.0, 6, None)  # the README's defaults


@pytest.mark.parametrize("worker, field", [
    ({"id": "w", "model": "openai/w", "function": "vote"}, r"workers\[0\] \(w\).function: only for a worker of kind: function"),
    ({"id": "v", "kind": "function", "function": "vote", "model": "openai/w"},
     r"workers\[0\] \(v\).model: a worker of kind: function calls no model"),
])
def test_a_key_the_worker_kind_would_ignore_is_refused(worker, field):
    """audit58 F4: both were accepted and ignored, so the worker did not do what the file said."""
    with pytest.raises(PoolError, match=field):
        parse_pool({"workers": [worker]})


def test_bad_yaml_and_missing_file_name_the_file(tmp_path):
    with pytest.raises(PoolError, match="not found"):
        load_pool(tmp_path / "nope.yaml")
    f = tmp_path / "bad.yaml"
    f.write_text("workers: [\n")
    with pytest.raises(PoolError, match=f"pool file {f}:2:1: not valid YAML"):
        load_pool(f)


def test_identity_ignores_limits_and_budgets():
    a = parse_pool({"workers": [{"id": "w", "model": "m", "provider": "p"}], "providers": {"p": {"budget_usd": 1}}})
    b = parse_pool({"workers": [{"id": "w", "model": "m", "provider": "p"}], "providers": {"p": {"budget_usd": 9, "rpm": 5}}})
    c = parse_pool({"workers": [{"id": "w", "model": "m2", "provider": "p"}]})
    assert a.identity_hash() == b.identity_hash() != c.identity_hash()
