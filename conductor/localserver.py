"""What the local HTTP servers (the simulated pool, the replay server) share:
serving an aiohttp app on loopback until told to stop, and starting one in a
subprocess for tests, benchmarks and the demo.

A started server runs in its own process group, so `stop()` ends it and
anything it started; its stdout and stderr go to files that `stdout()` and
`stderr()` read. It prints `<ready><url>` once it listens, which is how the
parent learns the port it picked. It also stops when the process that started
it is gone: a parent killed by a signal runs no exit handler, and a server
left behind would hold its port against the next run.
"""

from __future__ import annotations

import asyncio
import atexit
import ipaddress
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, TypeVar

import orjson
from aiohttp import web

from conductor.errors import ConductorError

# Loopback calls must not go through an HTTP proxy set in the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_LIVE: "set[ServerHandle]" = set()  # servers still running, stopped at exit
PARENT_ENV = "CONDUCTOR_SERVER_PARENT"  # the pid of the process that started the server


_JSON = "application/json"


class ServerStartError(ConductorError):
    """A local server did not come up."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RequestLog:
    """What a local server saw, for tests and benchmarks to check from outside.
    Servers add their own counters by extending `reset` and `to_json`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total = 0
        self.by_model: Counter[str] = Counter()
        self.by_status: Counter[str] = Counter()
        # 200 responses per client request id (header x-conductor-request), so a
        # test can tell whether a call the client had finished was sent again.
        self.by_request_key: Counter[str] = Counter()

    def to_json(self) -> dict[str, Any]:
        return {"total": self.total, "by_model": dict(self.by_model), "by_status": dict(self.by_status),
                "by_request_key": dict(self.by_request_key)}


class LocalServer:
    """The handlers both local servers share. Subclasses set `_model_list` (the
    /v1/models body) and `log` (a request log with reset() and to_json())."""

    _model_list: bytes
    log: Any

    async def models_list(self, request: web.Request) -> web.Response:
        return web.Response(body=self._model_list, content_type=_JSON)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"ok":true}', content_type=_JSON)

    async def admin_log(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.log.to_json()), content_type=_JSON)

    async def admin_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.Response(body=b'{"ok":true}', content_type=_JSON)

    def reset(self) -> None:
        self.log.reset()


def openai_app(server: LocalServer, *, faults: bool = False) -> web.Application:
    """The OpenAI-compatible routes both local servers answer, plus their admin
    routes (request log, reset, and the simulated pool's faults)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_post("/chat/completions", server.chat)
    app.router.add_get("/v1/models", server.models_list)
    app.router.add_get("/health", server.health)
    app.router.add_get("/admin/log", server.admin_log)
    app.router.add_post("/admin/reset", server.admin_reset)
    if faults:
        app.router.add_get("/admin/faults", server.admin_faults)
        app.router.add_post("/admin/faults", server.admin_faults)
    return app


def message_text(content: Any) -> str:
    """A chat message's text: a string, or the text parts of a content array."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


async def serve(app: web.Application, host: str, port: int, ready: str, banner: Iterable[str] = ()) -> None:
    """Serve `app` until SIGINT or SIGTERM; print `<ready><url>` once listening."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        await runner.cleanup()
        raise ConductorError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    bound = runner.addresses[0][1]
    shown = f"[{host}]" if ":" in host else host
    print(f"{ready}http://{shown}:{bound}/v1", flush=True)
    for line in banner:
        print(line, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(_stop_when_orphaned(stop)) if os.environ.get(PARENT_ENV) else None
    await stop.wait()
    if watch is not None:
        watch.cancel()
    await runner.cleanup()


async def _stop_when_orphaned(stop: asyncio.Event, every_s: float = 0.5) -> None:
    """Set `stop` once the starting process has died (this one is then re-parented)."""
    parent = int(os.environ[PARENT_ENV])
    while os.getppid() == parent:
        await asyncio.sleep(every_s)
    stop.set()


class ServerHandle:
    """A local server running in a subprocess."""

    name = "local server"

    def __init__(self, proc: subprocess.Popen, host: str, port: int, logdir: tempfile.TemporaryDirectory):
        self.proc = proc
        self.host = host
        self.port = port
        self.root = f"http://{host}:{port}"
        self.url = f"{self.root}/v1"
        self._logdir = logdir

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> dict[str, Any]:
        """The server's request log (GET /admin/log)."""
        return self._call("GET", "/admin/log")

    def reset(self) -> None:
        """Clear the request log, and the simulated pool's rpm windows (POST /admin/reset)."""
        self._call("POST", "/admin/reset")

    def stdout(self) -> str:
        return (Path(self._logdir.name) / "stdout.txt").read_text(errors="replace")

    def stderr(self) -> str:
        return (Path(self._logdir.name) / "stderr.txt").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
            except ProcessLookupError:
                pass
        _LIVE.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = orjson.dumps(body) if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(self.root + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with _OPENER.open(req, timeout=30) as resp:
                return orjson.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise ConductorError(f"{self.name} {method} {path}: HTTP {e.code}: "
                                 f"{e.read().decode(errors='replace')}") from None


H = TypeVar("H", bound=ServerHandle)


def start_server(cmd: list[str], ready: str, handle: type[H], host: str, *, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 30.0) -> H:
    """Run `cmd` in its own process group and wait until it answers /health."""
    logdir = tempfile.TemporaryDirectory(prefix="conductor-server-")
    out_path, err_path = Path(logdir.name) / "stdout.txt", Path(logdir.name) / "stderr.txt"
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid()), **(env or {})}
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                env=child_env, start_new_session=True)
    h = None
    deadline = time.monotonic() + startup_timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ServerStartError(f"{handle.name} exited with code {proc.returncode}: "
                                       f"{_tail(err_path) or _tail(out_path)}")
            if h is None:
                port = _bound_port(out_path, ready)
                if port is not None:
                    h = handle(proc, host, port, logdir)
            if h is not None and _healthy(h.root):
                _LIVE.add(h)
                return h
            time.sleep(0.05)
        raise ServerStartError(f"{handle.name} did not answer /health within {startup_timeout_s:g} s; "
                               f"stderr: {_tail(err_path) or '(empty)'}")
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise


def _bound_port(out_path: Path, ready: str) -> int | None:
    for line in out_path.read_text(errors="replace").splitlines():
        if line.startswith(ready):
            return urllib.parse.urlsplit(line[len(ready):].strip()).port
    return None


def _healthy(root: str) -> bool:
    try:
        with _OPENER.open(root + "/health", timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, n: int = 2000) -> str:
    return path.read_text(errors="replace").strip()[-n:]


@atexit.register
def _stop_leftovers() -> None:
    for h in list(_LIVE):
        h.stop()
