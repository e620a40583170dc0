"""The `code` grader and its sandbox: an answer's code runs against the question's tests in
a child process that cannot loop forever, fork without end, write outside its own folder
or reach the network."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from conductor.grading import grade
from conductor.sandbox import Limits, run_python

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
FAST = Limits(timeout_s=3, cpu_s=3)
# For programs that must succeed: a busy machine must not turn their start-up into a timeout.
ROOMY = Limits(timeout_s=60, cpu_s=10)


def test_a_correct_solution_passes_and_a_wrong_one_fails():
    right = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    assert grade("code", right, TESTS).correct is True
    g = grade("code", wrong, TESTS)
    assert g.correct is False and "AssertionError" in g.detail
    assert grade("code", "I don't know.", TESTS).correct is False  # not code: a syntax error, graded wrong
    assert grade("code", "", TESTS).correct is False


def test_an_infinite_loop_is_killed_at_the_timeout():
    t0 = time.monotonic()
    r = run_python("import time\nwhile True:\n    time.sleep(0.01)\n", Limits(timeout_s=2, cpu_s=60))
    assert r.timed_out and not r.ok and r.detail == "killed: timed out"
    assert time.monotonic() - t0 < 10
    r = run_python("while True:\n    pass\n", Limits(timeout_s=60, cpu_s=1))  # burns CPU: the CPU limit stops it
    assert not r.ok and r.detail == "killed: CPU time limit"
    assert time.monotonic() - t0 < 30


def test_a_fork_bomb_forks_nothing():
    r = run_python("import os\nwhile True:\n    os.fork()\n", FAST)
    assert not r.ok and not r.timed_out and "os.fork is not allowed" in r.stderr
    r = run_python("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\n", FAST)
    assert not r.ok and "subprocess.Popen is not allowed" in r.stderr


def test_writes_stay_inside_the_sandbox_folder(tmp_path):
    target = tmp_path / "escaped.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('x')\n", FAST)
    assert not r.ok and "outside the sandbox directory" in r.stderr and not target.exists()
    r = run_python(f"import os\nos.remove({str(tmp_path)!r})\n", FAST)
    assert not r.ok and tmp_path.exists()
    r = run_python("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())\n", ROOMY)
    assert r.ok and r.stdout.strip() == "ok"  # its own folder is writable


def test_the_network_is_out_of_reach():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    try:
        r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n", FAST)
        assert not r.ok
        assert "unreachable" in r.stderr.lower() or "not allowed" in r.stderr
        time.sleep(0.2)
        assert accepted == []  # nothing reached the listening socket on the host
    finally:
        server.close()
    assert r.isolation == ("namespaces" if os.geteuid() == 0 else r.isolation)


def test_memory_and_native_code_are_refused():
    assert not run_python("x = bytearray(8 * 1024 ** 3)\n", FAST).ok
    r = run_python("import ctypes\nctypes.CDLL(None)\n", FAST)
    assert not r.ok and "ctypes.dlopen is not allowed" in r.stderr


@pytest.mark.parametrize("reference", ["assert add(2, 3) == 5", None])
def test_without_tests_nothing_is_graded(reference):
    g = grade("code", "```python\ndef add(a, b): return a + b\n```", reference)
    assert g.answer == "def add(a, b): return a + b"
    assert g.correct is (True if reference else None)


def test_the_graders_environment_and_other_processes_are_out_of_sight():
    """The child's own environment was clean, but as root it read the grader's keys from
    /proc/<parent>/environ (audit 32) and could print them into the grade's detail. Here the
    grader is a process started with a key in its environment, as conductor is."""
    import subprocess
    import sys

    scan = ("import os\nfound = []\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        try:\n"
            "            if b'sk-sandbox-canary' in open(f'/proc/{p}/environ', 'rb').read():\n"
            "                found.append(p)\n        except OSError:\n            pass\n"
            "assert not found, f'the key is readable in the environment of processes {found}'\n")
    grader = ("import sys\nfrom conductor.sandbox import Limits, run_python\n"
              f"r = run_python({scan!r}, Limits(timeout_s=10, cpu_s=10))\n"
              "print(r.isolation)\nprint(r.detail)\n")
    env = {**os.environ, "CONDUCTOR_TEST_SECRET": "sk-sandbox-canary-0123456789"}
    out = subprocess.run([sys.executable, "-c", grader], env=env, capture_output=True, text=True, timeout=60)
    isolation, detail = out.stdout.splitlines()[:2]
    if os.geteuid() != 0 and isolation == "audit hook":  # root can always make namespaces
        pytest.skip("no user namespaces here: the audit hook alone cannot hide /proc")
    assert detail == "passed", out.stdout + out.stderr


def test_native_process_creation_writes_nothing_outside_and_dies_with_the_sandbox(tmp_path):
    """`_posixsubprocess.fork_exec` raises no audit event: a shell it started wrote outside the
    folder, outlived the timeout in its own session, and kept the grader waiting on its pipes."""
    outside = tmp_path / "escaped"
    argv = [b"/bin/sh", b"-c", f"echo out > {outside}; sleep 120".encode()]
    code = ("import _posixsubprocess, inspect, os, time\n"
            f"argv = {argv!r}\n"
            "r, w = os.pipe()\n"
            "_posixsubprocess.fork_exec(argv, [argv[0]], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w,\n"
            "                           True, True, -1, None, None, None, -1, None, False)\n"
            "time.sleep(0.5)\n")
    t0 = time.monotonic()
    r = run_python(code, FAST)
    if os.geteuid() != 0 and r.isolation == "audit hook":
        pytest.skip("no user namespaces here: native process creation is not contained")
    assert not outside.exists(), r.stderr
    assert time.monotonic() - t0 < 60  # not held until the shell's sleep 120 ends


def test_an_output_flood_stops_at_the_file_size_limit():
    """stdout used to be read whole into the grader's memory (3.9 GB in 5 s)."""
    r = run_python("import sys\nb = b'x' * (1 << 20)\nwhile True:\n    sys.stdout.buffer.write(b)\n", FAST)
    assert not r.ok and not r.timed_out and "File too large" in r.stderr
    assert len(r.stdout) <= 4000


