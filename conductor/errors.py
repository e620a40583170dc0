"""User-facing errors: the CLI prints the message and exits non-zero, no traceback."""


class ConductorError(Exception):
    """A problem the user can fix: bad input, bad configuration, a missing key. Its
    message is printed and logged, so secrets of the environment are masked in it."""

    def __init__(self, message: object = "", *args: object):
        from conductor.masking import mask

        super().__init__(mask(str(message)), *args)


class InputError(ConductorError):
    """A query set that cannot be used as it is."""


class PoolError(ConductorError):
    """A pool file that does not validate."""


class StorageError(ConductorError):
    """The disk or a database on it failed (full, read-only, gone): the run stopped cleanly."""

    exit_code = 5


class PlanError(ValueError):
    """A plan that does not parse or validate; recorded per plan, never fatal."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (the calls in flight are awaited), then told apart by the
    exit status (143): a background job ignores SIGINT, so the SIGTERM handler cannot pass
    itself off as one."""
