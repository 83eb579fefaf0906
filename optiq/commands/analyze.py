"""``optiq analyze TRACE...``: where each decode step's GPU time goes, for traces captured anywhere."""

from __future__ import annotations

from pathlib import Path

import click
from optiq.catalog.proposals import propose
from optiq.catalog.recipes import load_catalog
from optiq.commands.common import SIZE, out, print_json, recipes_dir_option, status
from optiq.commands.views import attribution_view, proposals_records, proposals_table
from optiq.errors import OptiqError
from optiq.rundir import write_csv
from optiq.text import visible
from optiq.traces.attribution import (GROUPINGS, align_graph_with_eager, attribute, attribution_document,
                                      weighted_kernels)
from optiq.traces.reader import Trace, read_trace


def read_ranks(paths: list[str]) -> list[Trace]:
    """One trace per file; files that claim the same rank (or none) are numbered by their position instead."""
    traces = [read_trace(path) for path in paths]
    if len({t.rank for t in traces}) < len(traces):
        for position, trace in enumerate(traces):
            trace.rank = position
    return sorted(traces, key=lambda t: t.rank)


def align_with_companion(traces: list[Trace], companion: str) -> None:
    """Attribute each graph trace's replayed kernels through the eager companion (same model and batch)."""
    eager = read_trace(companion)
    if eager.kernels["graph"].any() or eager.cpu_only:
        raise OptiqError(f"{companion}: the eager companion must be an eager GPU trace (no CUDA-graph replay)")
    for trace in traces:
        if not trace.kernels["graph"].any():
            trace.notes.append("no CUDA-graph replay in this trace: --eager-companion not used")
            continue
        align_graph_with_eager(trace, eager)


@click.command()
@click.argument("traces", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--by", type=click.Choice(list(GROUPINGS)), default="class", show_default=True,
              help="Group GPU time by op class, module role, kernel or decoder layer.")
@click.option("--eager-companion", default=None, type=click.Path(dir_okay=False),
              help="An eager trace of the same model and batch: CUDA-graph kernels take its ops, roles and layers.")
@click.option("--top", default=3, show_default=True, type=SIZE, help="Top kernels / places per row.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
@click.option("--csv", "csv_path", default=None, type=click.Path(dir_okay=False), help="Also write the rows here.")
@click.option("--proposals", "model_type", default=None, metavar="MODEL_TYPE",
              help="Also rank the recipes that apply to this transformers model type (llama, qwen3, ...; any = all).")
@recipes_dir_option
def analyze(traces, by, eager_companion, top, as_json, csv_path, model_type, recipes_dir):
    """Attribute the GPU time of traces captured elsewhere: torch.profiler exports, vLLM (*.pt.trace.json.gz) and
    SGLang (*-TP-*.trace.json.gz), .json or .json.gz.

    \b
    Several files are several ranks: each is shown, then all together. Steps come from optiq/step annotations,
    else vLLM's or SGLang's step markers, else the whole trace is one step.
    """
    with status(f"reading {len(traces)} trace(s)"):
        read = read_ranks(list(traces))
        if eager_companion:
            align_with_companion(read, eager_companion)
    results = [(f"rank {t.rank} · {Path(t.path).name}", [t], attribute([t], by, top)) for t in read]
    if len(read) > 1:
        results.append((f"all {len(read)} ranks", read, attribute(read, by, top)))

    proposals = {}
    if model_type:
        catalog = load_catalog(recipes_dir)
        wanted = None if model_type == "any" else model_type
        proposals = {title: propose(catalog, weighted_kernels(ts), wanted) for title, ts, _ in results}
    if csv_path:
        rows = [{"scope": title.split(" · ")[0], **row} for title, _, a in results
                for row in a.table.drop(columns="label").to_dict(orient="records")]
        write_csv(Path(csv_path), rows)
    if as_json:
        print_json({"results": [{"scope": title, **attribution_document(a, ts),
                                  **({"proposals": proposals_records(proposals[title])} if proposals else {})}
                                 for title, ts, a in results]})
        return
    for title, _, attribution in results:
        out.print(attribution_view(attribution, f"{title} · by {by}"))
        for note in attribution.notes:
            out.print(f"  note: {visible(note)}")
        if proposals:
            out.print(proposals_table(proposals[title], f"proposals · {title}"))