# ------------------------------------------------------------------ audit 43

FORK_EXEC = ("import _posixsubprocess, os\n"
             "def spawn(argv):\n"
             "    return _posixsubprocess.fork_exec(argv, [argv[0]], True, (), None, None, -1, -1, -1, -1, -1, -1,\n"
             "                                      *os.pipe(), True, True, -1, None, None, None, -1, None, False)\n")


def _namespaces_or_skip(r):
    if r.isolation != "namespaces":
        pytest.skip("no namespaces here")


def test_the_hooks_state_is_out_of_the_answers_reach(monkeypatch, tmp_path):
    """F3: `sys.modules['__main__']` was the child module; two assignments turned the audit hook off."""
    from conductor import sandbox

    target = tmp_path / "escaped.txt"
    code = ("import sys, os\nM = sys.modules['__main__']\n"
            "assert sys.argv == ['main.py'] and not hasattr(M, 'WORKDIR') and not hasattr(M, '_PROCESS')\n"
            "M.WORKDIR = ''\nM._PROCESS = set()\nM.NO_SOCKETS = False\n"
            "for attempt in (os.fork, lambda: open(%r, 'w')):\n"
            "    try:\n        attempt()\n        raise SystemExit('not refused')\n"
            "    except PermissionError:\n        pass\n" % str(target))
    assert run_python(code, ROOMY).ok
    monkeypatch.setattr(sandbox, "_isolation", lambda: "audit hook")
    r = run_python(code, ROOMY)
    assert r.ok and r.isolation == "audit hook", r.stderr
    assert not target.exists()


def test_unix_sockets_and_files_in_tmp_are_out_of_reach(tmp_path):
    """F4, F7: the network namespace does not cover UNIX sockets on the host's filesystem, and the
    answer read (and could print into the grade) any file; /tmp, /run and the home folders are now
    empty tmpfs in its mount namespace (those that do not hold the interpreter)."""
    import tempfile

    from conductor import sandbox

    covered = sandbox._covers(os.path.realpath(tempfile.gettempdir()))
    if sandbox._isolation() != "namespaces" or not str(tmp_path.resolve()).startswith(covered):
        pytest.skip("no namespaces here, or the temporary folder holds the interpreter")
    path = tmp_path / "host.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)
    secret = tmp_path / "key.env"
    secret.write_text("OPENAI_API_KEY=sk-canary")
    try:
        r = run_python(f"import socket\nsocket.socket(socket.AF_UNIX).connect({str(path)!r})\n", FAST)
        assert not r.ok and "FileNotFoundError" in r.stderr
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()
        r = run_python(f"print(open({str(secret)!r}).read())\n", FAST)
        assert not r.ok and "sk-canary" not in r.stdout + r.stderr
        for d in covered:  # empty, but for the sandbox's own folder
            r = run_python(f"import os\nprint([f for f in os.listdir({d!r}) if f != os.path.basename(os.getcwd())])\n",
                           ROOMY)
            assert r.ok and r.stdout.strip() == "[]", d
    finally:
        server.close()


