"""``optiq recipes``: the fusion catalog, ``optiq recipes show NAME`` for one recipe in full, and ``optiq recipes
verify`` to gate recipes and their kernels' mutants on a model."""

from __future__ import annotations

from dataclasses import asdict

import click
from rich.text import Text

from optiq.commands.common import (CONCURRENCY, SIZE, err, model_options, out, parse_concurrency, print_json,
                                   recipes_dir_option, resolve_device_and_mode, run_ending, status, wide_option)
from optiq.errors import OptiqError
from optiq.text import visible


@click.group(invoke_without_command=True)
@recipes_dir_option
@wide_option
@click.option("--json", "as_json", is_flag=True, help="Print the catalog as one JSON document.")
@click.pass_context
def recipes(ctx, recipes_dir, wide, as_json):
    """List the fusion recipe catalog: what each recipe fixes, where it applies, how it patches, its tolerance."""
    if ctx.invoked_subcommand is not None:
        return
    from optiq.catalog.recipes import load_catalog  # here: it imports torch, which `recipes --help` does without
    from optiq.commands.views import Fitted

    catalog = load_catalog(recipes_dir)
    if as_json:
        print_json([asdict(r) for r in catalog.values()])
        return
    rows = [list(map(visible, (r.name, f"{', '.join(r.roles)}: {', '.join(r.op_classes)}", r.kernels_saved_per_layer,
                               _where(r), f"{r.patch_kind} {r.target_label}", r.tolerance)))
            for r in catalog.values()]
    out.print(Fitted(f"optiq recipes ({len(catalog)})", ["recipe", "fixes (role: classes)", "kernels saved/layer",
                                                         "tried on", "patches", "tolerance"], rows,
                     numeric=("kernels saved/layer",), optional=("kernels saved/layer", "tolerance", "patches"),
                     wide=wide))


def _where(recipe) -> str:
    """The model types a recipe is tried on, as a person reads them."""
    if "*" not in recipe.architectures:
        return ", ".join(recipe.architectures)
    return "every model" + (f" but {', '.join(recipe.excluded)}" if recipe.excluded else "")


@recipes.command()
@click.argument("name")
@recipes_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the recipe as JSON.")
def show(name, recipes_dir, as_json):
    """Explain one recipe."""
    from optiq.catalog.recipes import TOLERANCES, load_catalog

    catalog = load_catalog(recipes_dir)
    if name not in catalog:
        raise OptiqError(f"no recipe '{name}'; the catalog has: {', '.join(catalog)}")
    r = catalog[name]
    if as_json:
        print_json(asdict(r))
        return
    out.print(Text.assemble((visible(r.name), "bold"), f" ({visible(r.path)})"))
    out.print(f"{visible(r.summary, limit=None)}\n")
    for label, line in (
            ("fixes", f"roles {', '.join(r.roles)}; op classes {', '.join(r.op_classes)}; aten ops "
                      f"{', '.join(r.aten_ops)}; saves {r.kernels_saved_per_layer} kernels per layer"),
            ("tried on", _where(r)),
            ("patches", f"{r.patch_kind}: {r.target_label} with {r.patch_with}"),
            ("fusion", r.fusion),
            ("tolerance", f"{r.tolerance}: {TOLERANCES[r.tolerance]}")):
        out.print(f"{label:<10} {visible(line, limit=None)}")


@recipes.command()
@click.argument("names", nargs=-1)
@model_options
@click.option("--concurrency", default=None, type=CONCURRENCY,
              help="Batch sizes the gate checks at, comma-separated (default 1,16,64 on CUDA, 1,2 on CPU).")
@click.option("--prompt-len", default=None, type=SIZE, help="Prompt tokens (default 512 on CUDA, 16 on CPU).")
@click.option("--max-len", default=None, type=SIZE, help="The longest context the sites are checked at (default 1024 "
                                                         "on CUDA, 64 on CPU).")
@click.option("--gate-steps", default=None, type=SIZE,
              help="Teacher-forced decode steps of the end-to-end check (default 64 on CUDA, 16 on CPU).")
