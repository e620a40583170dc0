"""The `conductor` command. Each subcommand lives in its own module of this
package and exposes `register(subparsers)`; modules are found automatically,
so adding a command touches no shared file (`options` and `render` are helpers
the commands share, not commands).

Building the parser imports only light modules: each command imports what it
runs inside its own body, so `conductor --help` never loads litellm, polars or
Dagster."""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import pkgutil
import sys

from conductor.errors import ConductorError, Terminated

# litellm fetches its price map from the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conductor", description="Plan and run LLM workflows over query sets, in batch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from conductor.cli.options import join_dash_values

    try:
        args = build_parser().parse_args(join_dash_values(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as e:
        # argparse drops a failed write of `--help` silently (`--help > /dev/full` exited 0)
        if e.code == 0 and _failing_stdout():
            print("conductor: error: cannot write standard output: the help was not written", file=sys.stderr)
            return 5
        raise
    terminated = _on_sigterm_stop_as_on_ctrl_c()
    try:
        return int(args.func(args) or 0)
    except ConductorError as e:
        print(f"conductor: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except BrokenPipeError:  # before OSError, its base class
        # The reader stopped early (`| head`): not an error. Point stdout at /dev/null so
        # Python's exit-time flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
            raise
        what = e.filename or _failing_stdout() or "an open file or standard output (not named by the system)"
        print(f"conductor: error: cannot write {what}: {e.strerror}. Free space (or fix the disk) "
              f"and rerun the same command: finished work is kept", file=sys.stderr)
        return 5
    except KeyboardInterrupt as e:  # Terminated: SIGTERM, seen by the executor's own handler
        return _interrupted(terminated or isinstance(e, Terminated), args)
    except Exception as e:
        # DuckDB turns Ctrl-C into its own error, and a damaged Parquet file into another: neither is a bug
        if type(e).__name__ == "InterruptException" or str(e).startswith("Query interrupted"):
            return _interrupted(terminated, args)
        if type(e).__module__ == "_duckdb" and ("Parquet" in str(e) or "magic bytes" in str(e)):
            first = str(e).strip().splitlines()[0]
            print(f"conductor: error: a file is damaged or not Parquet: {first}. Restore it, or run again the "
                  f"command that wrote it", file=sys.stderr)
            return 2
        raise


def _interrupted(terminated: bool | list[int], args: argparse.Namespace) -> int:
    """Exit 130 (Ctrl-C) or 143 (SIGTERM), saying what a rerun does: most commands resume;
    those that keep nothing (`resumes=False`: the evaluations, policy training, the graders'
    check) start again."""
    again = "resume" if getattr(args, "resumes", True) else "start again (this command does not resume)"
    print(f"conductor: {'terminated' if terminated else 'interrupted'}; rerun the same command to {again}",
          file=sys.stderr)
    return 143 if terminated else 130


def _on_sigterm_stop_as_on_ctrl_c() -> list[int]:
    """SIGTERM (Kubernetes, systemd, a scheduler) takes Ctrl-C's path: the running plans stop,
    their sessions close, the journal is kept and uploaded, and the exit says how to resume.
    Its default ended the process with nothing said. Returns a list that is non-empty once
    SIGTERM came."""
    import signal
    import threading

    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        return came

    def stop(signum, frame):
        came.append(signum)
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
            raise KeyboardInterrupt  # SIGINT ignored (a background job): stop here
        os.kill(os.getpid(), signal.SIGINT)  # asyncio's own Ctrl-C handling, where it runs

    stop.as_ctrl_c = True  # the executor takes SIGTERM over while it runs, to await the calls in flight
    signal.signal(signal.SIGTERM, stop)
    return came


def _failing_stdout() -> str | None:
    """'standard output' when it is what failed (`> /dev/full`), which errors do not name."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (tests capture it)
        return None
    try:
        sys.stdout.flush()
        os.write(fd, b"")  # a full device refuses even an empty write
    except OSError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)  # so the exit-time flush is quiet
        return "standard output"
    return None


if __name__ == "__main__":
    sys.exit(main())
