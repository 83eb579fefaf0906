"""``optiq apply-fusion``: patch the model with recipes, prove it still computes the same function, re-measure decode
throughput against concurrency, and write the before/after report."""

from __future__ import annotations

from dataclasses import asdict

import click

from optiq.commands.common import (err, gate_options, measurement_options, model_options, out, parse_concurrency,
                                   print_json, resolve_device_and_mode, stop_interrupted, workload_defaults,
                                   workload_options)
from optiq.commands.recipes import recipes_dir_option
from optiq.errors import EXIT_GATE_REJECTED_ALL, OptiqError

@click.command(name="apply-fusion")
@model_options
@click.option("--recipes", "requested", default="auto", show_default=True,
              help="auto (the proposals of a fresh profile) or recipe names, comma-separated.")
@recipes_dir_option
@workload_options()
@measurement_options("Also measure torch.compile of the unpatched model, the peer a user would pick instead.")
@gate_options
@click.option("--runs-dir", default="runs", show_default=True, help="Where the run directory is created.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document.")
def apply_fusion(model_spec, dtype, device, requested, recipes_dir, concurrency, prompt_len, new_tokens, max_len,
                 repeats, mode, compare, gate_steps, min_share, runs_dir, as_json):
    """Patch the model with fusion recipes, validate them, re-measure throughput against concurrency, and report.

    \b
    Each recipe must pass the validation gate: its fused path, run on the real inputs of a decode step, may be no
    less accurate against a float64 reference than the original path (by its tolerance class's factor), and the
    patched model's logits over --gate-steps teacher-forced steps must stay within the set's bound of an fp32
    reference. A recipe that fails is rolled back and reported; the others stay (auto: and a rival it kept out, two
    recipes that patch the same place, is chosen and gated in its stead). Writes report.json, report.md and
    report.html (plotly, self-contained) into a new run directory. Exit code 3 when the gate rejects every recipe.
    """
    device, mode = resolve_device_and_mode(device, mode)  # first: it picks Triton's interpreter on the CPU
    concurrency, prompt_len, new_tokens, max_len = workload_defaults(
        device, concurrency=concurrency, prompt_len=prompt_len, new_tokens=new_tokens, max_len=max_len)
    from optiq.attribution import attribute, weighted_kernels
    from optiq.bench import Workload, compiled_forward, free_memory
    from optiq.commands.bench import environment, sweep_with_progress
    from optiq.models import default_dtype, default_preset, load_model, resolve_dtype
    from optiq import compile_ahead
    from optiq.fusing import (PROFILED_STEPS, choose_again, choose_recipes, fuse, gate_settings, new_record,
                              proposals)
    from optiq.profiling import profile_step
    from optiq.recipes import load_catalog
    from optiq.roofline import copy_bandwidth
    from optiq.rundir import RunDir, write_json
    from optiq.commands.report import rich_table
    from optiq.report import compile_variant, gate_table, headline_table, write_report

    catalog = load_catalog(recipes_dir)
    model_spec = model_spec or default_preset(device)
    workload = Workload(prompt_len, new_tokens, max_len, repeats)
    workload.check()
    concurrencies = parse_concurrency(concurrency)
    if requested != "auto":
        choose_recipes(requested, catalog, {}, min_share)  # unknown names fail before any work
    torch_dtype = resolve_dtype(dtype or default_dtype(device), device)
    args = dict(model=model_spec, dtype=str(torch_dtype).removeprefix("torch."), recipes=requested, mode=mode,
                concurrency=concurrencies, compare=compare, gate_steps=gate_steps, **workload.__dict__)
    run = RunDir(runs_dir, "apply-fusion", args)
    report = {"model": model_spec, "dtype": args["dtype"], "mode": mode, "status": "running",
              "environment": environment(device), "workload": dict(workload.__dict__), "concurrency": concurrencies,
              "recipes_requested": requested.split(","), "proposals": {}, **new_record(), "before": {"rows": []},
              "after": {"rows": []}, "attribution_before": {}, "attribution_after": {}}

    def save():
        write_json(run.path / "report.json", report)

    def profile_all(key: str, tag: str, engine_patches=None) -> dict[int, object]:
        timed = {}
        for batch in concurrencies:
            with err.status(f"profiling {model_spec} C={batch} ({tag})"):
                trace = profile_step(model, batch, prompt_len, max_len, mode, run.path, PROFILED_STEPS, tag + "_",
                                     engine_patches)
            attribution = attribute([trace], "class")
            report[key][str(batch)] = {"summary": attribution.summary,
                                       "table": attribution.table.to_dict(orient="records")}
            timed[batch] = trace
            save()
            free_memory()
        return timed

    def measure(key: str, variants, engine_patches=None):
        def save_rows(rows):
            report[key]["rows"] = rows
            save()

        sweep_with_progress(f"{model_spec} {key}", model, concurrencies, workload, variants, bandwidth, save_rows,
                            report[key]["rows"], engine_patches=engine_patches)

    try:
        save()
        with err.status(f"loading {model_spec}"):
            model = load_model(model_spec, torch_dtype, device)
        bandwidth = copy_bandwidth(device)
        gate = gate_settings(concurrencies, gate_steps, prompt_len, max_len, mode)
        # The workers start up while the model is profiled, and wait (idle) while it is measured.
        with compile_ahead.workers(device, model_spec, args["dtype"], recipes_dir, prompt_len, max_len,
                                   gate) as ahead:
            before = profile_all("attribution_before", "before")
            kernels = {c: weighted_kernels([t]) for c, t in before.items()}
            found = proposals(catalog, kernels, model.config.model_type)
            report["proposals"] = {str(c): [asdict(p) for p in ps] for c, ps in found.items()}
            names = choose_recipes(requested, catalog, found, min_share)
            if not names:
                raise OptiqError(f"no recipe to apply: no proposal covers {min_share}% of the step")
            variants = [(mode, mode, None)]
            if "compile" in compare:
                variants.append((compile_variant(mode), mode, compiled_forward(model)))
            measure("before", variants)
            patches = fuse(model, catalog, names, report, gate,
                           choose_again(requested, catalog, kernels, model.config.model_type, min_share),
                           on_round=save, status=err.status, ahead=ahead)
        if patches.applied:
            measure("after", [(mode, mode, None)], engine_patches=patches)
            report["timings"]["capture_s"] = sum(r.get("warmup_s", 0.0) for r in report["after"]["rows"])
            profile_all("attribution_after", "after", patches)
        report["status"] = "complete" if patches.applied else "rejected"
    except OptiqError:
        report["status"] = "failed"
        save()
        run.finish("failed")
        raise
    except KeyboardInterrupt:
        report["status"] = "incomplete"
        save()
        stop_interrupted(run, "what was measured")
    save()
    written = write_report(run.path, report)
    run.finish(report["status"])

    if as_json:
        print_json({"run_dir": str(run.path), **report})
    else:
        out.print(rich_table(gate_table(report)))
        out.print(rich_table(headline_table(report)))
        out.print(f"run directory: {run.path} (report.json, {', '.join(p.name for p in written.paths)})")
    if written.note:
        err.print(f"note: {written.note}")
    if report["status"] == "rejected":
        raise SystemExit(EXIT_GATE_REJECTED_ALL)
