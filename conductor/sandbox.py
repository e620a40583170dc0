"""Run untrusted Python (a model's answer to a `code` question) and then its tests in a child process
that cannot hurt the machine it grades on, and say whether the tests passed.

The verdict: the answer's code runs first, as module `main` (not `__main__`); the tests reach the child
only afterwards, over a socket, once the child proves the answer's part is over, and it passes only if they
ran to the end: the child then prints a random nonce, as its last line, and exits 0 at once. Exiting early
(`sys.exit(0)`, `os._exit(0)`, atexit, an exit from a thread) or reading the tests no longer passes; `==`
and `!=` in the tests' asserts compare the answer's values through their builtin base (an `__eq__` that
is always true does not pass). See `sandbox_child` for both phases. All of that happens inside the answer's own
process, so it is not a security boundary: code written against it can find the nonce by introspection.

Layers that confine it, each of which holds on its own:
- its own working directory: in namespace mode a size-limited tmpfs (`Limits.disk_mb`) that lives only
  in the child's mount namespace, else a fresh temporary folder; removed afterwards either way;
- resource limits: CPU seconds, address space, file size (its output too: stdout and stderr go to files,
  so a flood stops at the limit instead of filling the grader's memory), open files; a wall-clock
  timeout kills the whole process group;
- a cgroup made for the run, where this process may make one (root with cgroup v1, or a delegated v2
  tree): `pids.max` = `Limits.processes` (processes and threads, even for root, even when started
  natively) and a memory limit = `Limits.memory_mb` for all its processes together. Best effort:
  `Result.cgroup` names the limits that held; empty, root's process count and the total memory are
  unbounded (RLIMIT_NPROC does not bind root; RLIMIT_AS is per process);
- namespaces (`unshare`, as root, or as any user where user namespaces are allowed): its own PID
  namespace with its own /proc, so no other process, and no other process's environment (the grader's
  API keys), can be seen, and every process it starts dies with it, however it was started; its own
  network namespace (only a downed loopback); its own mount namespace, in which /tmp, the temporary
  folder, /run, /dev/shm, /root and /home are covered with empty tmpfs (so UNIX sockets and files there
  are out of reach), except a folder holding the interpreter, its libraries or this package (here /root,
  which holds pyenv, stays visible), /dev holds only null, zero, full, random and urandom, and every
  mount but the working directory is read-only; then every capability is dropped, so nothing it runs
  can remount, and no new privileges;
- an audit hook in the child refuses writes outside the working directory, new processes (so a fork bomb
  forks nothing), loading native code (ctypes) and other processes' /proc entries, before any answer code
  runs. Without namespaces it is what keeps the network out (every socket refused); it cannot stop native
  process creation (`_posixsubprocess`), which the namespaces and the cgroup contain, and, in-process, it is
  no security boundary either: code written against it can defeat it.
- if the grader is interrupted (Ctrl-C, SIGTERM) the child's process group is killed in a `finally`
  (`stop_all` kills those other threads wait on, at once); the child also gets SIGKILL when the grader
  dies (PR_SET_PDEATHSIG), so a SIGKILLed grader takes it along.
  Without namespaces, a grader killed by a signal leaves its temporary folder behind.

It does not switch to an unprivileged user: the interpreter lives under a folder only root may read here,
so `nobody` could not start it; files outside the covered folders stay readable to the answer.

`run_python` never raises for anything the code does: the result says how it ended.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from conductor.sandbox_child import compile_tests

CHILD = Path(__file__).with_name("sandbox_child.py")
_COVER = ("/tmp", "/var/tmp", "/run", "/dev/shm", "/root", "/home")
_CGROUP_PREFIX = "conductor-sandbox-"
_running: set[int] = set()  # the process groups of the sandboxes running now (see `stop_all`)
_running_lock = threading.Lock()


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024  # per process (RLIMIT_AS), and for all of them together where a cgroup is made
    processes: int = 64  # processes and threads; enforced by a cgroup (root ignores RLIMIT_NPROC)
    file_mb: int = 16
    open_files: int = 64
    disk_mb: int = 64  # the working directory's tmpfs (namespace mode)


@dataclass(frozen=True)
class Result:
    ok: bool  # the tests ran to the end (the nonce line was printed) and it exited 0 within the limits
    returncode: int | None
    timed_out: bool
    stdout: str  # without the nonce line
    stderr: str
    isolation: str  # what confined it: "namespaces" or "audit hook"
    cgroup: tuple[str, ...] = ()  # the limits a cgroup enforced: "pids", "memory"; () where none could be made
    memory_killed: bool = False  # the cgroup's memory limit killed one of its processes

    @property
    def detail(self) -> str:
        if self.timed_out:
            return "killed: timed out"
        if self.ok:
            return "passed"
        if self.memory_killed and self.returncode == -signal.SIGKILL:
            return "killed: memory limit"
        if self.returncode in (-signal.SIGKILL, -signal.SIGXCPU):
            return "killed: CPU time limit"
        if self.returncode == 0:
            return "exit 0 before the tests finished"
        last = (self.stderr.strip().splitlines() or ["no output"])[-1]
        return f"exit {self.returncode}: {last[:200]}"


def run_python(code: str, limits: Limits = Limits(), tests: str = "") -> Result:
    """Run `code` as module `main`, then `tests` (Python, e.g. asserts) in the sandbox."""
    isolation = _isolation()
    nonce = secrets.token_hex(16).encode()
    settings, host_dir = _settings(isolation, limits)
    settings.update(code=code, nonce=nonce)
    frames = [_frame(_marshal(settings)), _tests_frame(tests, nonce)]
    cgroups, enforced = _make_cgroups(limits)
    proc = writer = None
    # A socket pair, not a pipe: a pipe's read end can be reopened for writing through /proc/self/fd,
    # which let an answer read its tests and put them back (audit45).
    grader_end, child_end = (s.detach() for s in socket.socketpair())
    read_end, write_end = child_end, grader_end
    try:
        env = {"PATH": "/usr/bin:/bin", "HOME": settings["workdir"], "TMPDIR": settings["workdir"],
               "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
               # glibc reserves 64 MB of address space per thread arena: 20 threads used up RLIMIT_AS
               "MALLOC_ARENA_MAX": "2"}
        child = [sys.executable, "-I", str(CHILD)]
        cmd = ([*_unshare(), *child, "ns", str(read_end)] if isolation == "namespaces"
               else [*child, "audit", str(read_end)])
        procs = [d / "cgroup.procs" for d in cgroups]
        parent, libc = os.getpid(), _libc()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:  # unlinked: nothing to leave
            proc = subprocess.Popen(cmd, cwd=host_dir or "/", env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=err, pass_fds=(read_end,), start_new_session=True,
                                    preexec_fn=lambda: _confine(limits, procs, parent, libc))
            with _running_lock:
                _running.add(proc.pid)
            os.close(read_end)
            read_end = -1
            writer = threading.Thread(target=_send, args=(write_end, frames, nonce), daemon=True)
            write_end = -1  # the writer closes it
            writer.start()
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _end(proc)  # on time or not, anything it left behind
            raw_out, stderr = _tail(out), _tail(err).decode("utf-8", "replace")
        code = proc.returncode
        if isolation == "namespaces" and code is not None and code > 128:
            code = 128 - code  # the child died of signal code - 128 (see sandbox_child)
        mark = b"\n" + nonce + b"\n"
        finished = raw_out.endswith(mark)
        stdout = (raw_out[:-len(mark)] if finished else raw_out).decode("utf-8", "replace")[-4000:]
        ok = not timed_out and code == 0 and finished
        return Result(ok, code, timed_out, stdout, stderr[-4000:], isolation, enforced, _oom_killed(cgroups))
    finally:
        if proc is not None:
            _end(proc)  # also when interrupted (KeyboardInterrupt) while it ran
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
        if writer is not None:
            writer.join(timeout=5)
        _remove_cgroups(cgroups)
        if host_dir:
            shutil.rmtree(host_dir, ignore_errors=True)


def _settings(isolation: str, limits: Limits) -> tuple[dict, str | None]:
    """What the child needs to confine itself, and the folder made for it on this machine, if any: none
    in namespace mode when the temporary folder is covered (the working directory is then made on the
    child's own tmpfs, so a grader killed by a signal leaves nothing behind)."""
    tmp = os.path.realpath(tempfile.gettempdir())
    cover = _covers(tmp) if isolation == "namespaces" else ()
    if tmp in cover:
        host_dir = None
        workdir = os.path.join(tmp, f"conductor-sandbox-{secrets.token_hex(6)}")
    else:
        host_dir = workdir = os.path.realpath(tempfile.mkdtemp(prefix="conductor-sandbox-"))
    return {"workdir": workdir, "cover": list(cover), "disk_mb": limits.disk_mb}, host_dir


def _covers(tmp: str) -> tuple[str, ...]:
    """The folders to hide under an empty tmpfs: those of `_COVER` (and the temporary folder) that
    exist and neither hold nor lie inside the interpreter, its libraries or this package."""
    import sysconfig  # the child runs with -I: the interpreter's own paths, not this process's sys.path
    keep = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, str(CHILD.parent),
                                          os.path.dirname(os.path.realpath(sys.executable)),
                                          *sysconfig.get_paths().values())
            if p and os.path.isabs(p)}
    found = []
    for d in dict.fromkeys(os.path.realpath(d) for d in (*_COVER, tmp)):
        if d == "/" or not os.path.isdir(d):
            continue
        if not any(k == d or k.startswith(d + "/") or d.startswith(k + "/") for k in keep):
            found.append(d)
    return tuple(sorted(found))


