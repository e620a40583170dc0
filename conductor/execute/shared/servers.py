"""Start the servers that shared state needs, on 127.0.0.1 and a free port, for
tests, benchmarks and a single-machine trial: Redis (Debian's redis-server) and
an S3-compatible server (moto's, from PyPI). Production runs use real ones."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from conductor.errors import ConductorError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, name: str, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConductorError(f"{name} exited with code {proc.returncode}: {log.read_text(errors='replace')[-800:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise ConductorError(f"{name} did not listen on 127.0.0.1:{port} within {timeout:g} s")


class RedisServer:
    """redis-server on 127.0.0.1, with no persistence (a test's state is thrown away)."""

    def __init__(self, password: str | None = None, port: int | None = None):
        exe = shutil.which("redis-server")
        if exe is None:
            raise ConductorError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.exe = exe
        self.password = password
        self.port = port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="conductor-redis-")
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", self._dir.name, "--protected-mode", "no"]
        if self.password:
            cmd += ["--requirepass", self.password]
        log = Path(self._dir.name) / "redis.log"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        _wait_port(self.port, self.proc, "redis-server", log)

    def kill(self) -> None:
        """SIGKILL, as a crash would: the port is free again at once."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        self.kill()
        self._dir.cleanup()

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class S3Server:
    """moto's S3-compatible server (`moto[server]` from PyPI) on 127.0.0.1."""

    ACCESS_KEY = "testing"
    SECRET_KEY = "testing"

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="conductor-s3-")
        log = Path(self._dir.name) / "moto.log"
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        _wait_port(self.port, self.proc, "moto server", log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # listening is not yet answering
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a process needs to reach it (conductor.store reads these)."""
        return {"AWS_ACCESS_KEY_ID": self.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint}

    def create_bucket(self, name: str) -> None:
        """What an operator does once before the first run: conductor creates no bucket."""
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{name}", method="PUT"), timeout=10).read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._dir.cleanup()

    def __enter__(self) -> "S3Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
