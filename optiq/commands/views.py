"""What the commands show: rich tables for people (attribution, proposals, throughput, the report's tables), plain
records for ``--json``. Every string from outside (a kernel, role, recipe or model name, a path, a reason) reaches a
table through ``visible``: the consoles read no markup, and control characters are shown as escapes.

Every table fits the console it is printed on (an 80-column terminal too) without wrapping inside a cell: a wrapped
cell splits a kernel name or a number (``9.96e-`` over ``08``) across lines. Where the whole table is too wide the
columns that say least go first (empty ones, then each table's minor ones, then from the right), and long names are
cut with an ellipsis; ``--wide`` shows every column, folded where it must."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

from optiq import report
from optiq.record import Proposal, Row, RunRecord
from optiq.text import visible

if TYPE_CHECKING:
    from optiq.traces.attribution import Attribution

NOT_MEANINGFUL = report.RATIO_NOT_MEANINGFUL  # a ratio's cell where what it divides means nothing (interpreted kernels)
CUT_TEXT = 20  # a text column is cut no narrower than this (or its header), so a cut name still says which it is
EMPTY = ("", "—")


class Fitted:
    """A table rendered for the width of the console it is printed on. Numeric columns are never cut; text columns
    are cut with ``…`` down to ``CUT_TEXT``; while even that is too wide a column is dropped: first those with
    nothing in them, then ``optional`` in its order, then from the right (never the first, which names the row).
    ``wide``: every column, cells folded as rich does."""

    def __init__(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[str | Text]], *,
                 numeric: Collection[str] = (), optional: Sequence[str] = (), caption: str | None = None,
                 wide: bool = False):
        self.title, self.columns, self.caption, self.wide = title, list(columns), caption, wide
        self.rows = [[cell if isinstance(cell, Text) else Text(cell) for cell in row] for row in rows]
        self.numeric, self.optional = set(numeric), list(optional)

    def __rich_console__(self, console, options):
        yield self.table(options.max_width)

    def _natural(self, i: int) -> int:
        return max([cell_len(self.columns[i]), *(row[i].cell_len for row in self.rows)])

    def _least(self, i: int) -> int:
        """The narrowest column ``i`` gets: a number or header whole, a text cut to ``CUT_TEXT``."""
        natural = self._natural(i)
        return natural if self.columns[i] in self.numeric else min(natural, max(cell_len(self.columns[i]), CUT_TEXT))

    def _shown(self, width: int) -> tuple[list[int], dict[int, int]]:
        """The columns kept at ``width`` and the width each text column is cut to."""
        kept = list(range(len(self.columns)))

        def total(widths: list[int]) -> int:  # a cell padded by a space each side, a rule between and at each edge
            return sum(widths) + 3 * len(widths) + 1

        empty = [i for i in kept if all(row[i].plain.strip() in EMPTY for row in self.rows)]
        named = [self.columns.index(name) for name in self.optional if name in self.columns]
        for i in dict.fromkeys([*empty, *named, *reversed(kept)]):
            if total([self._least(j) for j in kept]) <= width or len(kept) == 1:
                break
            if i != 0:
                kept.remove(i)
        widths = {i: self._natural(i) for i in kept}
        while total(list(widths.values())) > width:
            cuttable = [i for i in kept if widths[i] > self._least(i)]
            if not cuttable:
                break
            widest = max(cuttable, key=widths.__getitem__)
            widths[widest] -= 1
        return kept, {i: w for i, w in widths.items() if w < self._natural(i)}

    def table(self, width: int) -> Table:
        kept, cut = (list(range(len(self.columns))), {}) if self.wide else self._shown(width)
        table = Table(title=visible(self.title), caption=self.caption)
        for i in kept:
            table.add_column(visible(self.columns[i]), justify="right" if self.columns[i] in self.numeric else "left",
                             overflow="fold" if self.wide else "ellipsis", max_width=cut.get(i),
                             no_wrap=not self.wide)
        for row in self.rows:
            table.add_row(*(row[i] for i in kept))
        return table


def methods_line(attribution: Attribution) -> str:
    used = {m: share for m, share in attribution.methods.items() if share > 0 or m in ("linkage", "none")}
    return "attributed by " + ", ".join(f"{m} {100 * share:.1f}%" for m, share in used.items())


def summary_line(attribution: Attribution) -> str:
    s = attribution.summary
    return (f"{s['steps']} step(s) · {s['time_unit']} {s['gpu_ms_per_step']:.3f} ms/step (busy "
            f"{s['busy_ms_per_step']:.3f}) · wall {s['wall_ms_per_step']:.3f} ms/step · idle "
            f"{100 * s['idle_frac']:.0f}% · {s['kernels_per_step']:.0f} kernels, {s['launches_per_step']:.0f} "
            f"launches per step")


def attribution_view(attribution: Attribution, title: str, wide: bool = False) -> Fitted:
    unit = "GPU" if attribution.summary["time_unit"] == "GPU time" else "CPU"
    columns = [attribution.by, f"{unit} ms/step", f"% {unit}", "kernels/step", "us/kernel", "top kernels", "where"]
    rows = [[visible(row.label), f"{row.gpu_ms_per_step:.4f}", f"{row.pct:.1f}", f"{row.kernels_per_step:.1f}",
             f"{row.mean_us:.2f}", visible(row.top_kernels), visible(row.where)]
            for row in attribution.table.itertuples()]
    return Fitted(title, columns, rows, numeric=columns[1:5], optional=("us/kernel", "kernels/step", "top kernels"),
                  caption=f"{summary_line(attribution)}\n{methods_line(attribution)}", wide=wide)


def proposals_table(proposals: list[Proposal], title: str, wide: bool = False) -> Fitted:
    columns = ["#", "recipe", "up to ms/step", "% of step", "kernels/step", "replaces"]
    rows = [[str(rank), visible(p.recipe), f"{p.covered_ms_per_step:.3f}", f"{p.covered_pct:.1f}",
             f"{p.kernels_per_step:.0f}", visible(p.where)] for rank, p in enumerate(proposals, 1)]
    return Fitted(title, columns, rows, numeric=("#", "up to ms/step", "% of step", "kernels/step"),
                  optional=("kernels/step",), wide=wide,
                  caption="saving = the time the recipe covers, an upper bound; apply-fusion measures the real one")


def proposals_records(proposals: list[Proposal]) -> list[dict]:
    return [asdict(p) for p in proposals]


# The report's columns an 80-column terminal goes without first (the report files keep them all).
REPORT_MINOR = ("tolerance", "calls", "s", "mutants killed", "bound", "err unfused", "err fused",  # the gate
                "floor tok/s", "torch.compile tok/s", "after % of floor")  # the headline


def rich_table(table: report.Table, wide: bool = False) -> Fitted:
    """A report table for the terminal: numeric columns (every cell a number, a dash or n/m) right-aligned and
    never cut."""
    numeric = [column for i, column in enumerate(table.columns)
               if all(row[i][:1].isdigit() or row[i][:1] in "—-+" or row[i] == NOT_MEANINGFUL
                      for row in table.rows if row[i])]
    return Fitted(table.title, table.columns, [list(map(visible, row)) for row in table.rows],
                  numeric=numeric, optional=REPORT_MINOR, caption=visible(table.note) or None, wide=wide)


def headline_view(record: RunRecord, wide: bool = False) -> Fitted:
    """apply-fusion's throughput table (its ratios n/m on a smoke run: report.headline_table)."""
    return rich_table(report.headline_table(record), wide)


