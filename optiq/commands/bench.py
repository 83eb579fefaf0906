"""``optiq bench``: decode throughput against concurrency for one model state, with the bandwidth floor."""

from __future__ import annotations

import platform

import click
import torch
import transformers
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from optiq import __version__
from optiq.bench import Workload, compiled_forward, sweep
from optiq.commands.common import (err, measurement_options, model_options, out, parse_concurrency, print_json,
                                   resolve_device_and_mode, stop_interrupted, workload_defaults, workload_options)
from optiq.models import PRESETS, default_dtype, default_preset, load_model, resolve_dtype
from optiq.roofline import copy_bandwidth, device_name
from optiq.rundir import RunDir, write_csv, write_json


def environment(device: torch.device) -> dict:
    """What a benchmark number depends on besides the code: device and library versions."""
    return {"device": device_name(device), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(), "optiq": __version__}


def results_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    for name in ("variant", "C", "tok/s", "ms/step", "floor ms", "% of floor", "prefill ms", "warm-up s", "peak GB"):
        table.add_column(name, justify="left" if name == "variant" else "right")
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["variant"], str(r["concurrency"]), f"[red]{r['status']}[/red]", *[""] * 6)
            continue
        peak = "" if r["peak_mem_gb"] is None else f"{r['peak_mem_gb']:.1f}"
        table.add_row(r["variant"], str(r["concurrency"]), f"{r['tok_per_s']:,.1f}", f"{r['ms_per_step']:.3f}",
                      f"{r['floor_ms_per_step']:.3f}", f"{r['pct_of_floor']:.1f}", f"{r['prefill_ms']:.1f}",
                      f"{r['warmup_s']:.2f}", peak)
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


@click.command()
@model_options
@workload_options()
@measurement_options("Also measure a peer the same way: compile = torch.compile of the forward (compile time shown).")
@click.option("--runs-dir", default="runs", show_default=True, help="Where the run directory is created.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON document.")
def bench(model_spec, dtype, device, concurrency, prompt_len, new_tokens, max_len, repeats, mode, compare, runs_dir,
          as_json):
    """Decode throughput against concurrency, with each point's bandwidth floor.

    \b
    Presets: """ + ", ".join(PRESETS) + """.
    A concurrency that runs out of memory is recorded as such and the sweep goes on. Results are written to a new run
    directory (results.json, results.csv) after every point; Ctrl-C keeps what was measured and marks it incomplete.
    """
    device, mode = resolve_device_and_mode(device, mode)
    model_spec = model_spec or default_preset(device)
    concurrency, prompt_len, new_tokens, max_len = workload_defaults(
        device, concurrency=concurrency, prompt_len=prompt_len, new_tokens=new_tokens, max_len=max_len)
    workload = Workload(prompt_len, new_tokens, max_len, repeats)
    workload.check()
    concurrencies = parse_concurrency(concurrency)
    torch_dtype = resolve_dtype(dtype or default_dtype(device), device)

    args = dict(model=model_spec, dtype=str(torch_dtype).removeprefix("torch."), concurrency=concurrencies,
                mode=mode, compare=compare, **workload.__dict__)
    run = RunDir(runs_dir, "bench", args)
    env = environment(device)
    write_json(run.path / "environment.json", env)

    with err.status(f"loading {model_spec}"):
        model = load_model(model_spec, torch_dtype, device)
    bandwidth = copy_bandwidth(device)
    variants = [(mode, mode, None)]
    if compare == "compile":
        variants.append((f"compile+{mode}", mode, compiled_forward(model)))

    def document(rows):
        return {"run_dir": str(run.path), "args": args, "environment": env, "bandwidth_gb_s": bandwidth / 1e9,
                "rows": rows}

    def save(rows):
        write_json(run.path / "results.json", document(rows))
        write_csv(run.path / "results.csv", [{k: v for k, v in r.items() if k != "ms_per_step_repeats"} for r in rows])

    rows: list[dict] = []
    try:
        rows = sweep_with_progress(model_spec, model, concurrencies, workload, variants, bandwidth, save, rows)
    except KeyboardInterrupt:
        stop_interrupted(run, f"{len(rows)} point(s)", points_done=len(rows))
    run.finish("complete", points_done=len(rows))

    if as_json:
        print_json(document(rows))
    else:
        out.print(results_table(rows, f"{model_spec} · {args['dtype']} · prompt {prompt_len} · {new_tokens} new tokens"
                                      f" · {env['device']} · copy roof {bandwidth / 1e9:,.0f} GB/s"))
        out.print(f"run directory: {run.path}")
