"""``optiq bench``: decode throughput against concurrency for one model state, with the bandwidth floor."""

from __future__ import annotations

import platform

import click
import torch
import transformers
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from optiq import __version__
from optiq.attribution import weighted_kernels
from optiq.bench import Workload, compiled_forward, free_memory, sweep
from optiq.commands.common import (err, gate_options, measurement_options, model_options, out, parse_concurrency,
                                   print_json, resolve_device_and_mode, stop_interrupted, workload_defaults,
                                   workload_options)
from optiq.commands.recipes import recipes_dir_option
from optiq.errors import EXIT_GATE_REJECTED_ALL, OptiqError
from optiq.models import PRESETS, default_dtype, default_preset, load_model, resolve_dtype
from optiq.profiling import profile_step
from optiq.recipes import load_catalog
from optiq.report import compile_variant, is_compile_row, optimization_wait
from optiq.roofline import copy_bandwidth, device_name
from optiq.rundir import RunDir, write_csv, write_json


def environment(device: torch.device) -> dict:
    """What a benchmark number depends on besides the code: device and library versions."""
    return {"device": device_name(device), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "optiq": __version__}


def results_table(rows: list[dict], title: str) -> Table:
    """One line per point; with torch.compile among the variants, each point's throughput over compile's too."""
    compiled = {r["concurrency"]: r["tok_per_s"] for r in rows
                if is_compile_row(r) and r["status"] == "ok"}
    columns = ["variant", "C", "tok/s", *(["× compile"] if compiled else []), "ms/step", "floor ms", "% of floor",
               "prefill ms", "warm-up s", "peak GB"]
    table = Table(title=title)
    for name in columns:
        table.add_column(name, justify="left" if name == "variant" else "right")
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["variant"], str(r["concurrency"]), f"[red]{r['status']}[/red]", *[""] * (len(columns) - 3))
            continue
        ratio = [f"{r['tok_per_s'] / compiled[r['concurrency']]:.2f}" if r["concurrency"] in compiled else ""]
        peak = "" if r["peak_mem_gb"] is None else f"{r['peak_mem_gb']:.1f}"
        table.add_row(r["variant"], str(r["concurrency"]), f"{r['tok_per_s']:,.1f}", *(ratio if compiled else []),
                      f"{r['ms_per_step']:.3f}", f"{r['floor_ms_per_step']:.3f}", f"{r['pct_of_floor']:.1f}",
                      f"{r['prefill_ms']:.1f}", f"{r['warmup_s']:.2f}", peak)
    return table


def sweep_with_progress(label: str, model, concurrencies: list[int], workload: Workload, variants, bandwidth: float,
                        save, rows: list[dict], engine_patches=None) -> list[dict]:
    """``sweep`` with a progress bar; ``rows`` holds the finished points and ``save(rows)`` runs after each. On Ctrl-C
    the points so far are saved once more (the interrupt may land between two files of a save) and it propagates."""
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), console=err, transient=True)
    with progress:
        task = progress.add_task(label, total=len(variants) * len(concurrencies))

        def on_start(name, batch):
            progress.update(task, description=f"{label} {name} C={batch}")

        def on_row(done):
            rows[:] = done
            save(done)
            progress.advance(task)

        try:
            sweep(model, concurrencies, workload, variants, bandwidth, on_row=on_row, on_start=on_start,
                  engine_patches=engine_patches)
        except KeyboardInterrupt:
            save(rows)
            raise
    return rows


BENCH_HELP = """Decode throughput against concurrency, with each point's bandwidth floor.

\b
Presets: """ + ", ".join(PRESETS) + """.

One command measures a whole row of the comparison a user makes: with --compare eager,compile and --recipes auto, HF
eager, the engine's mode, torch.compile and optiq's fused model, in one process and one run directory, and the time
to optimized (patch + gate + capture) against torch.compile's warm-up. A concurrency that runs out of memory is
recorded as such and the sweep goes on. Results are written to a new run directory (results.json, results.csv) after
every point; Ctrl-C keeps what was measured and marks it incomplete. Exit code 3 when the gate rejects every recipe.
"""


@click.command(help=BENCH_HELP)
@model_options
@workload_options()
@measurement_options("Also measure peers the same way, comma-separated: eager = HF's step launched op by op from "
                     "Python (no graph), compile = torch.compile of the forward (its warm-up shown).",
                     peers=("eager", "compile"))
@click.option("--recipes", "requested", default=None,
              help="Also measure optiq: the model fused with these recipes (auto = the proposals of a fresh profile, "
                   "or names, comma-separated), each through the validation gate as in apply-fusion.")
