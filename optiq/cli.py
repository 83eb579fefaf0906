"""The ``optiq`` command group. Each command lives in ``optiq.commands``; this file only gathers them and turns
user errors into one line and an exit code.

\b
Exit codes: 0 ok, 1 user error (bad model, trace, recipe or flag value), 2 usage (unknown flag),
3 apply-fusion's validation gate rejected every recipe, 130 interrupted (results so far kept, run marked incomplete).
"""

from __future__ import annotations

import click

from optiq import __version__
from optiq.commands.bench import bench
from optiq.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, OptiqError


class OptiqGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except OptiqError as exc:
            click.echo(f"optiq: error: {exc}", err=True)
            ctx.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            click.echo("optiq: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)


@click.group(cls=OptiqGroup, help=__doc__)
@click.version_option(__version__, prog_name="optiq")
def cli():
    pass


def _planned(name: str, issue: int, summary: str) -> click.Command:
    """A command of the design whose implementation has not landed yet: it says so and exits 1."""

    @click.command(name=name, help=f"{summary} (not implemented yet: issue {issue}).",
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def command():
        raise OptiqError(f"`optiq {name}` is not implemented yet (issue {issue})")

    return command


cli.add_command(bench)
for _name, _issue, _summary in [
    ("profile", 3, "Profile the decode step and attribute GPU time to op classes and module roles"),
    ("analyze", 3, "Attribute GPU time in traces captured elsewhere (torch.profiler, vLLM, SGLang)"),
    ("recipes", 4, "List the fusion recipe catalog"),
    ("apply-fusion", 5, "Patch the model with fusion recipes, validate, re-measure, report"),
    ("report", 5, "Render or compare runs"),
]:
    cli.add_command(_planned(_name, _issue, _summary))


def main() -> None:
    cli(prog_name="optiq")