def _marshal(value) -> bytes:
    import marshal
    return marshal.dumps(value)


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def _tests_frame(tests: str, nonce: bytes) -> bytes:
    """The tests, compiled with their asserts rewritten, behind an HMAC under the nonce (the answer, which
    never sees the nonce on the socket, cannot put its own tests in their place)."""
    import hmac
    body = compile_tests(tests)
    return _frame(hmac.digest(nonce, body, "sha256") + body)


def _send(fd: int, frames: list[bytes], nonce: bytes) -> None:
    """Send the settings; then, only once the child proves the answer's code has run (an HMAC of
    "ready" under the nonce, which the answer never sees on the socket), the tests. Sent earlier, they
    sat on the socket while the answer ran: it could read them and replay them to the child through
    a descriptor of its own (dup2). A thread: more than a socket buffer blocks until read."""
    import hmac
    settings, tests = frames
    try:
        with socket.socket(fileno=fd) as sock:
            sock.sendall(settings)
            ready = b""
            while len(ready) < 32 and (chunk := sock.recv(32 - len(ready))):
                ready += chunk
            if hmac.compare_digest(ready, hmac.digest(nonce, b"ready", "sha256")):
                sock.sendall(tests)
    except OSError:  # the child died (or closed its end): its result says so
        pass


