"""The sandbox's child: confine itself, run the answer's code, then the tests, and say whether they passed.

Started by `conductor.sandbox.run_python` as `python -I sandbox_child.py MODE FD`. FD is a socket to the
grader carrying two length-prefixed frames: the first (settings, the answer's code, a random nonce) is read
at start; the second (the tests, with an HMAC under the nonce) is sent by the grader only after this process
answers an HMAC of "ready" under the nonce, once the answer's code has run. So the tests are nowhere the
answer can read them while it runs, and it cannot slip in its own (both HMACs need the nonce, which it never
sees on the socket).

MODE "ns": started by `unshare` as PID 1 of its own namespaces. It covers the folders listed in the
settings (/tmp, /run, /dev/shm, home folders: those not holding the interpreter) with empty tmpfs, puts
WORKDIR on a size-limited tmpfs, makes every other mount read-only and drops every capability; then forks
the worker (PID 1 ignores the signals limits send). MODE "audit" (no namespaces): the worker runs at once.
MODE "probe": confine as "ns", then check that it held, for `sandbox._isolation`.

The worker runs two phases:
- answer: the code runs as module `main`, not `__main__` (so `if __name__ == "__main__":` demo blocks do not
  run), registered in sys.modules (so its functions pickle). A SystemExit ends this phase and the tests still
  run; any other exception fails the answer, as before.
- tests: compiled by the grader (`compile_tests`, which rewrites `==` and `!=` inside their asserts, see
  `_comparer`), they run in their own namespace, as `__main__`: a copy of the answer's, with the builtins
  as they were before the answer ran (a name the answer defines that is also a builtin keeps its builtin
  meaning there, so `def abs(x): return 0` cannot pass `assert abs(f(x) - y) < 1e-6`). After the
  answer has run, this process calls only functions taken at import. If the tests ran to the end, the
  nonce is written as the last line of stdout with the real os.write, and the process ends at once with
  the real os._exit(0): the grader passes the answer only on that line.
The audit hook, set before the answer runs, refuses writes outside WORKDIR, new processes, native code,
other processes' /proc entries and (MODE "audit") every socket; its state lives in a closure.

None of this is a security boundary: the answer runs in this same process, so code written against this
module can still pass: it can read the nonce from a caller's frame (`sys._getframe(1).f_locals`) and print
it, reach the tests' namespace or the hook's closure by introspection, or change modules the tests import
(`math.isclose`). It stops the simple tricks (exiting early, an `__eq__` that is always true, reading the
tests' file, replacing builtins). The namespaces (MODE "ns") are the boundary for what it can reach.
"""

import ast
import builtins
import ctypes
import marshal
import os
import sys
import types

import _hashlib

