"""How proposals are shown: a rich table for people, plain records for ``--json``."""

from __future__ import annotations

from dataclasses import asdict

from rich.table import Table

from optiq.proposals import Proposal


def proposals_table(proposals: list[Proposal], title: str) -> Table:
    table = Table(title=title,
                  caption="saving = the time the recipe covers, an upper bound; apply-fusion measures the real one")
    for column in ("#", "recipe", "up to ms/step", "% of step", "kernels/step", "replaces"):
        table.add_column(column, justify="right" if column in ("#", "up to ms/step", "% of step", "kernels/step")
                         else "left", overflow="fold")
    for rank, p in enumerate(proposals, 1):
        table.add_row(str(rank), p.recipe, f"{p.covered_ms_per_step:.3f}", f"{p.covered_pct:.1f}",
                      f"{p.kernels_per_step:.0f}", p.where)
    return table


def proposals_records(proposals: list[Proposal]) -> list[dict]:
    return [asdict(p) for p in proposals]
