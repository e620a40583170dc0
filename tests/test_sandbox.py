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
    r = run_python("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())\n", FAST)
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
