"""The `code` grader's verdict (audit 43 F1, F6): an answer passes only if the reference's tests ran to
the end and passed. Its exit status is no longer the verdict: each trick below passed before."""

from __future__ import annotations

import pytest

from conductor.grading import _code_of, grade
from conductor.sandbox import run_python

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
WRONG = "def add(a, b):\n    return a - b\n"
RIGHT = "def add(a, b):\n    return a + b\n"


def fenced(code: str) -> str:
    return f"Here:\n```python\n{code}```\n"


@pytest.mark.parametrize("trick", [
    "import sys\nsys.exit(0)\n",
    "raise SystemExit\n",
    "exit()\n",
    "import os\nos._exit(0)\n",
    "import atexit, os\natexit.register(os._exit, 0)\n",
    "import sys, os\nsys.excepthook = lambda *a: os._exit(0)\n",
    "import threading, os, time\nthreading.Thread(target=lambda: (time.sleep(0.2), os._exit(0))).start()\n",
    "import signal, os, time\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.0001)\ntime.sleep(0.01)\n",
    "import os, sys\nprint('passed')\nsys.stdout.flush()\nos._exit(0)\n",
    "import sys\ndef main():\n    return 0\nif __name__ == '__main__':\n    sys.exit(main())\n",
])
def test_a_wrong_answer_cannot_end_the_run_as_passed(trick):
    g = grade("code", fenced(WRONG + trick), TESTS)
    assert g.correct is False, g.detail


def test_an_answer_cannot_read_its_tests_from_its_file():
    table = ("import re\n_t = {}\n"
             "for a, b, r in re.findall(r'assert add\\((.+?), (.+?)\\) == (.+)', open(__file__).read()):\n"
             "    _t[(eval(a), eval(b))] = eval(r)\ndef add(a, b):\n    return _t[(a, b)]\n")
    assert grade("code", fenced(table), TESTS).correct is False


@pytest.mark.parametrize("value", [
    "class A:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n",
    "class A(int):\n    def __eq__(self, other): return True\n",  # an int subclass compares as its int (0)
    "class A(str):\n    def __eq__(self, other): return True\n",
    "class A(list):\n    def __eq__(self, other): return True\n",
])
def test_an_always_equal_value_is_not_equal_to_the_expected_one(value):
    code = value + "def add(a, b):\n    return A()\n"
    assert grade("code", fenced(code), TESTS).correct is False
    nested = "def check(candidate):\n    assert all(candidate(a, 1) == [a + 1] for a in range(3))\ncheck(add)\n"
    listed = value + "def add(a, b):\n    return [A()]\n"
    assert grade("code", fenced(listed), nested).correct is False


@pytest.mark.parametrize("code", [
    "class N(int):\n    pass\ndef add(a, b):\n    return N(a + b)\n",  # through its builtin base
    "def add(a, b):\n    return float(a + b)\n",  # 5.0 == 5, as before
    "from fractions import Fraction\ndef add(a, b):\n    return Fraction(a + b)\n",  # a library's class: as it is
    "import numpy\ndef add(a, b):\n    return numpy.int64(a + b)\n",  # written in C: as it is
    "from collections import namedtuple\nP = namedtuple('P', 'x')\ndef add(a, b):\n    return P(a + b)[0]\n",
])
def test_honest_values_still_compare_as_before(code):
    g = grade("code", fenced(code), TESTS)
    assert g.correct is True, g.detail


def test_an_always_unequal_value_is_compared_as_its_builtin_base():
    code = "class A(int):\n    def __ne__(self, other): return True\ndef add(a, b):\n    return A(a - b)\n"
    assert grade("code", fenced(code), "assert add(2, 3) != -1\n").correct is False


def test_the_answers_own_objects_compare_with_its_own_equality():
    vec = ("class Vec:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
           "    def __add__(self, o):\n        return Vec(self.x + o.x, self.y + o.y)\n"
           "    def __eq__(self, o):\n        return (self.x, self.y) == (o.x, o.y)\n")
    assert grade("code", fenced(vec), "assert Vec(1, 2) + Vec(3, 4) == Vec(4, 6)\n").correct is True
    assert grade("code", fenced(vec), "assert Vec(1, 2) + Vec(3, 4) != Vec(4, 7)\n").correct is True


