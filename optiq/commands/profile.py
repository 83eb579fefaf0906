"""``optiq profile``: where the decode step's time goes, on optiq's own engine, at each concurrency."""

from __future__ import annotations

import click

from optiq.commands.common import (SIZE, err, model_options, out, parse_concurrency, print_json, recipes_dir_option,
                                   resolve_device_and_mode, run_ending, status, wide_option, workload_defaults,
                                   workload_options)
from optiq.text import visible


@click.command()
@model_options
@workload_options(gpu_concurrency="1,64", new_tokens=False)
@click.option("--steps", default=4, show_default=True, type=SIZE, help="Decode steps profiled.")
@click.option("--mode", type=click.Choice(["eager", "graph"]), default=None,
              help="What is timed: eager steps, or CUDA-graph replays (default on CUDA; an annotated eager trace of "
                   "the same batch supplies the op linkage).")
@click.option("--by", type=click.Choice(["class", "role", "kernel", "layer"]), default="class", show_default=True,
              help="Group GPU time by op class, module role, kernel or decoder layer.")
@click.option("--top", default=3, show_default=True, type=SIZE, help="Top kernels / places per row.")
@recipes_dir_option
@click.option("--runs-dir", default="runs", show_default=True, help="Where the run directory is created.")
@wide_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
def profile(model_spec, dtype, device, concurrency, prompt_len, max_len, steps, mode, by, top, recipes_dir, runs_dir,
            wide, as_json):
    """Run the decode step under torch.profiler at each concurrency and attribute its GPU time.

    \b
    Every decoder layer and module role is annotated (record_function in the trace, NVTX ranges for Nsight Systems
    when the nvtx package is installed). The run directory keeps each trace (.json.gz) and attribution (JSON, CSV).
    Each concurrency ends with proposals: the catalog's recipes ranked by the GPU time they would replace.
    """
    device, mode = resolve_device_and_mode(device, mode)  # first: it picks Triton's interpreter on the CPU
    from dataclasses import asdict

    from optiq.catalog.proposals import propose, with_sites
    from optiq.catalog.recipes import load_catalog
    from optiq.engine import graph_mode_problem
    from optiq.commands.views import attribution_view, proposals_records, proposals_table
    from optiq.measure import environment
    from optiq.measure.sweep import check_workload, free_memory
    from optiq.models import default_dtype, default_preset, load_model, resolve_dtype
    from optiq.profiling.capture import profile_step
    from optiq.record import Workload
    from optiq.rundir import RunDir, write_csv, write_json
    from optiq.traces.attribution import attribute, attribution_document, weighted_kernels

    concurrency, prompt_len, max_len = workload_defaults(device, "1,64", concurrency=concurrency,
                                                         prompt_len=prompt_len, max_len=max_len)
    catalog = load_catalog(recipes_dir)
    model_spec = model_spec or default_preset(device)
    check_workload(Workload(prompt_len, steps, max_len, repeats=1), steps_flag="--steps")
    concurrencies = parse_concurrency(concurrency)
    torch_dtype = resolve_dtype(dtype or default_dtype(device), device)
    args = dict(model=model_spec, dtype=str(torch_dtype).removeprefix("torch."), concurrency=concurrencies,
                mode=mode, prompt_len=prompt_len, max_len=max_len, steps=steps, by=by)
    run = RunDir(runs_dir, "profile", args)
    results = []
    with run_ending(run, lambda: f"{len(results)} concurrency(ies)", lambda: {"concurrencies_done": len(results)}):
        write_json(run.path / "environment.json", asdict(environment(device)))
        with status(f"loading {model_spec}"):
            model = load_model(model_spec, torch_dtype, device)
        if mode == "graph":
            problem = graph_mode_problem(model)
            if problem:
                err.print(f"note: {visible(problem)}: profiled in eager mode")
                mode = args["mode"] = "eager"
        candidates = with_sites(catalog, model)
        for batch in concurrencies:
            with status(f"profiling {model_spec} C={batch} ({mode})"):
                timed = profile_step(model, batch, prompt_len, max_len, mode, run.path, steps)
                attribution = attribute([timed], by, top)
                proposals = propose(candidates, weighted_kernels([timed]), model.config.model_type)
            doc = {"concurrency": batch, "mode": mode, **attribution_document(attribution, [timed]),
                   "proposals": proposals_records(proposals)}
            write_json(run.path / f"attribution_C{batch}.json", doc)
            write_csv(run.path / f"attribution_C{batch}.csv", attribution.table.to_dict(orient="records"))
            results.append(doc)
            if not as_json:
                out.print(attribution_view(attribution, f"{model_spec} · C={batch} · {mode} · by {by}", wide))
                for note in attribution.notes:
                    out.print(f"  note: {visible(note)}")
                out.print(proposals_table(proposals, f"proposals · {model_spec} · C={batch}", wide))
            free_memory()
    run.finish("complete", concurrencies_done=len(results))
    if as_json:
        print_json({"run_dir": str(run.path), "args": args, "results": results})
    else:
        out.print(f"run directory: {visible(run.path)}")
