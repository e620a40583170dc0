"""The sandbox's child: confine itself, install the audit hook, then run the answer's script.

Started by `conductor.sandbox.run_python` as `python -I sandbox_child.py WORKDIR SCRIPT MODE`.
MODE "ns": started by `unshare` as PID 1 of its own namespaces; every mount but WORKDIR
is made read-only and every capability dropped first (so nothing it runs, whatever the
hook misses, can write outside WORKDIR or undo that). MODE "probe": the same, then a check
that it held, for `sandbox._isolation`. The hook refuses, for everything that runs
after it: writes outside WORKDIR, new processes, native code loading, and (MODE "audit",
without namespaces) every socket.
"""

import ctypes
import os
import sys

WORKDIR = os.path.realpath(sys.argv[1])
SCRIPT = sys.argv[2]
MODE = sys.argv[3]
NO_SOCKETS = MODE == "audit"
# <sys/mount.h>, <linux/prctl.h>, <linux/capability.h>
_MS = {"ro": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS = 24, 28, 38
_SECBITS_ALL_LOCKED = 0x3F  # noroot, no setuid fixup, keep caps off; each locked
_PROCESS = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
            "pty.spawn", "ctypes.dlopen", "ctypes.cdata", "os.kill", "os.killpg"}
_WRITES = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod", "os.chown",
           "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}


def _inside(path) -> bool:
    if isinstance(path, int):
        return True  # an already open descriptor
    try:
        p = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return p == WORKDIR or p.startswith(WORKDIR + os.sep)


def _hook(event, args):
    if event in _PROCESS:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if NO_SOCKETS and event.startswith("socket."):
        raise PermissionError(f"sandbox: {event} is not allowed (no network)")
    if event == "open":
        path, mode, flags = args[0], args[1], args[2]
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory is not allowed")
    elif event in _WRITES:
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                raise PermissionError(f"sandbox: {event} on {a!r} outside the sandbox directory is not allowed")


def _confine() -> None:
    """Read-only mounts but WORKDIR, then no capabilities: raises OSError if any step fails."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret: int, what: str) -> None:
        if ret != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"sandbox: {what}: {os.strerror(e)}")

    check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "private mounts")
    check(libc.mount(WORKDIR.encode(), WORKDIR.encode(), None, _MS_BIND, None), "bind the sandbox folder")
    os.chdir(WORKDIR)  # the working directory still named the folder under the bind, soon read-only
    with open("/proc/self/mountinfo", "rb") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        where = fields[4].decode("unicode_escape").encode("latin-1")  # octal escapes such as \040
        if where == WORKDIR.encode():
            continue
        kept = sum(_MS.get(o, 0) for o in fields[5].decode().split(","))  # flags a user namespace locks
        check(libc.mount(None, where, None, _MS_REMOUNT | _MS_BIND | _MS["ro"] | kept, None),
              f"read-only {where.decode(errors='replace')}")
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


def _probe() -> None:
    """Say "isolated" only if the confinement holds: PID 1, no capabilities, WORKDIR alone writable."""
    _confine()
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    with open("probe", "w") as f:  # relative: the working directory, as the answer's code writes
        f.write("x")
    try:
        with open(os.path.join(os.path.dirname(WORKDIR), "conductor-sandbox-escape"), "w") as f:
            os.remove(f.name)
            return  # writable outside: not isolated
    except OSError:
        pass
    if os.getpid() == 1 and int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0:
        print("isolated")


def main() -> None:
    if MODE == "probe":
        _probe()
        return
    if MODE == "ns":
        try:
            _confine()
        except OSError as e:
            print(e, file=sys.stderr)
            os._exit(71)  # no isolation, no run
        # The code runs in a child: PID 1 ignores the signals limits send (SIGXCPU, SIGXFSZ), and
        # `unshare` cannot pass on a signal its child died of. A signal is exited as 128 + its number.
        pid = os.fork()
        if pid:
            status = os.waitpid(pid, 0)[1]
            os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    with open(SCRIPT, encoding="utf-8", errors="surrogateescape") as f:
        source = f.read()
    code = compile(source, "main.py", "exec")
    sys.addaudithook(_hook)
    exec(code, {"__name__": "__main__", "__file__": "main.py"})


if __name__ == "__main__":
    main()
