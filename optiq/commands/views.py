"""What the commands show: rich tables for people (attribution, proposals, throughput, the report's tables), plain
records for ``--json``. Every string from outside (a kernel, role, recipe or model name, a path, a reason) reaches a
table through ``visible``: the consoles read no markup, and control characters are shown as escapes."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from optiq import report
from optiq.record import Proposal, Row, RunRecord
from optiq.text import visible

if TYPE_CHECKING:
    from optiq.traces.attribution import Attribution


def methods_line(attribution: Attribution) -> str:
    used = {m: share for m, share in attribution.methods.items() if share > 0 or m in ("linkage", "none")}
    return "attributed by " + ", ".join(f"{m} {100 * share:.1f}%" for m, share in used.items())


def summary_line(attribution: Attribution) -> str:
    s = attribution.summary
    return (f"{s['steps']} step(s) · {s['time_unit']} {s['gpu_ms_per_step']:.3f} ms/step (busy "
            f"{s['busy_ms_per_step']:.3f}) · wall {s['wall_ms_per_step']:.3f} ms/step · idle "
            f"{100 * s['idle_frac']:.0f}% · {s['kernels_per_step']:.0f} kernels, {s['launches_per_step']:.0f} "
            f"launches per step")


def attribution_view(attribution: Attribution, title: str) -> Table:
    unit = "GPU" if attribution.summary["time_unit"] == "GPU time" else "CPU"
    table = Table(title=visible(title), caption=f"{summary_line(attribution)}\n{methods_line(attribution)}")
    for name in (attribution.by, f"{unit} ms/step", f"% {unit}", "kernels/step", "us/kernel", "top kernels", "where"):
        table.add_column(name, justify="right" if "/" in name or "%" in name else "left", overflow="fold")
    for row in attribution.table.itertuples():
        table.add_row(visible(row.label), f"{row.gpu_ms_per_step:.4f}", f"{row.pct:.1f}",
                      f"{row.kernels_per_step:.1f}", f"{row.mean_us:.2f}", visible(row.top_kernels),
                      visible(row.where))
    return table


def proposals_table(proposals: list[Proposal], title: str) -> Table:
    table = Table(title=visible(title),
                  caption="saving = the time the recipe covers, an upper bound; apply-fusion measures the real one")
    for column in ("#", "recipe", "up to ms/step", "% of step", "kernels/step", "replaces"):
        table.add_column(column, justify="right" if column in ("#", "up to ms/step", "% of step", "kernels/step")
                         else "left", overflow="fold")
    for rank, p in enumerate(proposals, 1):
        table.add_row(str(rank), visible(p.recipe), f"{p.covered_ms_per_step:.3f}", f"{p.covered_pct:.1f}",
                      f"{p.kernels_per_step:.0f}", visible(p.where))
    return table


def proposals_records(proposals: list[Proposal]) -> list[dict]:
    return [asdict(p) for p in proposals]


def rich_table(table: report.Table) -> Table:
    """A report table for the terminal: numeric columns right-aligned, text folded rather than cut."""
    rich = Table(title=visible(table.title), caption=visible(table.note) or None)
    for i, column in enumerate(table.columns):
        numeric = all(row[i][:1].isdigit() or row[i][:1] in "—-+" for row in table.rows if row[i])
        rich.add_column(visible(column), justify="right" if numeric else "left", overflow="fold")
    for row in table.rows:
        rich.add_row(*map(visible, row))
    return rich


def results_table(rows: list[Row], title: str) -> Table:
    """One line per point; with torch.compile among the variants, each point's throughput over compile's too."""
    compiled = {r.concurrency: r.tok_per_s for r in rows if r.is_compile and r.status == "ok"}
    columns = ["variant", "C", "tok/s", *(["× compile"] if compiled else []), "ms/step", "floor ms", "% of floor",
               "prefill ms", "warm-up s", "peak GB"]
    table = Table(title=visible(title))
    for name in columns:
        table.add_column(name, justify="left" if name == "variant" else "right")
    for r in rows:
        if r.status != "ok":
            table.add_row(visible(r.variant), str(r.concurrency), Text(visible(r.status), style="red"),
                          *[""] * (len(columns) - 3))
            continue
        ratio = [f"{r.tok_per_s / compiled[r.concurrency]:.2f}" if r.concurrency in compiled else ""]
        peak = "" if r.peak_mem_gb is None else f"{r.peak_mem_gb:.1f}"
        table.add_row(visible(r.variant), str(r.concurrency), f"{r.tok_per_s:,.1f}", *(ratio if compiled else []),
                      f"{r.ms_per_step:.3f}", f"{r.floor_ms_per_step:.3f}", f"{r.pct_of_floor:.1f}",
                      f"{r.prefill_ms:.1f}", f"{r.warmup_s:.2f}", peak)
    return table


def fusion_summary(record: RunRecord) -> str:
    """Two lines for people: what was applied and rolled back (with why), and the wait against compile's."""
    fusion = record.fusion
    rolled = [f"{visible(n)} ({visible(fusion.gate.recipes[n].reason) if n in fusion.gate.recipes else 'failed'})"
              for n in fusion.rolled_back]
    lines = [f"optiq: applied {', '.join(map(visible, fusion.applied)) or 'nothing'}; rolled back "
             f"{', '.join(rolled) or 'none'}"]
    wait = report.time_to_optimized(record)
    if wait is not None:
        optimized, warmup = wait
        lines.append(f"time to optimized {optimized:.1f} s (patch + gate + capture)" + (
            f"; torch.compile's warm-up {warmup:.1f} s, {optimized / warmup:.2f}x of it" if warmup else ""))
    return "\n".join(lines)


def mutation_table(results: dict, title: str) -> Table:
    """``recipes verify``: per recipe, the real kernel's verdict, the mutants killed and survived, and the score."""
    table = Table(title=visible(title))
    for name in ("recipe", "real kernel", "killed", "survived", "score", "s"):
        table.add_column(name, justify="right" if name in ("killed", "survived", "score", "s") else "left",
                         overflow="fold")
    for name, result in results.items():
        if isinstance(result, str):
            table.add_row(visible(name), f"not applicable: {visible(result)}", "", "", "", "")
            continue
        summary = result.summary()
        score = "" if summary.score is None else f"{100 * summary.score:.0f}%"
        table.add_row(visible(name), visible(result.real), str(summary.killed),
                      ", ".join(map(visible, summary.survived)) or "0", score,
                      f"{result.seconds:.0f}")
    return table
