"""``optiq recipes``: the fusion catalog, and ``optiq recipes show NAME`` for one recipe in full."""

from __future__ import annotations

from dataclasses import asdict

import click
from rich.table import Table

from optiq.catalog.recipes import TOLERANCES, load_catalog
from optiq.commands.common import out, print_json, recipes_dir_option
from optiq.errors import OptiqError


@click.group(invoke_without_command=True)
@recipes_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the catalog as one JSON document.")
@click.pass_context
def recipes(ctx, recipes_dir, as_json):
    """List the fusion recipe catalog: what each recipe fixes, where it applies, how it patches, its tolerance."""
    if ctx.invoked_subcommand is not None:
        return
    catalog = load_catalog(recipes_dir)
    if as_json:
        print_json([asdict(r) for r in catalog.values()])
        return
    table = Table(title=f"optiq recipes ({len(catalog)})")
    for column in ("recipe", "fixes (role: classes)", "kernels saved/layer", "architectures", "patches", "tolerance"):
        table.add_column(column, overflow="fold")
    for r in catalog.values():
        table.add_row(r.name, f"{', '.join(r.roles)}: {', '.join(r.op_classes)}", str(r.kernels_saved_per_layer),
                      ", ".join(r.architectures), f"{r.patch_kind} {r.target_label}", r.tolerance)
    out.print(table)


@recipes.command()
@click.argument("name")
@recipes_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the recipe as JSON.")
def show(name, recipes_dir, as_json):
    """Explain one recipe."""
    catalog = load_catalog(recipes_dir)
    if name not in catalog:
        raise OptiqError(f"no recipe '{name}'; the catalog has: {', '.join(catalog)}")
    r = catalog[name]
    if as_json:
        print_json(asdict(r))
        return
    out.print(f"[bold]{r.name}[/bold] ({r.path})\n{r.summary}\n")
    out.print(f"fixes      roles {', '.join(r.roles)}; op classes {', '.join(r.op_classes)}; aten ops "
              f"{', '.join(r.aten_ops)}; saves {r.kernels_saved_per_layer} kernels per layer")
    out.print(f"applies to {', '.join(r.architectures)}")
    out.print(f"patches    {r.patch_kind}: {r.target_label} with {r.patch_with}")
    out.print(f"fusion     {r.fusion}")
    out.print(f"tolerance  {r.tolerance}: {TOLERANCES[r.tolerance]}")
