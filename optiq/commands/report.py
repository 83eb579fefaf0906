"""``optiq report``: render a run's report from its run record, or compare two runs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from optiq.commands.common import err, out, print_json, wide_option
from optiq.errors import OptiqError
from optiq.text import visible

if TYPE_CHECKING:  # the report's modules import pandas: loaded when the command runs, not for its --help
    from optiq.record import RunRecord
    from optiq.report import Written


def _written(written: Written) -> str:
    if written.note:
        err.print(f"note: {visible(written.note)}", soft_wrap=True)
    return ", ".join(map(str, written.paths))


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Comparing two runs: also write compare.md and compare.html here.")
@wide_option
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as one JSON document.")
def report(runs, out_dir, wide, as_json):
    """Render or compare apply-fusion or bench runs.

    \b
    optiq report RUN            (re-)render RUN/report.md and RUN/report.html from its record (report.json
                                of apply-fusion, results.json of bench)
    optiq report RUN_A RUN_B    compare two runs: tok/s per concurrency, GPU ms/step per op class

    Each run is compared in the state it ended with: the patched model when it was re-measured, else as it was.
    The HTML is self-contained (plotly.js inlined); without plotly only the Markdown is written.
    """
    if len(runs) > 2:
        raise click.UsageError("give one run directory to render, or two to compare")
    if len(runs) == 1 and out_dir is not None:
        raise click.UsageError("--out is for comparing two runs; a run's own report is written into the run")
    from optiq.report import load_report

    reports = [load_report(run) for run in runs]
    if len(runs) == 1:
        _render(runs[0], reports[0], wide, as_json)
    else:
        _compare(runs, reports, out_dir, wide, as_json)


def _render(run: Path, record: RunRecord, wide: bool, as_json: bool) -> None:
    from optiq.commands.views import rich_table
    from optiq.report import gate_table, headline, headline_table, write_report

    written = _written(write_report(run, record))
    if as_json:
        print_json({"run_dir": str(run), "status": record.status, "headline": headline(record), "written": written})
        return
    out.print(rich_table(headline_table(record), wide))
    out.print(rich_table(gate_table(record), wide))
    out.print(f"status: {visible(record.status)} · written: {visible(written, limit=None)}")


def _compare(runs: tuple[Path, Path], reports: list[RunRecord], out_dir: Path | None, wide: bool,
             as_json: bool) -> None:
    from optiq.commands.views import rich_table
    from optiq.report import compare_document, compare_runs, write_document

    (a, b), (name_a, name_b) = reports, (runs[0].name, runs[1].name)
    doc = compare_document(a, b, name_a, name_b)
    written = ""
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OptiqError(f"cannot create {out_dir}: {exc.strerror or exc}") from None
        written = _written(write_document(out_dir, "compare", doc))
    if as_json:
        print_json({"run_a": str(runs[0]), "run_b": str(runs[1]), **compare_runs(a, b), "written": written})
        return
    for table in doc.tables:
        out.print(rich_table(table, wide))
    out.print(f"A = {visible(runs[0])}, B = {visible(runs[1])}" + (f" · written: {visible(written, limit=None)}"
                                                                  if written else ""))
