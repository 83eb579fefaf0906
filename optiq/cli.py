"""The ``optiq`` command group. Each command lives in ``optiq.commands`` and is imported only when it runs, so
``optiq analyze`` never pays for importing torch and ``--help`` answers at once. This file also turns user errors into
one line and an exit code."""

from __future__ import annotations

import importlib
import signal

import click

from optiq import __version__
from optiq.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, OptiqError

# name -> (module in optiq.commands holding a command of that module's name, one-line help for `optiq --help`).
COMMANDS = {
    "profile": ("profile", "Profile the decode step; attribute GPU time to op classes and module roles."),
    "analyze": ("analyze", "Attribute GPU time in traces captured anywhere (torch.profiler, vLLM, SGLang)."),
    "recipes": ("recipes", "List the fusion recipe catalog (and `recipes show NAME`)."),
    "apply-fusion": ("apply_fusion", "Patch the model with fusion recipes, validate, re-measure, report."),
    "bench": ("bench", "Decode throughput against concurrency, with the bandwidth floor."),
    "report": ("report", "Render or compare runs."),
}


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
        except OptiqError as exc:
            click.echo(f"optiq: error: {exc}", err=True)
            ctx.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            click.echo("optiq: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)


HELP = """optiq: make LLM decode fast by measurement.

\b
Exit codes: 0 ok, 1 user error (bad model, trace, recipe or flag value), 2 usage (unknown flag),
3 the validation gate rejected every recipe, 130 interrupted by Ctrl-C or SIGTERM (results so far kept,
run marked incomplete).
"""


@click.group(cls=OptiqGroup, help=HELP)
@click.version_option(__version__, prog_name="optiq")
def cli():
    pass


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> None:
    # SIGTERM (timeout, a scheduler, a container stopping) ends a run as Ctrl-C does: kept, marked incomplete.
    signal.signal(signal.SIGTERM, _interrupt)
    cli(prog_name="optiq")
