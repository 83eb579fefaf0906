"""``optiq apply-fusion``: patch the model with recipes, prove it still computes the same function, re-measure decode
throughput against concurrency, and write the before/after report (the workflow of ``optiq.workflow``)."""

from __future__ import annotations

import click

from optiq.commands.common import (device_fields, err, exit_if_rejected, gate_options, measurement_options,
                                   model_options, out, print_json, recipes_dir_option, run_job, timing_note,
                                   wide_option, workload_options)
from optiq.text import visible


@click.command(name="apply-fusion")
@model_options
@click.option("--recipes", "requested", default="auto", show_default=True,
              help="auto (the proposals of a fresh profile) or recipe names, comma-separated.")
@recipes_dir_option
@workload_options()
@measurement_options("Also measure torch.compile of the unpatched model, the peer a user would pick instead.")
@gate_options
@click.option("--runs-dir", default="runs", show_default=True, help="Where the run directory is created.")
@wide_option
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as one JSON document: run_dir, device_kind (cpu or cuda), on a CPU timing_note "
                   "(what its timings mean), then the run record of report.json.")
def apply_fusion(model_spec, dtype, device, requested, recipes_dir, concurrency, prompt_len, new_tokens, max_len,
                 repeats, mode, peer_budget_s, compare, gate_steps, min_share, mutants, runs_dir, wide, as_json):
    """Patch the model with fusion recipes, validate them, re-measure throughput against concurrency, and report.

    \b
    Each recipe must pass the validation gate: its fused path, run on the real inputs of a decode step, may be no
    less accurate against a float64 reference than the original path (by its tolerance class's factor), and the
    patched model's logits over --gate-steps teacher-forced steps must stay within the set's bound of an fp32
    reference. A recipe that fails is rolled back and reported; the others stay (auto: and a rival it kept out, two
    recipes that patch the same place, is chosen and gated in its stead). Writes report.json, report.md and
    report.html (plotly, self-contained) into a new run directory. The gate's verdict is printed first, then the
    throughput; on a CPU the kernels run under Triton's interpreter, so the speed-up is not meaningful (n/m) and
    the verdict is what the run proves. Exit code 3 when the gate rejects every recipe, 4 when no recipe applies
    to the model.
    """
    from optiq.commands.views import fusion_summary, headline_view, rich_table
    from optiq.report import gate_table

    record, run, written, device = run_job("apply-fusion", model_spec, dtype, device, mode, concurrency, prompt_len,
                                           new_tokens, max_len, repeats, compare, requested, recipes_dir, gate_steps,
                                           min_share, runs_dir, profile=True, mutants=mutants, report=True,
                                           peer_budget_s=peer_budget_s)
    note = timing_note(device, fused=True)
    if as_json:
        print_json({"run_dir": str(run.path), **device_fields(device, fused=True), **record.to_json()})
    else:
        out.print(fusion_summary(record))
        out.print(rich_table(gate_table(record), wide))
        out.print(headline_view(record, wide))
        if note:
            out.print(f"note: {note}")
        page = next((p for p in written.paths if p.suffix == ".html"), None)
        out.print(f"run directory: {visible(run.path)} (report.json, {', '.join(p.name for p in written.paths)})"
                  + (f"\nopen {visible(page)} in a browser: the plots and every number of the gate" if page else ""))
    if written.note:
        err.print(f"note: {written.note}")
    exit_if_rejected(record)