def _tail(f, chars: int = 4000) -> bytes:
    f.seek(max(0, f.seek(0, os.SEEK_END) - 4 * chars))
    return f.read()


def _unshare() -> list[str]:
    """The namespaces: pid (with its own /proc), network, mount, IPC, hostname; a user namespace
    when not root. --kill-child: killed, it takes its child (PID 1 there, so everything) along."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--fork", "--pid", "--mount-proc", "--net", "--ipc", "--uts", "--kill-child", "--"]


@functools.lru_cache(maxsize=1)
def _isolation() -> str:
    """"namespaces" where `unshare` can make them here (tried once per process), else "audit hook"."""
    settings, host_dir = _settings("namespaces", Limits())
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, _frame(_marshal(settings)))  # small: fits in the pipe
        os.close(write_end)
        r = subprocess.run([*_unshare(), sys.executable, "-I", str(CHILD), "probe", str(read_end)],
                           env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=30, pass_fds=(read_end,), cwd=host_dir or "/")
    except (OSError, subprocess.TimeoutExpired):
        return "audit hook"
    finally:
        os.close(read_end)
        if host_dir:
            shutil.rmtree(host_dir, ignore_errors=True)
    return "namespaces" if r.returncode == 0 and r.stdout.strip() == b"isolated" else "audit hook"


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _confine(limits: Limits, procs: list[Path], parent: int, libc) -> None:
    """In the child, before exec: die with the grader, join the run's cgroups, limits."""
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the grader died before that
        os._exit(1)
    for f in procs:
        try:
            f.write_text(str(os.getpid()))
        except OSError:
            os.write(2, f"sandbox: could not join the cgroup {f.parent}\n".encode())
            os._exit(72)

    def cap(which: int, value: int) -> None:
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_CPU, limits.cpu_s)
    cap(resource.RLIMIT_AS, limits.memory_mb * 2**20)
    cap(resource.RLIMIT_FSIZE, limits.file_mb * 2**20)
    cap(resource.RLIMIT_NOFILE, limits.open_files)
    cap(resource.RLIMIT_CORE, 0)
    if os.geteuid() != 0:
        cap(resource.RLIMIT_NPROC, limits.processes)


