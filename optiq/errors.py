"""Errors a user can fix, and the exit codes every command shares."""

EXIT_OK = 0
EXIT_USER_ERROR = 1  # bad input: unknown model, bad trace, bad recipe, ...
EXIT_USAGE = 2  # click's own code for bad flags
EXIT_GATE_REJECTED_ALL = 3  # apply-fusion, bench --recipes: every recipe failed validation
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM; what was measured is on disk, the run says "incomplete"


class OptiqError(Exception):
    """A problem with the user's input, reported as one line and exit code 1 (never a traceback)."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none), for a one-line report."""
    return next(iter(str(exc).splitlines()), type(exc).__name__)
