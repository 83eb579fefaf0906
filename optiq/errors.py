"""Errors a user can fix, and the exit codes every command shares."""

EXIT_OK = 0
EXIT_USER_ERROR = 1  # bad input: unknown model, bad trace, bad recipe, ...
EXIT_USAGE = 2  # click's own code for bad flags and flag values
EXIT_GATE_REJECTED_ALL = 3  # apply-fusion, bench --recipes: every recipe failed validation
EXIT_NOTHING_APPLIES = 4  # apply-fusion, bench --recipes: no recipe found a site in the model, so none was gated
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM; what was measured is on disk, the run says "incomplete"


class OptiqError(Exception):
    """A problem with the user's input, reported as one line and exit code ``exit_code`` (never a traceback)."""
    exit_code = EXIT_USER_ERROR


class NothingApplies(OptiqError):
    """No recipe applies to the model: those named find no site in it, or no proposal is worth applying. Not the
    gate's rejection (exit 3): nothing was gated, so its own code tells a script to try other recipes."""
    exit_code = EXIT_NOTHING_APPLIES


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none), for a one-line report."""
    return next(iter(str(exc).splitlines()), type(exc).__name__)