def stop_all() -> None:
    """Kill every sandbox this process is running, at once: for a grader interrupted (Ctrl-C) while
    its threads wait in `run_python`. The sandboxes run in sessions of their own, which the terminal's
    SIGINT does not reach, so each would otherwise run on to its timeout; killed, each `run_python`
    returns (a killed result) and cleans up as usual."""
    with _running_lock:  # held while killing: `_end` forgets a pid before reaping it, so none is reused
        for pid in _running:
            _kill_group(pid)


def _end(proc: subprocess.Popen) -> None:
    """Kill the sandbox's process group (whatever is left of it) and reap it."""
    with _running_lock:
        _running.discard(proc.pid)
    _kill_group(proc.pid)
    proc.wait()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- cgroups

def _own_cgroup(controller: str) -> str | None:
    """This process's cgroup path for `controller` (v1), or its v2 path for controller ""."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller in names.split(",")) if controller else names == "":
            return path
    return None


def _make_cgroups(limits: Limits) -> tuple[list[Path], tuple[str, ...]]:
    """A fresh cgroup for the run, under this process's own, with pids.max and a memory limit: cgroup v2
    where /sys/fs/cgroup is a unified tree whose controllers reach here, else v1 pids and memory. Best
    effort: what could not be made is left out, and the result says which limits hold."""
    name = f"{_CGROUP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    made: list[Path] = []
    enforced: list[str] = []
    root = Path("/sys/fs/cgroup")
    try:
        if (root / "cgroup.controllers").exists():
            own = _own_cgroup("")
            if own is not None:
                d = _mkdir_cgroup(root / own.lstrip("/"), name, made)
                available = (d / "cgroup.controllers").read_text().split()
                if "pids" in available:
                    (d / "pids.max").write_text(str(limits.processes))
                    enforced.append("pids")
                if "memory" in available:
                    (d / "memory.max").write_text(str(limits.memory_mb * 2**20))
                    _try_write(d / "memory.swap.max", "0")
                    enforced.append("memory")
        else:
            for controller, files in (("pids", ("pids.max",)),
                                      ("memory", ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"))):
                own = _own_cgroup(controller)
                if own is None or not (root / controller).is_dir():
                    continue
                d = _mkdir_cgroup(root / controller / own.lstrip("/"), name, made)
                value = str(limits.processes if controller == "pids" else limits.memory_mb * 2**20)
                (d / files[0]).write_text(value)
                for extra in files[1:]:
                    _try_write(d / extra, value)  # no swap beyond the limit, where swap is accounted
                enforced.append(controller)
    except OSError:
        _remove_cgroups(made)
        return [], ()
    return made, tuple(enforced)


def _mkdir_cgroup(parent: Path, name: str, made: list[Path]) -> Path:
    _sweep(parent)
    d = parent / name
    d.mkdir()
    made.append(d)
    return d


def _try_write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError:
        pass


def _sweep(parent: Path) -> None:
    """Remove cgroups left by graders that died by a signal (their pid is in the name)."""
    try:
        entries = [d for d in parent.iterdir() if d.name.startswith(_CGROUP_PREFIX)]
    except OSError:
        return
    for d in entries:
        try:
            os.kill(int(d.name[len(_CGROUP_PREFIX):].split("-")[0]), 0)
        except ProcessLookupError:
            _remove_cgroups([d])
        except (ValueError, PermissionError, OSError):
            pass


def _remove_cgroups(dirs: list[Path]) -> None:
    """Kill whatever is still in each cgroup, then remove it."""
    for d in dirs:
        for _ in range(200):
            try:
                pids = (d / "cgroup.procs").read_text().split()
            except OSError:
                pids = []
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError, ValueError):
                    pass
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)


def _oom_killed(dirs: list[Path]) -> bool:
    for d in dirs:
        for name in ("memory.oom_control", "memory.events"):
            try:
                text = (d / name).read_text()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip() not in ("", "0"):
                    return True
    return False