def test_the_working_directory_is_a_size_limited_tmpfs():
    """F8: the folder was on the host's disk, bounded only per file (2 GB in 5.6 s)."""
    write = "b = b'x' * (4 << 20)\nfor i in range({n}):\n    open(f'f{{i}}', 'wb').write(b)\n"
    r = run_python(write.format(n=1), Limits(timeout_s=5, cpu_s=5, disk_mb=8))
    _namespaces_or_skip(r)
    assert r.ok, r.stderr
    r = run_python(write.format(n=4), Limits(timeout_s=5, cpu_s=5, disk_mb=8))
    assert not r.ok and "No space left on device" in r.stderr


def test_native_processes_stop_at_the_process_limit():
    """F2: as root RLIMIT_NPROC binds nothing: a shell started natively ran 300 processes."""
    code = FORK_EXEC + ("import time\n"
                        "spawn([b'/bin/sh', b'-c', b'for i in $(seq 200); do sleep 3 & done 2>/dev/null; wait'])\n"
                        "time.sleep(1.5)\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]))\n")
    r = run_python(code, Limits(timeout_s=5, cpu_s=5, processes=32))
    _namespaces_or_skip(r)
    if "pids" not in r.cgroup:
        pytest.skip("no pids cgroup could be made here")
    assert r.ok, r.stderr
    assert int(r.stdout.split()[-1]) <= 32


def test_the_memory_limit_covers_all_processes_together():
    """F2: RLIMIT_AS is per process: three processes held 2.1 GB under a 1 GB limit."""
    code = FORK_EXEC + ("import sys\n"
                        "hog = [sys.executable.encode(), b'-c',\n"
                        "       b'import time; b = b\"x\" * (150 << 20); time.sleep(2)']\n"
                        "pids = [spawn(hog) for _ in range(3)]\n"
                        "print([os.waitpid(p, 0)[1] for p in pids])\n")
    r = run_python(code, Limits(timeout_s=10, cpu_s=10, memory_mb=300))
    if "memory" not in r.cgroup:
        pytest.skip("no memory cgroup could be made here")
    assert r.ok, r.stderr
    statuses = eval(r.stdout.split("\n")[-2])
    assert 9 in statuses and r.memory_killed  # the cgroup's OOM killer took at least one (SIGKILL)


