"""The executor benchmark's peers, each run as a child process in its own virtual
environment (their pins conflict with ours): Curator's OpenAI back end
(`bespokelabs-curator`), the openai SDK on its aiohttp transport
(`openai[aiohttp]`), and bare `litellm.acompletion` (our environment).

    python bench/peers.py {curator,openai,litellm} --url URL --calls N --offset K
        [--concurrency C] [--rpm R] [--retries M]

Sends the same prompts as bench/executor.py (query i of offset..offset+N) to the
OpenAI-compatible server at URL, which must be on 127.0.0.1, each tool with its own
limiter and retries, and prints one line `RESULT {"seconds": ..., "completed": ...}`.
This file imports nothing from conductor but `conductor.argtypes` (the standard
library only, so it loads in the peers' environments). `ensure_venv` builds the
environments (under the folder given, never in the project's own venv).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: the repo shadows nothing of a peer's venv
from conductor.argtypes import int_in, number_in  # noqa: E402

MODEL = "bench"
# What each peer's environment installs (pinned where the version matters for the comparison).
PEER_PACKAGES = {"curator": ["bespokelabs-curator==0.1.31"], "openai": ["openai[aiohttp]"]}


def prompt(i: int) -> str:
    return f"Question {i}: what is {i} plus {i * 7 % 13}? Give the number."


def ensure_venv(root: Path, peer: str) -> Path:
    """The python of the peer's own virtual environment under `root`, created and
    installed from PyPI on first use (minutes; later runs reuse it)."""
    if peer == "litellm":
        return Path(sys.executable)
    venv = root / peer
    python = venv / "bin" / "python"
    done = venv / ".installed"
    if not done.exists():
        print(f"creating the {peer} environment in {venv} (first run only)...", file=sys.stderr, flush=True)
        if subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)]).returncode:
            raise RuntimeError(f"could not create its virtual environment in {venv}")
        if subprocess.run([str(python), "-m", "pip", "install", "-q", *PEER_PACKAGES[peer]]).returncode:
            raise RuntimeError(f"pip could not install {' '.join(PEER_PACKAGES[peer])} (no network?)")
        done.write_text(" ".join(PEER_PACKAGES[peer]))
    return python


def run_peer(python: Path, peer: str, url: str, calls: int, offset: int, concurrency: int,
             rpm: float | None = None, retries: int = 10, timeout_s: float = 1800) -> dict:
    """Run one peer in a child process; its RESULT line as a dict."""
    cmd = [str(python), __file__, peer, "--url", url, "--calls", str(calls), "--offset", str(offset),
           "--concurrency", str(concurrency), "--retries", str(retries)]
    if rpm:
        cmd += ["--rpm", str(rpm)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"peer {peer} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


# ---- inside the peer's environment -------------------------------------------

def _curator(a) -> dict:
    """Curator's run, its cache in a temporary folder removed afterwards (they piled up in /tmp)."""
    tmp = tempfile.mkdtemp(prefix="curator-bench-")
    try:
        return _curator_in(a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _curator_in(a, tmp: str) -> dict:
    os.environ.update({"CURATOR_CACHE_DIR": tmp, "CURATOR_DISABLE_RICH_DISPLAY": "1",
                       "TELEMETRY_ENABLED": "false", "CURATOR_VIEWER": "0", "OPENAI_API_KEY": "no-key"})
    import litellm  # its package ships tiktoken's encodings; nothing may be fetched from outside

    tok = Path(litellm.__file__).parent / "litellm_core_utils" / "tokenizers"
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(tok))
    from bespokelabs import curator

    params = {"base_url": a.url, "api_key": "no-key", "max_retries": a.retries, "require_all_responses": False,
              "max_concurrent_requests": a.concurrency, "request_timeout": 30,
              "max_requests_per_minute": int(a.rpm) if a.rpm else 10_000_000,
              "max_tokens_per_minute": 10_000_000_000}
    class Ask(curator.LLM):
        def prompt(self, row):
            return row["prompt"]

        def parse(self, row, response):
            return {"response": response}

    llm = Ask(model_name=MODEL, backend="openai", generation_params={"temperature": 0, "max_tokens": 256},
              backend_params=params)
    rows = [{"prompt": prompt(i)} for i in range(a.offset, a.offset + a.calls)]
    t = time.perf_counter()
    out = llm(rows)
    seconds = time.perf_counter() - t
    ds = out.dataset if hasattr(out, "dataset") else out
    completed = sum(1 for r in ds if r.get("response"))
    return {"seconds": seconds, "completed": completed}


async def _openai(a) -> dict:
    from openai import AsyncOpenAI, DefaultAioHttpClient

    sem = asyncio.Semaphore(a.concurrency)
    done = 0
    async with AsyncOpenAI(base_url=a.url, api_key="no-key", max_retries=a.retries, timeout=30,
                           http_client=DefaultAioHttpClient()) as client:
        async def one(i: int) -> None:
            nonlocal done
            async with sem:
                r = await client.chat.completions.create(model=MODEL, temperature=0, max_tokens=256,
                                                         messages=[{"role": "user", "content": prompt(i)}])
                done += bool(r.choices[0].message.content)

        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(a.offset, a.offset + a.calls)), return_exceptions=True)
        return {"seconds": time.perf_counter() - t, "completed": done}


async def _litellm(a) -> dict:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True
    sem = asyncio.Semaphore(a.concurrency)
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        async with sem:
            r = await litellm.acompletion(model=f"openai/{MODEL}", api_base=a.url, api_key="no-key",
                                          messages=[{"role": "user", "content": prompt(i)}], temperature=0,
                                          max_tokens=256, num_retries=a.retries, timeout=30)
            done += bool(r.choices[0].message.content)

    await asyncio.gather(*(one(i) for i in range(a.offset, a.offset + 50)), return_exceptions=True)  # warm
    done = 0
    t = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(a.offset, a.offset + a.calls)), return_exceptions=True)
    return {"seconds": time.perf_counter() - t, "completed": done}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("peer", choices=["curator", "openai", "litellm"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--calls", type=int_in(1, 10 ** 8), required=True)
    ap.add_argument("--offset", type=int_in(0, 10 ** 9), default=0)
    ap.add_argument("--concurrency", type=int_in(1, 10_000), default=64)
    ap.add_argument("--rpm", type=number_in(1.0, 1e9))
    ap.add_argument("--retries", type=int_in(0, 1000), default=10)
    a = ap.parse_args()
    if urllib.parse.urlsplit(a.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"--url {a.url}: the benchmark sends traffic to 127.0.0.1 only")
    if a.peer == "curator":
        result = _curator(a)
    else:
        result = asyncio.run(_openai(a) if a.peer == "openai" else _litellm(a))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