@recipes_dir_option
@gate_options
@click.option("--runs-dir", default="runs", show_default=True, help="Where the run directory is created.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON document.")
def bench(model_spec, dtype, device, concurrency, prompt_len, new_tokens, max_len, repeats, mode, compare, requested,
          recipes_dir, gate_steps, min_share, runs_dir, as_json):
    device, mode = resolve_device_and_mode(device, mode)  # first: it picks Triton's interpreter on the CPU
    from optiq import compile_ahead
    from optiq.fusing import PROFILED_STEPS, choose_again, choose_recipes, fuse, gate_settings, new_record, proposals

    model_spec = model_spec or default_preset(device)
    concurrency, prompt_len, new_tokens, max_len = workload_defaults(
        device, concurrency=concurrency, prompt_len=prompt_len, new_tokens=new_tokens, max_len=max_len)
    workload = Workload(prompt_len, new_tokens, max_len, repeats)
    workload.check()
    concurrencies = parse_concurrency(concurrency)
    torch_dtype = resolve_dtype(dtype or default_dtype(device), device)
    catalog = load_catalog(recipes_dir) if requested else {}
    if requested and requested != "auto":
        choose_recipes(requested, catalog, {}, min_share)  # unknown names fail before any work

    args = dict(model=model_spec, dtype=str(torch_dtype).removeprefix("torch."), concurrency=concurrencies,
                mode=mode, compare=compare, recipes=requested, **workload.__dict__)
    run = RunDir(runs_dir, "bench", args)
    env = environment(device)
    write_json(run.path / "environment.json", env)
    measured: list[dict] = []
    fused: list[dict] = []
    fusion = new_record() if requested else None

    def document():
        doc = {"run_dir": str(run.path), "args": args, "environment": env, "bandwidth_gb_s": bandwidth / 1e9,
               "rows": measured + fused}
        if fusion is not None:
            doc["fusion"] = fusion
            doc["time_to_optimized"] = waits(fusion, doc["rows"])
        return doc

    def save(_rows=None):  # sweep_with_progress passes its rows: they are in measured or fused already
        doc = document()
        write_json(run.path / "results.json", doc)
        write_csv(run.path / "results.csv", [{k: v for k, v in r.items() if k != "ms_per_step_repeats"}
                                             for r in doc["rows"]])

    bandwidth = 0.0
    status = "complete"
    try:
        with err.status(f"loading {model_spec}"):
            model = load_model(model_spec, torch_dtype, device)
        bandwidth = copy_bandwidth(device)
        variants = [("eager", "eager", None)] if "eager" in compare and mode != "eager" else []
        variants.append((mode, mode, None))
        if "compile" in compare:
            variants.append((compile_variant(mode), mode, compiled_forward(model)))
        sweep_with_progress(model_spec, model, concurrencies, workload, variants, bandwidth, save, measured)
        if requested:
            gate = gate_settings(concurrencies, gate_steps, prompt_len, max_len, mode)
            # The workers start up while the model is profiled for the proposals (with auto; named recipes skip it).
            with compile_ahead.workers(device, model_spec, args["dtype"], recipes_dir, prompt_len, max_len,
                                       gate) as ahead:
                kernels = {}
                if requested == "auto":
                    for batch in concurrencies:
                        with err.status(f"profiling {model_spec} C={batch} for the proposals"):
                            trace = profile_step(model, batch, prompt_len, max_len, mode, run.path, PROFILED_STEPS,
                                                 "before_")
                        kernels[batch] = weighted_kernels([trace])
                        free_memory()
                found = proposals(catalog, kernels, model.config.model_type)
                names = choose_recipes(requested, catalog, found, min_share)
                if not names:
                    raise OptiqError(f"no recipe to apply: no proposal covers {min_share}% of the step")
                patches = fuse(model, catalog, names, fusion, gate,
                               choose_again(requested, catalog, kernels, model.config.model_type, min_share),
                               on_round=save, status=err.status, ahead=ahead)
            if patches.applied:
                sweep_with_progress(f"{model_spec} optiq", model, concurrencies, workload,
                                    [(f"optiq+{mode}", mode, None)], bandwidth, save, fused, engine_patches=patches)
                fusion["timings"]["capture_s"] = sum(r.get("warmup_s", 0.0) for r in fused)
            else:
                status = "rejected"
    except OptiqError:  # what was measured is on disk already (and the error may be that the disk is full)
        run.finish("failed", points_done=len(measured) + len(fused))
        raise
    except KeyboardInterrupt:
        save()
        stop_interrupted(run, f"{len(measured) + len(fused)} point(s)", points_done=len(measured) + len(fused))
    save()
    run.finish(status, points_done=len(measured) + len(fused))

    if as_json:
        print_json(document())
    else:
        out.print(results_table(measured + fused, f"{model_spec} · {args['dtype']} · prompt {prompt_len} · "
                                                  f"{new_tokens} new tokens · {env['device']} · copy roof "
                                                  f"{bandwidth / 1e9:,.0f} GB/s"))
        if fusion is not None:
            out.print(fusion_summary(fusion, waits(fusion, measured + fused)))
        out.print(f"run directory: {run.path}")
    if status == "rejected":
        raise SystemExit(EXIT_GATE_REJECTED_ALL)


def waits(fusion: dict, rows: list[dict]) -> dict | None:
    """Time to optimized (patch + gate + capture) and torch.compile's warm-up over the same concurrencies."""
    found = optimization_wait(fusion["timings"], [r for r in rows if is_compile_row(r)])
    if found is None:
        return None
    optimized, warmup = found
    return {"optimized_s": optimized, "compile_warmup_s": warmup,
            "ratio": optimized / warmup if warmup else None}


def fusion_summary(fusion: dict, wait: dict | None) -> str:
    """Two lines for people: what was applied and rolled back (with why), and the wait against compile's."""
    rolled = [f"{n} ({fusion['gate']['recipes'].get(n, {}).get('reason', 'failed')})" for n in fusion["rolled_back"]]
    lines = [f"optiq: applied {', '.join(fusion['applied']) or 'nothing'}; rolled back {', '.join(rolled) or 'none'}"]
    if wait is not None:
        lines.append(f"time to optimized {wait['optimized_s']:.1f} s (patch + gate + capture)" + (
            f"; torch.compile's warm-up {wait['compile_warmup_s']:.1f} s, {wait['ratio']:.2f}x of it"
            if wait["ratio"] is not None else ""))
    return "\n".join(lines)
