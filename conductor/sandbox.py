"""Run untrusted Python (a model's answer to a `code` question, with its tests) in a
child process that cannot hurt the machine it grades on.

Layers, each of which holds on its own:
- a fresh temporary directory as the working directory, removed afterwards;
- resource limits: CPU seconds, address space, processes (a fork bomb stops at
  the limit), file size, open files; a wall-clock timeout kills the whole
  process group;
- no network: as root, a new network namespace (only a downed loopback);
  otherwise the audit hook refuses every socket;
- an audit hook in the child refuses writes outside the temporary directory,
  new processes (so a fork bomb forks nothing) and loading native code
  (ctypes), before any answer code runs.

It does not switch to an unprivileged user: the interpreter lives under a
folder only root may read here, so `nobody` could not start it. Root ignores
the process-count limit; the audit hook is what stops a fork bomb, and the
timeout kills whatever runs on.

`run_python` never raises for anything the code does: the result says how it ended.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CHILD = Path(__file__).with_name("sandbox_child.py")
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    processes: int = 64  # not enforced for root (see the module docstring)
    file_mb: int = 16
    open_files: int = 64


@dataclass(frozen=True)
class Result:
    ok: bool  # exited 0 within the limits
    returncode: int | None
    timed_out: bool
    stdout: str
    stderr: str
    isolation: str  # what kept the network out: "netns" or "audit hook"

    @property
    def detail(self) -> str:
        if self.timed_out:
            return "killed: timed out"
        if self.ok:
            return "passed"
        if self.returncode in (-signal.SIGKILL, -signal.SIGXCPU):
            return "killed: CPU time limit"
        last = (self.stderr.strip().splitlines() or ["no output"])[-1]
        return f"exit {self.returncode}: {last[:200]}"


def run_python(code: str, limits: Limits = Limits()) -> Result:
    """Run `code` as a script in the sandbox."""
    workdir = Path(tempfile.mkdtemp(prefix="conductor-sandbox-"))
    root = os.geteuid() == 0
    try:
        script = workdir / "main.py"
        script.write_text(code, encoding="utf-8", errors="surrogatepass")
        env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
        cmd = [sys.executable, "-I", str(CHILD), str(workdir), str(script), "audit" if not root else "netns"]
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=lambda: _confine(limits, root))
        timed_out = False
        try:
            out, err = proc.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            out, err = proc.communicate()
        _kill_group(proc.pid)  # anything it left behind
        return Result(not timed_out and proc.returncode == 0, proc.returncode, timed_out,
                      out.decode("utf-8", "replace")[-4000:], err.decode("utf-8", "replace")[-4000:],
                      "netns" if root else "audit hook")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _confine(limits: Limits, root: bool) -> None:
    """In the child, before exec: limits, then (as root) a private network."""
    def cap(which: int, value: int) -> None:
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_CPU, limits.cpu_s)
    cap(resource.RLIMIT_AS, limits.memory_mb * 2**20)
    cap(resource.RLIMIT_FSIZE, limits.file_mb * 2**20)
    cap(resource.RLIMIT_NOFILE, limits.open_files)
    cap(resource.RLIMIT_CORE, 0)
    if root:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_NEWNET) != 0:
            os._exit(71)  # no isolation, no run
    else:
        cap(resource.RLIMIT_NPROC, limits.processes)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