def results_table(rows: list[Row], title: str, wide: bool = False, interpreted: Collection[str] = ()) -> Fitted:
    """One line per point; with HF's own step or torch.compile among the variants, each point's throughput over
    theirs too (n/m for the ``interpreted`` variants: their kernels ran under Triton's interpreter)."""
    baselines = {label: {r.concurrency: r.tok_per_s for r in rows if r.status == "ok" and of_it(r)}
                 for label, of_it in (("× hf", lambda r: r.is_hf), ("× compile", lambda r: r.is_compile))}
    baselines = {label: by_concurrency for label, by_concurrency in baselines.items() if by_concurrency}
    columns = ["variant", "C", "tok/s", *baselines, "ms/step", "floor ms", "% of floor", "prefill ms", "warm-up s",
               "peak GB"]
    cells = []
    for r in rows:
        if r.status != "ok":
            cells.append([visible(r.variant), str(r.concurrency), Text(visible(r.status), style="red"),
                          *[""] * (len(columns) - 3)])
            continue
        ratios = [NOT_MEANINGFUL if r.variant in interpreted else (
            f"{r.tok_per_s / by_concurrency[r.concurrency]:.2f}" if r.concurrency in by_concurrency else "")
            for by_concurrency in baselines.values()]
        peak = "" if r.peak_mem_gb is None else f"{r.peak_mem_gb:.1f}"
        cells.append([visible(r.variant), str(r.concurrency), f"{r.tok_per_s:,.1f}", *ratios,
                      f"{r.ms_per_step:.3f}", f"{r.floor_ms_per_step:.3f}", f"{r.pct_of_floor:.1f}",
                      f"{r.prefill_ms:.1f}", f"{r.warmup_s:.2f}", peak])
    # A point without a number says why under the table (a failing peer's error, one over its warm-up budget)
    notes = [f"{visible(r.variant)} C={r.concurrency}: {visible(r.error)}"
             for r in rows if r.status != "ok" and r.error]
    if interpreted and baselines:
        notes.append(f"{NOT_MEANINGFUL} = not meaningful: kernels under Triton's interpreter")
    return Fitted(title, columns, cells, numeric=columns[1:],
                  optional=("peak GB", "prefill ms", "warm-up s", "floor ms"), wide=wide,
                  caption="\n".join(notes) or None)