def _sandbox_processes(under: int | None = None) -> set[int]:
    """The sandbox children alive now; with `under`, only those descended from that process (other tests
    may grade at the same time, in other pytest workers)."""
    from tests.procs import processes

    procs = list(processes())
    parent = {p.pid: p.ppid for p in procs}
    found = {p.pid for p in procs if b"sandbox_child.py" in p.cmdline}
    if under is None:
        return found

    def descends(pid: int) -> bool:
        for _ in range(64):
            if pid == under:
                return True
            pid = parent.get(pid, 0)
        return False
    return {pid for pid in found if descends(pid)}


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_an_interrupted_grader_leaves_nothing_running(sig):
    """F5: a grader stopped by Ctrl-C or SIGTERM left the answer running (forever, if it slept) and, on
    SIGTERM, its temporary folders. Now the process group is killed in a `finally`, the child dies with
    the grader (PR_SET_PDEATHSIG), and in namespace mode there is no folder on the host to leave."""
    import glob
    import signal
    import subprocess
    import sys

    from conductor import sandbox

    if sandbox._isolation() != "namespaces":
        pytest.skip("without namespaces a signalled grader leaves its folder behind (documented)")
    before = set(glob.glob("/tmp/conductor-sandbox-*"))
    sleeper = "from conductor.sandbox import Limits, run_python\n" \
              "run_python('import time\\nwhile True:\\n    time.sleep(1)\\n', Limits(timeout_s=60))\n"
    grader = subprocess.Popen([sys.executable, "-c", sleeper], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while len(_sandbox_processes(grader.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        started = _sandbox_processes(grader.pid)
        assert len(started) >= 2, "the sandbox never started"
        grader.send_signal(getattr(signal, sig))
        grader.wait(timeout=10)
        deadline = time.monotonic() + 5
        while started & _sandbox_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started & _sandbox_processes() == set()
        # A folder another worker's grading makes goes within seconds; the grader's would stay. Only
        # those here now are watched: on a busy machine other workers' folders came and went for 5 s
        # on end, and the test took them for the grader's.
        left = set(glob.glob("/tmp/conductor-sandbox-*")) - before
        deadline = time.monotonic() + 15
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left &= set(glob.glob("/tmp/conductor-sandbox-*"))
        assert left == set()
    finally:
        grader.kill()
        grader.wait()
    r = run_python("pass\n", FAST)  # sweeps the cgroups a signalled grader could not remove
    assert r.ok
    left = glob.glob(f"/sys/fs/cgroup/*/**/conductor-sandbox-{grader.pid}-*", recursive=True)
    assert left == []


@pytest.mark.parametrize("prelude", ["", "import polars\n"])  # the CLI imports polars: audit48 F1
def test_ctrl_c_stops_the_code_answers_being_graded_at_once(prelude):
    """audit46 F5: Ctrl-C during `grade_all` cancelled the answers still queued but waited, silent, for
    the sandboxes running (in sessions of their own, out of the terminal's SIGINT) to reach their 10 s
    timeout. Now they are killed at once (their cgroups removed) and the KeyboardInterrupt goes on.
    With polars' threads in the process, the signal reached another thread and the main thread, blocked
    on a result, slept on to the timeout."""
    import glob
    import signal
    import subprocess
    import sys

    grader_script = (prelude + "from conductor.grading import grade_all\n"
                     "sleeper = '```python\\nimport time\\ntime.sleep(60)\\n```'\n"
                     "grade_all([('code', sleeper, 'assert True')] * 6)\n")
    grader = subprocess.Popen([sys.executable, "-c", grader_script], stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
                              # Ctrl-C's default, even in a suite started in the background (which ignores it)
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not _sandbox_processes(grader.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the answers have started
        started = _sandbox_processes(grader.pid)
        assert started, "no sandbox started"
        grader.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        _, stderr = grader.communicate(timeout=60)
        took = time.monotonic() - interrupted
    finally:
        grader.kill()
        grader.wait()
    assert took < 4, f"{took:.1f} s after Ctrl-C"  # it waited out the 10 s timeout: about 9 s
    assert grader.returncode in (-signal.SIGINT, 130) and "KeyboardInterrupt" in stderr, stderr[-2000:]
    deadline = time.monotonic() + 5
    while started & _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started & _sandbox_processes() == set()
    assert glob.glob(f"/sys/fs/cgroup/*/**/conductor-sandbox-{grader.pid}-*", recursive=True) == []


def test_only_harmless_devices_are_there():
    """audit43 F9: a read-only mount does not stop writes to device nodes; started natively (past the
    hook), the answer opened /dev/kmsg and the loop devices for writing."""
    code = FORK_EXEC + ("out = os.open('out', os.O_WRONLY | os.O_CREAT)\n"
                        "pid = _posixsubprocess.fork_exec([b'/bin/sh', b'-c', b'ls /dev; "
                        "for d in kmsg loop0 null; do (: > /dev/$d) 2>/dev/null && echo wrote $d; done; "
                        "head -c 4 /dev/urandom | wc -c'], [b'/bin/sh'], True, (), None, None, -1, -1, -1, out, "
                        "-1, -1, *os.pipe(), True, True, -1, None, None, None, -1, None, False)\n"
                        "os.waitpid(pid, 0)\nprint(open('out').read())\n")
    r = run_python(code, Limits(timeout_s=10, cpu_s=5))
    _namespaces_or_skip(r)
    assert r.ok, r.stderr
    lines = r.stdout.split()
    assert {"kmsg", "loop0", "vda"}.isdisjoint(lines) and {"null", "urandom", "zero"} <= set(lines)
    assert "wrote null" in r.stdout and "wrote kmsg" not in r.stdout and "wrote loop0" not in r.stdout
    assert lines[-1] == "4"
