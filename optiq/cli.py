"""The ``optiq`` command group. Each command lives in ``optiq.commands`` and is imported only when it runs, so
``optiq analyze`` never pays for importing torch and ``--help`` answers at once. This file also turns every failure
into one line and an exit code, and Ctrl-C or SIGTERM into a clean stop."""

from __future__ import annotations

import errno
import importlib
import os
import signal
import sys

from contextlib import suppress

import click

from optiq import __version__
from optiq.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, OptiqError, first_line
from optiq.text import visible

# name -> (module in optiq.commands holding a command of that module's name, one-line help for `optiq --help`).
COMMANDS = {
    "profile": ("profile", "Profile the decode step; attribute GPU time to op classes and module roles."),
    "analyze": ("analyze", "Attribute GPU time in traces captured anywhere (torch.profiler, vLLM, SGLang)."),
    "recipes": ("recipes", "List the fusion recipe catalog (and `recipes show NAME`)."),
    "apply-fusion": ("apply_fusion", "Patch the model with fusion recipes, validate, re-measure, report."),
    "bench": ("bench", "Decode throughput against concurrency, with the bandwidth floor."),
    "report": ("report", "Render or compare runs."),
}

TRACEBACK_VARIABLE = "OPTIQ_TRACEBACK"  # set to 1: an unexpected exception shows its traceback, not one line
ERROR_CHARS = 2000  # an error line is cut past this: a message quoting a whole file or name says nothing more


def _error(message: object) -> None:
    click.echo(f"optiq: error: {visible(message, limit=ERROR_CHARS)}", err=True)


def _one_line(exc: BaseException) -> str:
    """What the user reads for an exception no command turned into an OptiqError: the file system's refusal as it
    is (a full disk, a quota, permissions), running out of host memory, or else a bug in optiq, named as one."""
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        full = " (the disk or a file size limit is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) \
            else ""
        return f"{where}{exc.strerror or first_line(exc)}{full}"
    if isinstance(exc, MemoryError):
        return "out of host memory; try a smaller input, --concurrency or --max-len"
    return (f"unexpected {type(exc).__name__}: {first_line(exc)} (a bug in optiq; {TRACEBACK_VARIABLE}=1 shows the "
            "traceback)")


class OptiqGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module = COMMANDS[name][0]
        return getattr(importlib.import_module(f"optiq.commands.{module}"), module)

    def format_commands(self, ctx, formatter):
        with formatter.section("Commands"):
            formatter.write_dl([(name, summary) for name, (_, summary) in COMMANDS.items()])

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:  # usage: click prints it, with the bad value made visible
            exc.message = visible(exc.message, limit=ERROR_CHARS)
            raise
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except OptiqError as exc:
            _error(exc)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("optiq: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:  # stdout's reader (`| head`) is gone: nothing left to tell it, nor to flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(EXIT_USER_ERROR)
        except Exception as exc:
            if os.environ.get(TRACEBACK_VARIABLE) == "1":
                raise
            _error(_one_line(exc))
            ctx.exit(EXIT_USER_ERROR)


HELP = """optiq: make LLM decode fast by measurement.

\b
Exit codes: 0 ok, 1 user error (bad model, trace, recipe or flag value), 2 usage (unknown flag, a value
of the wrong type or range, checked before anything is loaded),
3 the validation gate rejected every recipe, 4 no recipe applies to the model (nothing was gated),
130 interrupted by Ctrl-C or SIGTERM (results so far kept, run marked incomplete). Every error is one
line, and a failed run is marked so in its run.json; OPTIQ_TRACEBACK=1 shows the traceback of an
unexpected one.
"""


@click.group(cls=OptiqGroup, help=HELP)
@click.version_option(__version__, prog_name="optiq")
def cli():
    pass


_stopping = False


def _interrupt(signum, frame):
    """SIGINT and SIGTERM: the first stops the command as Ctrl-C does. Any later one is ignored: the stop marks the
    run incomplete and saves the record, and a second Ctrl-C must not cut that short (a run.json left "running", a
    traceback). The process ends as soon as that is written."""
    global _stopping
    if _stopping:
        with suppress(OSError):  # stderr may be gone with the terminal
            os.write(2, b"optiq: stopping; saving what was measured\n")
        return
    _stopping = True
    raise KeyboardInterrupt


def main() -> None:
    # SIGTERM (timeout, a scheduler, a container stopping) ends a run as Ctrl-C does: kept, marked incomplete. A
    # SIGINT the shell ignores (a background job) stays ignored.
    for stop in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(stop) is not signal.SIG_IGN:
            signal.signal(stop, _interrupt)
    # Past a file size limit (ulimit -f) a write fails with EFBIG, reported as one line, instead of SIGXFSZ
    # killing the process with a core dump and the run left "running".
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        cli(prog_name="optiq")
    finally:
        # What the command had to write is written. Python's shutdown (seconds, with torch loaded) puts signals it
        # handles back to their default actions, under which a late Ctrl-C or SIGTERM would end the process killed
        # by it (exit 143, say) instead of with the code the command chose; ignored ones stay ignored.
        for stop in (signal.SIGINT, signal.SIGTERM):
            signal.signal(stop, signal.SIG_IGN)