@click.option("--mutants", "with_mutants", is_flag=True,
              help="Also gate every mutant of each recipe's kernel and print the mutation score.")
@recipes_dir_option
@click.option("--runs-dir", default="runs", show_default=True, help="Where the run directory is created.")
@wide_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of the table.")
def verify(names, model_spec, dtype, device, concurrency, prompt_len, max_len, gate_steps, with_mutants, recipes_dir,
           runs_dir, wide, as_json):
    """Gate each recipe (all, or NAMES) alone on a model, and with --mutants every mutant of its kernel too.

    \b
    A mutant is the recipe's kernel wrapped to compute what real fused kernels have shipped computing by mistake: a
    length off by one, a dropped first or last block, a forgotten weight, bias or eps, a scale a few percent off,
    accumulation in the input dtype, rows of the batch mixed or stale, state carried across calls. The gate must
    reject every one (the mutation score is the share it rejects) and keep every real kernel. Exit 1 if a mutant
    survived or a real kernel was rejected.
    """
    device, mode = resolve_device_and_mode(device, None)  # first: it picks Triton's interpreter on the CPU
    from optiq.catalog.proposals import named_recipes
    from optiq.catalog.recipes import load_catalog
    from optiq.commands.views import mutation_table
    from optiq.gate import GatePlan
    from optiq.gate.mutants import verify as verify_recipes
    from optiq.models import default_dtype, default_preset, load_model, resolve_dtype
    from optiq.rundir import RunDir, write_json

    catalog = load_catalog(recipes_dir)
    chosen = [catalog[n] for n in named_recipes(",".join(names), catalog)] if names else list(catalog.values())
    gpu = device.type == "cuda"
    concurrencies = parse_concurrency(("1,16,64" if gpu else "1,2") if concurrency is None else concurrency)
    prompt_len = prompt_len or (512 if gpu else 16)
    max_len = max_len or (1024 if gpu else 64)
    gate_steps = gate_steps or (64 if gpu else 16)
    if prompt_len + gate_steps + 1 > max_len:
        raise OptiqError(f"--prompt-len {prompt_len} + --gate-steps {gate_steps} + 1 exceed --max-len {max_len}")
    plan = GatePlan(tuple(concurrencies), gate_steps, prompt_len, mode, max_len=max_len)
    model_spec = model_spec or default_preset(device)
    torch_dtype = resolve_dtype(dtype or default_dtype(device), device)
    args = dict(model=model_spec, dtype=str(torch_dtype).removeprefix("torch."), recipes=[r.name for r in chosen],
                mutants=with_mutants, **vars(plan))
    with status(f"loading {model_spec}"):  # before the run directory: a model that cannot load leaves none
        model = load_model(model_spec, torch_dtype, device)
    run = RunDir(runs_dir, "verify", args)
    results: dict = {}

    def document() -> dict:
        return {"args": args, "recipes": {n: r if isinstance(r, str) else asdict(r) | {"score": r.summary().score}
                                          for n, r in results.items()}}

    def save(name, result) -> None:
        results[name] = result
        write_json(run.path / "verify.json", document())

    with run_ending(run, lambda: f"{len(results)} recipe(s)", lambda: {"recipes_done": len(results)}):
        with status("gating") as spinner:
            def progress(line: str) -> None:
                spinner.update(Text(visible(line)))
                err.print(visible(line), highlight=False)

            verify_recipes(model, chosen, plan, with_mutants, progress, done=save)
    run.finish("complete", recipes_done=len(results))
    if as_json:
        print_json({"run_dir": str(run.path), **document()})
    else:
        out.print(mutation_table(results, f"optiq recipes verify · {model_spec} · {args['dtype']}", wide))
        out.print(f"run directory: {visible(run.path)}")
    survived = sum(len(r.summary().survived) for r in results.values() if not isinstance(r, str))
    rejected = [n for n, r in results.items() if not isinstance(r, str) and r.real != "passed"]
    if survived or rejected:
        raise OptiqError(f"{survived} mutant(s) survived the gate" + (f"; real kernels rejected: {', '.join(rejected)}"
                                                                     if rejected else ""))
