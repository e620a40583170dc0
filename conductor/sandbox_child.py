"""The sandbox's child: install the audit hook, then run the answer's script.

Started by `conductor.sandbox.run_python` as `python -I sandbox_child.py WORKDIR SCRIPT MODE`.
The hook refuses, for everything that runs after it: writes outside WORKDIR, new
processes, native code loading, and (MODE "audit", when no network namespace
could be made) every socket.
"""

import os
import sys

WORKDIR = os.path.realpath(sys.argv[1])
SCRIPT = sys.argv[2]
NO_SOCKETS = sys.argv[3] == "audit"
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


def main() -> None:
    with open(SCRIPT, encoding="utf-8", errors="surrogateescape") as f:
        source = f.read()
    code = compile(source, "main.py", "exec")
    sys.addaudithook(_hook)
    exec(code, {"__name__": "__main__", "__file__": "main.py"})


if __name__ == "__main__":
    main()