# Taken now, before any answer code can replace them (builtins and module attributes are shared with it).
_WRITE, _READ, _EXIT, _CLOSE, _LOADS, _HMAC = os.write, os.read, os._exit, os.close, marshal.loads, _hashlib.hmac_digest
_EXEC, _DICT, _LEN, _MIN, _INT, _BASE, _SYSEXIT = exec, dict, len, min, int, BaseException, SystemExit
_OPEN, _TYPE, _DISPLAY, _BLOCKING = open, type, sys.__excepthook__, os.set_blocking
# <sys/mount.h>, <linux/prctl.h>, <linux/capability.h>
_MS = {"ro": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS = 4, 24, 28, 38
_SECBITS_ALL_LOCKED = 0x3F  # noroot, no setuid fixup, keep caps off; each locked
_DEVICES = ("null", "zero", "full", "random", "urandom")  # all an answer's code may open under /dev


def read_frame(fd: int) -> bytes:
    """One frame: 8 bytes of length, then that many bytes. Raises EOFError if it is cut short."""
    def exactly(n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = _READ(fd, _MIN(n - got, 1 << 20))
            if not chunk:
                raise EOFError("sandbox: the tests did not arrive whole (did the answer read them?)")
            chunks.append(chunk)
            got += _LEN(chunk)
        return b"".join(chunks)
    return exactly(_INT.from_bytes(exactly(8), "big"))


def _make_hook(workdir: str, no_sockets: bool):
    """The audit hook, with its settings (and the builtins it calls) in a closure rather than in globals
    or builtins the answer could change. It still resolves paths with os.path.realpath, Python code
    whose helpers (os.lstat, os.fspath) the answer can replace: in-process, it is a guard, not a boundary."""
    process = frozenset({"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                         "subprocess.Popen", "pty.spawn", "ctypes.dlopen", "ctypes.cdata", "os.kill", "os.killpg"})
    writes = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod",
                        "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"})
    realpath, fsdecode, pid = os.path.realpath, os.fsdecode, str(os.getpid())
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    isinstance_, str_, int_, any_, refused = isinstance, str, int, any, PermissionError
    pathlike = (str, bytes, os.PathLike)

    def resolved(path):
        try:
            return realpath(fsdecode(path))
        except (TypeError, ValueError):
            return None

    def inside(path) -> bool:
        if isinstance_(path, int_):
            return True  # an already open descriptor
        p = resolved(path)
        return p is not None and (p == workdir or p.startswith(workdir + "/"))

    def hook(event, args):
        if event in process:
            raise refused(f"sandbox: {event} is not allowed")
        if no_sockets and event.startswith("socket."):
            raise refused(f"sandbox: {event} is not allowed (no network)")
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            writing = (mode is not None and any_(c in str_(mode) for c in "wax+")) or (
                isinstance_(flags, int_) and flags & write_flags)
            if writing and not inside(path):
                raise refused(f"sandbox: writing {path!r} outside the sandbox directory is not allowed")
            p = resolved(path) if isinstance_(path, pathlike) else None
            owner = p[6:].split("/")[0] if p and p.startswith("/proc/") else ""
            if owner.isdigit() and owner != pid:
                raise refused(f"sandbox: another process's {p!r} is not allowed")
        elif event in writes:
            for a in args:
                if isinstance_(a, pathlike) and not inside(a):
                    raise refused(f"sandbox: {event} on {a!r} outside the sandbox directory is not allowed")
    return hook


def _comparer():
    """`eq(a, b)` and `ne(a, b)`, what the tests' asserts use for `==` and `!=`. Where one side is a
    plain builtin value (a number, string, bytes, None, or a list/tuple/dict/set of them) and the other is
    not, the other is first turned into builtins: a subclass of a builtin through that builtin (an int
    subclass as its int, a list subclass as a list, element by element), a value of a class the answer
    defined, or any other value that is not a number, into a marker equal to nothing. So an answer's
    `__eq__` cannot agree with an expected literal, nor can a library's permissive one (`mock.ANY`, a
    `UserList` around such a value), while 1 == 1.0, np.int64(3) == 3 and Fraction(1, 2) == 0.5 hold as
    before. Two non-plain values (say two of the answer's objects) compare with their own `==`. Kept as
    they are: values of a class written in C (read from the type's real flags: a metaclass can define its
    own `__flags__`), and numbers (numbers.Number) of a class found by its name in a module loaded from
    the interpreter's folders; code written against this check can plant one there."""
    list_, tuple_, set_, frozenset_, dict_, str_, object_ = list, tuple, set, frozenset, dict, str, object
    scalars = frozenset_({int, float, complex, bool, str, bytes, type(None)})
    containers = (list_, tuple_, set_, frozenset_)
    bases = (int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset)
    convert = {int: int.__int__, float: float.__float__, complex: complex.__complex__, str: str.__str__,
               bytes: bytes.__bytes__, bytearray: bytearray}
    typ, issub, getattr_, all_, exception, isinstance_ = type, issubclass, getattr, all, Exception, isinstance
    flags = type.__dict__["__flags__"].__get__  # the type's own flags, whatever its metaclass says
    from numbers import Number
    prefixes = tuple_(os.path.realpath(p) + "/" for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    modules, realpath = sys.modules, os.path.realpath

    def plain(x) -> bool:
        t = typ(x)
        if t in scalars:
            return True
        if t in containers:
            return all_(plain(e) for e in x)
        if t is dict_:
            return all_(plain(k) and plain(v) for k, v in dict_.items(x))
        return False

    def library(t) -> bool:
        try:
            mod = modules.get(t.__module__)
            f = getattr_(mod, "__file__", None)
            if typ(f) is not str_ or not str_.startswith(realpath(f), prefixes):
                return False
            obj = mod
            for part in str_.split(t.__qualname__, "."):
                obj = getattr_(obj, part)
            return obj is t
        except exception:  # anything odd is the answer's
            return False

    def norm(x):
        t = typ(x)
        if t in scalars:
            return x
        for base in bases:
            if issub(t, base):
                if base in containers:
                    return base(norm(e) for e in base.__iter__(x))
                if base is dict_:
                    return {norm(k): norm(v) for k, v in dict_.items(x)}
                return convert[base](x)
        if not flags(t) & (1 << 9) or (isinstance_(x, Number) and library(t)):  # C, or a library's number
            return x
        return object_()  # the answer's own class, or a library's non-number: equal to nothing

    def eq(a, b):
        pa, pb = plain(a), plain(b)
        if pa is pb:
            return a == b
        return norm(a) == b if pb else a == norm(b)

    def ne(a, b):
        pa, pb = plain(a), plain(b)
        if pa is pb:
            return a != b
        return norm(a) != b if pb else a != norm(b)
    return eq, ne


class _Asserts(ast.NodeTransformer):
    """Rewrite `x == y` / `x != y` (a single comparison) inside assert statements to `__sandbox_eq__(x, y)`
    / `__sandbox_ne__(x, y)`. Chained comparisons, `<`, `in`, truthiness and unittest's assertEqual are
    left as written."""

    def visit_Assert(self, node):
        node.test = _Compares().visit(node.test)
        return node


class _Compares(ast.NodeTransformer):
    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            return node
        name = "__sandbox_eq__" if isinstance(node.ops[0], ast.Eq) else "__sandbox_ne__"
        return ast.copy_location(ast.Call(ast.Name(name, ast.Load()), [node.left, node.comparators[0]], []), node)


def compile_tests(source: str) -> bytes:
    """The tests, asserts rewritten, compiled and marshalled. Done by the grader, not here: after the
    answer has run, this process calls no Python library code (ast, marshal's module attributes), which
    the answer could have replaced, only C functions taken at import."""
    try:
        tree = ast.fix_missing_locations(_Asserts().visit(ast.parse(source, "tests.py")))
        code = compile(tree, "tests.py", "exec", optimize=0)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        code = compile(f"raise SyntaxError({f'the tests do not compile: {e}'!r})", "tests.py", "exec")
    return marshal.dumps(code)


def _fail(e: BaseException) -> None:
    """End the run as failed: flush what the answer printed, print the traceback (the interpreter's own
    printer, in C: a million-frame recursion prints in no time) to fd 2, exit 1."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except _BASE:  # the answer may have replaced them
            pass
    try:
        sys.stderr = _OPEN(2, "w", closefd=False, errors="backslashreplace")
        _DISPLAY(_TYPE(e), e, e.__traceback__)
        sys.stderr.flush()
    except _BASE:
        _WRITE(2, b"sandbox: the answer failed\n")
    _EXIT(1)


def _confine(settings: dict) -> None:
    """Tmpfs over the covered folders and as WORKDIR, every other mount read-only, no capabilities:
    raises OSError if any step fails."""
    libc = ctypes.CDLL(None, use_errno=True)
    workdir, cover = settings["workdir"], sorted(settings["cover"])  # parents before what lies in them

    def check(ret: int, what: str) -> None:
        if ret != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"sandbox: {what}: {os.strerror(e)}")

    def tmpfs(where: str, options: str) -> None:
        os.makedirs(where, exist_ok=True)  # under a folder just covered, it is made on the new tmpfs
        check(libc.mount(b"tmpfs", where.encode(), b"tmpfs", _MS["nosuid"] | _MS["nodev"], options.encode()),
              f"tmpfs on {where}")

    check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "private mounts")
    # A /dev of its own with only the harmless devices: a read-only mount does not stop writes to a
    # device node (/dev/kmsg, the loop devices were open for writing). Bound through descriptors taken
    # before the tmpfs hides the originals.
    devices = {}
    for name in _DEVICES:
        try:
            devices[name] = os.open(f"/dev/{name}", os.O_PATH)
        except OSError:
            pass
    tmpfs("/dev", "size=64k,mode=755")
    for name, fd in devices.items():
        open(f"/dev/{name}", "w").close()  # the mount point
        check(libc.mount(f"/proc/self/fd/{fd}".encode(), f"/dev/{name}".encode(), None, _MS_BIND, None),
              f"bind /dev/{name}")
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")
    cover = ["/dev", *cover]  # what the old /dev held is unreachable now, like what the covers hide
    for where in cover[1:]:
        tmpfs(where, "size=1m,mode=755")
    tmpfs(workdir, f"size={settings['disk_mb']}m,mode=755")
    os.chdir(workdir)
    with open("/proc/self/mountinfo", "rb") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        where = fields[4].decode("unicode_escape").encode("latin-1")  # octal escapes such as \040
        if where == workdir.encode():
            continue
        kept = sum(_MS.get(o, 0) for o in fields[5].decode().split(","))  # flags a user namespace locks
        if libc.mount(None, where, None, _MS_REMOUNT | _MS_BIND | _MS["ro"] | kept, None) != 0:
            hidden = any(where.startswith(c.encode() + b"/") for c in cover)  # under a tmpfs now: unreachable
            if not (hidden and ctypes.get_errno() in (2, 22)):  # ENOENT, EINVAL (no longer a mount point)
                check(-1, f"read-only {where.decode(errors='replace')}")
    for cap in range(int(open("/proc/sys/kernel/cap_last_cap").read()) + 1):
        check(libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    check(libc.prctl(_PR_SET_SECUREBITS, _SECBITS_ALL_LOCKED, 0, 0, 0), "securebits")

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    check(libc.capset(ctypes.byref(Header(0x20080522, 0)), ctypes.byref((Data * 2)())), "drop capabilities")
    check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")


def _undumpable() -> None:
    """Without capabilities, no other process (nothing the answer starts natively) may then read this
    one's memory or descriptors through /proc."""
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def _probe(settings: dict) -> None:
    """Say "isolated" only if the confinement (done just before) holds: PID 1, no capabilities, WORKDIR
    alone writable."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    with open("probe", "w") as f:  # relative: the working directory, as the answer's code writes
        f.write("x")
    for outside in (os.path.dirname(settings["workdir"]), *settings["cover"]):
        try:
            with open(os.path.join(outside, "conductor-sandbox-escape"), "w") as f:
                os.remove(f.name)
                return  # writable outside: not isolated
        except OSError:
            pass
    if os.getpid() == 1 and int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0:
        print("isolated")


def _worker(fd: int, settings: dict) -> None:
    workdir, nonce, source = settings["workdir"], settings["nonce"], settings["code"]
    _undumpable()
    path = os.path.join(workdir, "main.py")
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(source)  # for tracebacks and inspect.getsource; the tests are not in it
    answer = types.ModuleType("main")
    answer.__file__ = path
    sys.modules["main"] = answer
    sys.modules["__main__"] = types.ModuleType("__main__")  # not this module, whose state the answer could change
    sys.argv = ["main.py"]
    clean_builtins = _DICT(builtins.__dict__)
    eq, ne = _comparer()
    sys.addaudithook(_make_hook(workdir, settings["mode"] == "audit"))
    del settings
    try:
        _EXEC(compile(source, path, "exec"), answer.__dict__)
    except _SYSEXIT:
        pass  # the answer's script ended itself: the tests still run
    except _BASE as e:  # any other failure of the answer's code fails it
        _fail(e)
    try:
        _BLOCKING(fd, True)  # the answer may have made it non-blocking
        _WRITE(fd, _HMAC(nonce, b"ready", "sha256"))  # the grader sends the tests only now
        frame = read_frame(fd)
        mac, body = frame[:32], frame[32:]
        if _HMAC(nonce, body, "sha256") != mac:
            raise EOFError("sandbox: the tests did not arrive whole or were replaced")
        # The answer's names, but not over builtins the tests call (`def abs(x): return 0` passed
        # `assert abs(f(1.5) - 0.5) < 1e-6`); and the tests run as __main__, so tests under an
        # `if __name__ == "__main__":` guard run (as module `main` they were skipped: everything passed).
        namespace = {k: v for k, v in _DICT.items(answer.__dict__) if k not in clean_builtins}
        namespace.update(__name__="__main__", __builtins__=clean_builtins, __sandbox_eq__=eq,
                         __sandbox_ne__=ne)
        _EXEC(_LOADS(body), namespace)
    except _BASE as e:  # a failed test, or the answer exiting during the tests
        _fail(e)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except _BASE:  # replaced by the answer: its output may be lost, not the verdict
            pass
    mark = b"\n" + nonce + b"\n"
    while mark:
        mark = mark[_WRITE(1, mark):]
    _EXIT(0)


def main() -> None:
    mode, fd = sys.argv[1], int(sys.argv[2])
    try:
        settings = marshal.loads(read_frame(fd))
    except (EOFError, ValueError, OSError) as e:
        print(f"sandbox: no settings: {e}", file=sys.stderr)
        _EXIT(70)
    settings["mode"] = mode
    if mode in ("ns", "probe"):
        try:
            _confine(settings)
        except OSError as e:
            print(e, file=sys.stderr)
            _EXIT(71)  # no isolation, no run
        if mode == "probe":
            _probe(settings)
            return
        _undumpable()
        # The code runs in a child: PID 1 ignores the signals limits send (SIGXCPU, SIGXFSZ), and
        # `unshare` cannot pass on a signal its child died of. A signal is exited as 128 + its number.
        pid = os.fork()
        if pid:
            _CLOSE(fd)
            status = os.waitpid(pid, 0)[1]
            # An exit status above 128 would read as a signal (os._exit(137) as "killed: CPU time limit").
            _EXIT(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else min(os.WEXITSTATUS(status), 128))
    os.set_inheritable(fd, False)
    _worker(fd, settings)


if __name__ == "__main__":
    main()
