"""``optiq bench``: decode throughput against concurrency for one model state, with the bandwidth floor; with
``--recipes``, optiq's fused model beside it (the workflow of ``optiq.workflow``)."""

from __future__ import annotations

import click

from optiq.commands.common import (PRESET_NAMES, device_fields, exit_if_rejected, gate_options, measurement_options,
                                   model_options, out, print_json, recipes_dir_option, run_job, timing_note,
                                   wide_option, workload_options)
from optiq.text import visible

BENCH_HELP = """Decode throughput against concurrency, with each point's bandwidth floor.

\b
Presets: """ + ", ".join(PRESET_NAMES) + """.

One command measures a whole row of the comparison a user makes: with --compare hf,eager,compile and --recipes auto,
HF's own step (its own cache, as generate runs it), HF eager on the engine's static cache, the engine's mode,
torch.compile and optiq's fused model, in one process and one run directory, and the time to optimized (patch,
gate and capture) against torch.compile's warm-up. A concurrency that runs out of memory is recorded as such and the
sweep goes on. Results are written to a new run directory (results.json, results.csv) after
every point; Ctrl-C keeps what was measured and marks it incomplete. Exit code 3 when the gate rejects every recipe,
4 when no recipe applies to the model. On a CPU the numbers say nothing about a GPU (and the fused model's kernels
run under Triton's interpreter: its ratios are shown as n/m); --json says so in timing_note.

A preset that holds some of a deeper published model's layers (deepseek-v4-flash: 6 of DeepSeek-V4-Flash's 43) is
also profiled at every point of the model and of optiq's fused model: the tables then add its layers' mean time by
kind and the whole model's step extrapolated from them, beside the whole model's floor (full_depth in the record).
"""


@click.command(help=BENCH_HELP)
@model_options
@workload_options()
@measurement_options("Also measure peers the same way, comma-separated: hf = HF's own step, as generate runs it "
                     "(the model's own cache, DynamicCache or its architecture's, op by op from Python), eager = HF's "
                     "step launched op by op on the engine's static cache (no graph), compile = torch.compile of the "
                     "forward (its warm-up shown).",
                     peers=("hf", "eager", "compile"))
@click.option("--recipes", "requested", default=None,
              help="Also measure optiq: the model fused with these recipes (auto = the proposals of a fresh profile, "
                   "or names, comma-separated), each through the validation gate as in apply-fusion.")
@recipes_dir_option
@gate_options
@click.option("--runs-dir", default="runs", show_default=True, help="Where the run directory is created.")
@wide_option
@click.option("--json", "as_json", is_flag=True,
              help="Print the results as one JSON document: run_dir, device_kind (cpu or cuda), on a CPU timing_note "
                   "(what its timings mean), then the run record of results.json.")
def bench(model_spec, dtype, device, concurrency, prompt_len, new_tokens, max_len, repeats, mode, peer_budget_s, compare,
          requested, recipes_dir, gate_steps, min_share, mutants, runs_dir, wide, as_json):
    from optiq.commands.views import fusion_summary, results_table, rich_table
    from optiq.report import depth_tables

    record, run, _, device = run_job("bench", model_spec, dtype, device, mode, concurrency, prompt_len, new_tokens,
                                     max_len, repeats, compare, requested, recipes_dir, gate_steps, min_share, runs_dir,
                                     profile=False, mutants=mutants, peer_budget_s=peer_budget_s)
    fused = record.fusion is not None
    note = timing_note(device, fused)
    if as_json:
        print_json({"run_dir": str(run.path), **device_fields(device, fused), **record.to_json()})
    else:
        if fused:
            out.print(fusion_summary(record))
        out.print(results_table(record.before + record.after,
                                f"{record.model} · {record.dtype} · prompt {record.workload.prompt_len} · "
                                f"{record.workload.new_tokens} new tokens · {record.environment.device} · copy roof "
                                f"{record.bandwidth_gb_s:,.0f} GB/s", wide,
                                interpreted={r.variant for r in record.after} if note else ()))
        for table in depth_tables(record):
            out.print(rich_table(table, wide))
        if note:
            out.print(f"note: {note}")
        out.print(f"run directory: {visible(run.path)}")
    exit_if_rejected(record)
