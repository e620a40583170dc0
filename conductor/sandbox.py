"""Run untrusted Python (a model's answer to a `code` question, with its tests) in a
child process that cannot hurt the machine it grades on.

Layers, each of which holds on its own:
- a fresh temporary directory as the working directory, removed afterwards;
- resource limits: CPU seconds, address space, processes (a fork bomb stops at
  the limit), file size (its output too: stdout and stderr go to files, so a
  flood stops at the limit instead of filling the grader's memory), open files;
  a wall-clock timeout kills the whole process group;
- namespaces (`unshare`, as root, or as any user where user namespaces are
  allowed): its own PID namespace with its own /proc, so no other process, and
  no other process's environment (the grader's API keys), can be seen, and every
  process it starts dies with it, however it was started; its own network
  namespace (only a downed loopback); its own mount namespace, in which every
  mount but the temporary directory is read-only; then every capability is
  dropped, so nothing it runs can remount, and no new privileges;
- an audit hook in the child refuses writes outside the temporary directory,
  new processes (so a fork bomb forks nothing) and loading native code
  (ctypes), before any answer code runs. Without namespaces it is what keeps
  the network out (every socket refused); it cannot stop native process
  creation (`_posixsubprocess`), which the namespaces contain.

It does not switch to an unprivileged user: the interpreter lives under a
folder only root may read here, so `nobody` could not start it. Root ignores
the process-count limit; the audit hook is what stops a fork bomb, and the
timeout kills whatever runs on.

`run_python` never raises for anything the code does: the result says how it ended.
"""

from __future__ import annotations

import functools
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
    isolation: str  # what confined it: "namespaces" or "audit hook"

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
    outdir = Path(tempfile.mkdtemp(prefix="conductor-sandbox-out-"))  # outside the folder the code may write
    isolation = _isolation()
    try:
        script = workdir / "main.py"
        script.write_text(code, encoding="utf-8", errors="surrogatepass")
        env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
        child = [sys.executable, "-I", str(CHILD), str(workdir), str(script)]
        cmd = [*_unshare(), *child, "ns"] if isolation == "namespaces" else [*child, "audit"]
        with open(outdir / "stdout", "w+b") as out, open(outdir / "stderr", "w+b") as err:
            proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, preexec_fn=lambda: _confine(limits, isolation))
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc.pid)  # on time or not, anything it left behind
            proc.wait()
            stdout, stderr = _tail(out), _tail(err)
        code = proc.returncode
        if isolation == "namespaces" and code is not None and code > 128:
            code = 128 - code  # the child died of signal code - 128 (see sandbox_child)
        return Result(not timed_out and code == 0, code, timed_out, stdout, stderr, isolation)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(outdir, ignore_errors=True)


def _tail(f, chars: int = 4000) -> str:
    f.seek(max(0, f.seek(0, os.SEEK_END) - 4 * chars))
    return f.read().decode("utf-8", "replace")[-chars:]


def _unshare() -> list[str]:
    """The namespaces: pid (with its own /proc), network, mount, IPC, hostname; a user namespace
    when not root. --kill-child: killed, it takes its child (PID 1 there, so everything) along."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--fork", "--pid", "--mount-proc", "--net", "--ipc", "--uts", "--kill-child", "--"]


@functools.lru_cache(maxsize=1)
def _isolation() -> str:
    """"namespaces" where `unshare` can make them here (tried once per process), else "audit hook"."""
    workdir = tempfile.mkdtemp(prefix="conductor-sandbox-")
    try:
        r = subprocess.run([*_unshare(), sys.executable, "-I", str(CHILD), workdir, "-", "probe"],
                           env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "audit hook"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return "namespaces" if r.returncode == 0 and r.stdout.strip() == b"isolated" else "audit hook"


def _confine(limits: Limits, isolation: str) -> None:
    """In the child, before exec: limits."""
    def cap(which: int, value: int) -> None:
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_CPU, limits.cpu_s)
    cap(resource.RLIMIT_AS, limits.memory_mb * 2**20)
    cap(resource.RLIMIT_FSIZE, limits.file_mb * 2**20)
    cap(resource.RLIMIT_NOFILE, limits.open_files)
    cap(resource.RLIMIT_CORE, 0)
    if os.geteuid() != 0:
        cap(resource.RLIMIT_NPROC, limits.processes)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