@pytest.mark.parametrize("script", [
    "import sys\ndef main():\n    print(add(2, 3))\nif __name__ == '__main__':\n    sys.exit(main())\n",
    "if __name__ == '__main__':\n    print(add(int(input()), 1))\n",
    "import argparse\nif __name__ == '__main__':\n    print(argparse.ArgumentParser().parse_args())\n",
    "import unittest\nclass T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(1, 1), 2)\n"
    "if __name__ == '__main__':\n    unittest.main()\n",
    "import sys\nsys.exit(1)\n",  # ends the answer's part; the tests still run
    "raise SystemExit(3)\n",
])
def test_a_right_answer_written_as_a_script_is_tested_and_passes(script):
    g = grade("code", fenced(RIGHT + script), TESTS)
    assert g.correct is True, g.detail


def test_an_exception_in_the_answers_code_fails_it():
    g = grade("code", fenced(RIGHT + "raise ValueError('boom')\n"), TESTS)
    assert g.correct is False and "ValueError: boom" in g.detail


def test_exiting_while_the_tests_run_fails():
    for exit_ in ("import sys; sys.exit(0)", "import os; os._exit(0)"):
        code = f"def add(a, b):\n    {exit_}\n"
        assert grade("code", fenced(code), TESTS).correct is False


def test_the_tests_arrive_after_the_answer_and_cannot_be_read_or_replaced_by_it():
    # Everything the answer can read while it runs holds no test: they are sent only once it has run.
    peek = ("import os\nseen = b''\nfor fd in range(3, 64):\n    try:\n        os.set_blocking(fd, False)\n"
            "        while chunk := os.read(fd, 1 << 16):\n            seen += chunk\n    except OSError:\n"
            "        pass\nprint('saw the tests' if b'add' in seen else 'saw no test')\n")
    r = run_python(RIGHT + peek, tests=TESTS)
    assert r.ok and r.stdout == "saw no test\n", (r.stdout, r.stderr)
    # Tests of its own, queued on a socket put in place of the grader's, fail the HMAC check. (Tests
    # queued in advance were read and replayed this way, unchanged, by audit45.)
    fake = ("import marshal, os, socket, stat\nbody = marshal.dumps(compile('pass', 't', 'exec'))\n"
            "data = bytes(32) + body\na, b = socket.socketpair()\nb.sendall(len(data).to_bytes(8, 'big') + data)\n"
            "for fd in range(3, 64):\n    try:\n"
            "        if stat.S_ISSOCK(os.fstat(fd).st_mode) and fd not in (a.fileno(), b.fileno()):\n"
            "            os.dup2(a.fileno(), fd)\n    except OSError:\n        pass\n")
    g = grade("code", fenced(WRONG + fake), TESTS)
    assert g.correct is False and "were replaced" in g.detail, g.detail


@pytest.mark.parametrize("code", [
    "from unittest.mock import ANY\ndef add(a, b):\n    return ANY\n",
    "from collections import UserList\nclass E:\n    def __eq__(self, o): return True\n"
    "def add(a, b):\n    u = UserList()\n    u.data = E()\n    return u\n",
    "class M(type):\n    __flags__ = 0\nclass E(metaclass=M):\n    def __eq__(self, o): return True\n"
    "def add(a, b):\n    return E()\n",
])
def test_a_library_object_or_a_faked_c_class_that_equals_everything_does_not_pass(code):
    """audit45 F1, F2: library classes were compared as they are (`mock.ANY == 5`), and a metaclass's
    own `__flags__` made the answer's class look written in C."""
    assert grade("code", fenced(code), TESTS).correct is False


def test_a_name_the_answer_defines_does_not_replace_a_builtin_the_tests_call():
    """audit45 F5: `def abs(x): return 0` passed `assert abs(add(2, 3) - 5) < 1e-9`."""
    g = grade("code", fenced(WRONG + "def abs(x):\n    return 0\n"), "assert abs(add(2, 3) - 5) < 1e-9\n")
    assert g.correct is False, g.detail