def fusion_summary(record: RunRecord) -> str:
    """The gate's verdict for people, in a few lines: what was applied and rolled back (with why), the end-to-end
    check, and the wait against compile's."""
    fusion = record.fusion
    rolled = [f"{visible(n)} ({visible(fusion.gate.recipes[n].reason) if n in fusion.gate.recipes else 'failed'})"
              for n in fusion.rolled_back]
    lines = [f"optiq: applied {', '.join(map(visible, fusion.applied)) or 'nothing'}; rolled back "
             f"{', '.join(rolled) or 'none'}"]
    checks = fusion.gate.end_to_end
    if checks:
        failed = ", ".join(str(e.concurrency) for e in checks if not e.passed)
        lines.append(f"end to end: {f'failed at C={failed}' if failed else 'passed'} over {checks[0].steps} "
                     f"teacher-forced steps at C={', '.join(str(e.concurrency) for e in checks)} (logits rel err up "
                     f"to {max(e.rel_err for e in checks):.2e}, bound {min(e.bound for e in checks):.2e}; top-1 "
                     f"agreement at least {min(e.top1 for e in checks):.3f})")
    if (waited := report.time_to_optimized_text(record)) is not None:
        lines.append(f"time to optimized {waited}")
    return "\n".join(lines)


def mutation_table(results: dict, title: str, wide: bool = False) -> Fitted:
    """``recipes verify``: per recipe, the real kernel's verdict, the mutants killed and survived, and the score."""
    rows = []
    for name, result in results.items():
        if isinstance(result, str):
            rows.append([visible(name), f"not applicable: {visible(result)}", "", "", "", ""])
            continue
        summary = result.summary()
        score = "" if summary.score is None else f"{100 * summary.score:.0f}%"
        rows.append([visible(name), visible(result.real), str(summary.killed),
                     ", ".join(map(visible, summary.survived)) or "0", score, f"{result.seconds:.0f}"])
    return Fitted(title, ["recipe", "real kernel", "killed", "survived", "score", "s"], rows,
                  numeric=("killed", "score", "s"), optional=("s",), wide=wide)
