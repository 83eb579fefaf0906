"""``optiq apply-fusion``: patch the model with recipes, prove it still computes the same function, re-measure decode
throughput against concurrency, and write the before/after report."""

from __future__ import annotations

import time
from dataclasses import asdict

import click
from optiq.commands.common import (err, measurement_options, model_options, out, parse_concurrency, print_json,
                                   resolve_device_and_mode, stop_interrupted, workload_defaults, workload_options)
from optiq.commands.recipes import recipes_dir_option
from optiq.errors import EXIT_GATE_REJECTED_ALL, OptiqError

PROFILED_STEPS = 2


def choose_recipes(requested: str, catalog: dict, proposals: dict[int, list], min_share: float) -> list[str]:
    """``auto``: every proposal covering at least ``min_share`` % of the step at some concurrency, largest first, but
    none that patches what a larger one patches (concurrencies may rank rivals differently); otherwise the named
    recipes, which must exist."""
    if requested != "auto":
        names = [n.strip() for n in requested.split(",") if n.strip()]
        unknown = [n for n in names if n not in catalog]
        if unknown:
            raise OptiqError(f"unknown recipe(s) {', '.join(unknown)}; the catalog has: {', '.join(catalog)}")
        return names
    best: dict[str, float] = {}
    for found in proposals.values():
        for p in found:
            best[p.recipe] = max(best.get(p.recipe, 0.0), p.covered_pct)
    chosen, taken = [], set()
    for name, share in sorted(best.items(), key=lambda item: -item[1]):
        if share >= min_share and not taken.intersection(catalog[name].claims):
            chosen.append(name)
            taken.update(catalog[name].claims)
    return chosen


@click.command(name="apply-fusion")
@model_options
@click.option("--recipes", "requested", default="auto", show_default=True,
              help="auto (the proposals of a fresh profile) or recipe names, comma-separated.")
@recipes_dir_option
@workload_options()
@measurement_options("Also measure torch.compile of the unpatched model, the peer a user would pick instead.")
@click.option("--gate-steps", default=64, show_default=True, type=click.IntRange(1),
              help="Teacher-forced decode steps of the end-to-end check, at every concurrency.")
@click.option("--min-share", default=0.25, show_default=True,
              help="auto: take proposals that cover at least this % of the step at some concurrency (of the "
                   "unpatched step: llama-3.1-8b's argmax is 0.45% of it, 0.8% of the fused one).")
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
    from optiq.patching import apply, unpatch
    from optiq.profiling import profile_step
    from optiq.proposals import propose
    from optiq.recipes import load_catalog
    from optiq.roofline import copy_bandwidth
    from optiq.rundir import RunDir, write_json
    from optiq.commands.report import rich_table
    from optiq.report import gate_table, headline_table, write_report
    from optiq.validation import validate

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
              "recipes_requested": requested.split(","), "proposals": {}, "applied": [], "not_applicable": {},
              "rolled_back": [], "gate": {"recipes": {}, "end_to_end": []}, "before": {"rows": []},
              "after": {"rows": []}, "attribution_before": {}, "attribution_after": {}, "timings": {}}

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

    def proposals_without(rejected) -> dict[int, list]:
        """The catalog's proposals per concurrency for the profiled ``kernels``, leaving out ``rejected`` recipes."""
        candidates = {n: r for n, r in catalog.items() if n not in rejected}
        return {c: propose(candidates, k, model.config.model_type) for c, k in kernels.items()}

    def patch_and_gate(names: list[str]):
        """Apply ``names`` and validate them; returns the patches and what this round rolled back. The report adds up
        the rounds' timings and gate verdicts."""
        timings = report["timings"]
        started = time.perf_counter()
        patches = apply(model, [catalog[n] for n in names])
        timings["patch_s"] = timings.get("patch_s", 0.0) + time.perf_counter() - started
        report["not_applicable"].update(patches.not_applicable)
        started = time.perf_counter()
        with err.status(f"validating {', '.join(patches.applied)}"):
            gate = validate(patches, concurrencies=tuple(concurrencies), steps=gate_steps,
                            prompt_len=min(prompt_len, max_len - gate_steps - 1), mode=mode)
        for key, seconds in (("gate_s", time.perf_counter() - started), ("gate_capture_s", gate.capture_seconds),
                             ("gate_baselines_s", gate.baseline_seconds),
                             ("gate_reference_s", gate.reference_seconds)):
            timings[key] = timings.get(key, 0.0) + seconds
        report["gate"]["recipes"].update({n: asdict(r) for n, r in gate.recipes.items()})
        report["gate"]["end_to_end"] = [asdict(e) for e in gate.end_to_end]
        report["rolled_back"] += gate.rolled_back
        report["applied"] = list(patches.applied)
        save()
        return patches, gate.rolled_back

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
        before = profile_all("attribution_before", "before")
        kernels = {c: weighted_kernels([t]) for c, t in before.items()}
        proposals = proposals_without(())
        report["proposals"] = {str(c): [asdict(p) for p in found] for c, found in proposals.items()}
        names = choose_recipes(requested, catalog, proposals, min_share)
        if not names:
            raise OptiqError(f"no recipe to apply: no proposal covers {min_share}% of the step")
        variants = [(mode, mode, None)]
        if compare == "compile":
            variants.append((f"compile+{mode}", mode, compiled_forward(model)))
        measure("before", variants)

        patches, rolled_back = patch_and_gate(names)
        while requested == "auto" and rolled_back:
            # a recipe the gate rolled back may have kept a rival out: choose again without it, if that adds one
            again = choose_recipes(requested, catalog, proposals_without(report["rolled_back"]), min_share)
            if not set(again) - set(names):
                break
            unpatch(model)
            names = again
            patches, rolled_back = patch_and_gate(names)
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