def test_tests_under_a_main_guard_run():
    """audit45 F6: the tests saw the answer's module name, so guarded tests never ran and every answer
    passed."""
    guarded = "if __name__ == '__main__':\n    assert add(2, 3) == 5\n"
    assert grade("code", fenced(WRONG), guarded).correct is False
    assert grade("code", fenced(RIGHT), guarded).correct is True


def test_builtins_the_answer_replaces_do_not_reach_the_tests():
    patch = "import builtins\nbuiltins.abs = lambda x: 0\n"
    g = grade("code", fenced(WRONG + patch), "assert abs(add(2, 3) - 5) < 1e-9\n")
    assert g.correct is False, g.detail


def test_the_completion_mark_is_not_in_the_reported_output():
    r = run_python("print('hello')\n", tests="print('tests ran')\n")
    assert r.ok and r.stdout == "hello\ntests ran\n"
    r = run_python("import sys\nsys.stdout.write('no newline')\n")
    assert r.ok and r.stdout == "no newline"


# ------------------------------------------------------------------ F6: which code is the answer's

def test_python_blocks_are_joined_in_order():
    two = "Function:\n```python\ndef add(a, b):\n    return a + b\n```\nUsage:\n```python\nprint(add(2, 3))\n```\n"
    assert _code_of(two) == "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"
    assert grade("code", two, TESTS).correct is True
    draft = ("```python\ndef add(a, b)\n    return a - b\n```\n"
             "Fixed:\n```python\ndef add(a, b):\n    return a + b\n```\n")
    assert grade("code", draft, TESTS).correct is True  # joined, it does not compile: the last block alone
    assert _code_of(_code_of(two)) == _code_of(two)  # extracting again gives it back


@pytest.mark.parametrize("response", [
    "~~~python\ndef add(a, b):\n    return a + b\n~~~\n",
    "\ufeffdef add(a, b):\n    return a + b\n",
    "\ufeff```python\n\ufeffdef add(a, b):\n    return a + b\n```\n",
])
def test_tilde_fences_and_a_byte_order_mark(response):
    assert grade("code", response, TESTS).correct is True


def test_an_answer_may_run_forty_threads_at_once():
    """audit45 F8: glibc reserves 64 MB of address space per thread arena, so about 20 live threads used
    up the 1 GB RLIMIT_AS and `can't start new thread` failed a right answer."""
    code = ("import threading, time\nout = []\ndef work(i):\n    time.sleep(0.3)\n    out.append(i)\n"
            "threads = [threading.Thread(target=work, args=(i,)) for i in range(40)]\n"
            "for t in threads:\n    t.start()\nfor t in threads:\n    t.join()\n")
    r = run_python(code, tests="assert sorted(out) == list(range(40))\n")
    assert r.ok, r.stderr


def test_an_exit_status_above_128_is_not_reported_as_a_kill():
    """audit43 F10: in namespace mode `os._exit(137)` read as "killed: CPU time limit"."""
    r = run_python("import os\nos._exit(137)\n")
    assert not r.ok and "killed" not in r.detail and r.detail.startswith("exit 1"), r.detail


def test_code_answers_are_graded_side_by_side():
    """One sandbox at a time made a set of answers that each wait out part of the timeout take the sum of
    their waits; `grade_all` runs one per core, in order of the items."""
    import os
    import threading
    import time

    from conductor.grading import grade_all
    from tests.procs import processes

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: one sandbox at a time")
    me, most, done = os.getpid(), 0, threading.Event()

    def running() -> int:  # the sandboxes this process started, one direct child each
        return sum(p.ppid == me and b"sandbox_child.py" in p.cmdline for p in processes())

    def watch() -> None:
        nonlocal most
        while not done.is_set():
            most = max(most, running())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    slow = RIGHT + "import time\ntime.sleep(1.5)\n"
    try:
        grades = grade_all([("code", fenced(slow), TESTS), ("math", "Answer: 4", "4"),
                            ("code", fenced(WRONG), TESTS), ("code", fenced(slow), TESTS)])
    finally:
        done.set()
        watcher.join()
    assert [g.correct for g in grades] == [True, True, False, True]
    assert most >= 2
