"""``optiq analyze TRACE...``: where each decode step's GPU time goes, for traces captured anywhere."""

from __future__ import annotations

import difflib
import re
import textwrap
from pathlib import Path

import click

from optiq.commands.common import SIZE, out, print_json, recipes_dir_option, status, wide_option
from optiq.commands.views import attribution_view, proposals_records, proposals_table
from optiq.errors import OptiqError
from optiq.rundir import write_csv
from optiq.text import visible
from optiq.traces.attribution import (GROUPINGS, Attribution, align_graph_with_eager, attribute,
                                      attribution_document, compare, weighted_kernels)
from optiq.traces.reader import WORK_PHASES, Trace, read_trace, read_traces

STAGE_FILE = re.compile(r"-(EXTEND|DECODE)(?=\.trace\.json)")  # SGLang's profile_by_stage suffixes
COMPARED = ("class", "role")  # what --compare groups by: the classes and the roles whose time moved


def read_ranks(paths: list[str]) -> tuple[list[Trace], list[str]]:
    """The ranks the files hold (a merged SGLang file holds several), and why any file was left out.

    Frontend traces (vLLM's async_llm), CPU-only traces beside GPU ones, and traces without a decode step (SGLang's
    ``-EXTEND`` file of profile_by_stage) are left out with a note, so that a glob of a profile folder reads as its
    ranks; a frontend trace alone, or only traces without a decode step, are an error. Ranks claimed twice (or by no
    file) are numbered by position."""
    read = [trace for path in paths for trace in read_traces(path)]
    has_gpu = any(not t.cpu_only for t in read)
    notes = [f"{Path(t.path).name}: a CPU-only {'frontend ' if t.frontend else ''}trace: left out of the GPU table"
             for t in read if t.frontend or (has_gpu and t.cpu_only)]
    traces = [t for t in read if not (t.frontend or (has_gpu and t.cpu_only))]
    if not traces:
        raise OptiqError(f"{paths[0]}: a CPU-only frontend trace, no GPU events and no CPU ops to attribute; pass "
                         "the worker traces written beside it")
    decoding = [t for t in traces if len(t.steps)]
    if not decoding:
        raise OptiqError(f"{traces[0].path}: no decode step in {'these traces' if len(traces) > 1 else 'it'} "
                         f"({'; '.join(dict.fromkeys(n for t in traces for n in t.notes))})")
    notes += [f"{Path(t.path).name}{f' [{t.label}]' if t.label else ''}: no decode step (prefill only): left out"
              for t in traces if not len(t.steps)]
    decode_stage = {STAGE_FILE.sub("", Path(t.path).name) for t in decoding if "-DECODE." in Path(t.path).name}

    def prefill_stage(trace: Trace) -> bool:
        """A prefill-stage file whose rank has its decode-stage file here: the same rank, counted once."""
        name = Path(trace.path).name
        return "-EXTEND." in name and STAGE_FILE.sub("", name) in decode_stage

    notes += [f"{Path(t.path).name}: the prefill stage of a rank whose -DECODE file is given: left out"
              for t in decoding if prefill_stage(t)]
    decoding = [t for t in decoding if not prefill_stage(t)]
    if len({t.rank for t in decoding}) < len(decoding):
        for position, trace in enumerate(decoding):
            trace.rank = position
    return sorted(decoding, key=lambda t: t.rank), notes


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


def known_model_type(model_type: str, catalog: dict) -> None:
    """Refuse a model type that neither transformers nor a recipe knows (``lama``): proposals for it would be an
    empty table that looks like an answer. Close matches are suggested."""
    if model_type == "any":
        return
    from transformers import CONFIG_MAPPING  # only here: analyze without --proposals never pays for transformers

    known = {*CONFIG_MAPPING.keys(), *(a for r in catalog.values() for a in r.architectures if a != "*")}
    if model_type not in known:
        close = difflib.get_close_matches(model_type, sorted(known), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; 'any' ranks every recipe"
        raise OptiqError(f"--proposals: unknown model type {visible(model_type, limit=60)!r} (a transformers "
                         f"model_type, e.g. llama, qwen3){hint}")


def step_line(attribution: Attribution) -> str:
    """What one step is in these numbers, and the collectives' share and skew where the step has any."""
    s = attribution.summary
    line = f"  step: {s['step_definition']}"
    coll = s["collectives"]
    if coll["share"] > 0:
        ranks = ", ".join(f"rank {r} {ms:.3f}" for r, ms in coll["ms_per_step"].items())
        line += (f"\n  collectives: {100 * coll['share']:.1f}% of the step's GPU time ({ranks} ms/step); skew "
                 f"across ranks {coll['skew_ms']:.3f} ms/step")
    return line


def compare_view(table, by: str, title: str) -> str:
    """An 80-column plain table of what moved, one row per class or role."""
    head = f"{by[:20]:<20} {'before':>9} {'after':>9} {'Δ ms':>9} {'before%':>8} {'after%':>8} {'Δ pts':>7}"
    lines = [visible(title)[:80], head, "-" * len(head)]
    for row in table.to_dict(orient="records"):
        lines.append(f"{visible(row[by])[:20]:<20} {row['before_ms_per_step']:>9.4f} "
                     f"{row['after_ms_per_step']:>9.4f} {row['delta_ms_per_step']:>+9.4f} {row['before_pct']:>8.1f} "
                     f"{row['after_pct']:>8.1f} {row['delta_pct']:>+7.1f}")
    lines.append("(GPU ms per step; % of each side's counted GPU time)")
    return "\n".join(lines)


def run_compare(before_paths: list[str], after_paths: list[str], top: int, as_json: bool) -> None:
    """Before/after, e.g. two server builds: per class and role, what moved. Both sides count the same work: where
    one side's steps hold sampling (optiq's own) and the other's do not (an engine's), both count sampling and
    drafting too."""
    (before, before_notes), (after, after_notes) = read_ranks(before_paths), read_ranks(after_paths)
    definitions = {t.step_source == "optiq" for t in before + after if t.step_source != "whole trace"}
    phases = WORK_PHASES if len(definitions) > 1 else ("step",)
    notes = before_notes + after_notes
    if len(definitions) > 1:
        notes.append("one side's steps hold sampling (optiq), the other's not (an engine): both sides count the "
                     "forward, sampling and drafting")
    sides = {by: (attribute(before, by, top, phases), attribute(after, by, top, phases)) for by in COMPARED}
    tables = {by: compare(*pair) for by, pair in sides.items()}
    if as_json:
        print_json({"compare": {
            "counted_phases": list(phases), "notes": notes,
            **{side: {"files": [t.path for t in ts], "summary": sides["class"][i].summary}
               for i, (side, ts) in enumerate((("before", before), ("after", after)))},
            **{by: table.to_dict(orient="records") for by, table in tables.items()}}})
        return
    for by, table in tables.items():
        out.print(compare_view(table, by, f"what moved · by {by} · {len(before)} rank(s) before, {len(after)} after"))
    lines = [f"step {side}: {sides['class'][i].summary['step_definition']}" for i, side in enumerate(("before",
                                                                                                       "after"))]
    for line in lines + [f"note: {visible(note)}" for note in notes]:
        out.print(textwrap.fill(line, width=80, subsequent_indent="    "))


@click.command()
@click.argument("traces", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--by", type=click.Choice(list(GROUPINGS)), default="class", show_default=True,
              help="Group GPU time by op class, module role, kernel or decoder layer.")
@click.option("--eager-companion", default=None, type=click.Path(dir_okay=False),
              help="An eager trace of the same model and batch: CUDA-graph kernels take its ops, roles and layers.")
@click.option("--compare", "before", multiple=True, type=click.Path(dir_okay=False), metavar="BEFORE",
              help="Compare BEFORE trace(s) (repeat the option for several ranks) with TRACES: what moved, per class "
                   "and per role (--by is not used).")
@click.option("--top", default=3, show_default=True, type=SIZE, help="Top kernels / places per row.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
@click.option("--csv", "csv_path", default=None, type=click.Path(dir_okay=False), help="Also write the rows here.")
@click.option("--proposals", "model_type", default=None, metavar="MODEL_TYPE",
              help="Also rank the recipes that apply to this transformers model type (llama, qwen3, ...; any = all).")
@recipes_dir_option
@wide_option
def analyze(traces, by, eager_companion, before, top, as_json, csv_path, model_type, recipes_dir, wide):
    """Attribute the GPU time of traces captured elsewhere: torch.profiler exports, vLLM (*.pt.trace.json.gz) and
    SGLang (*-TP-*.trace.json.gz, merged-*.trace.json.gz), .json or .json.gz.

    \b
    Several files are several ranks: each is shown, then all together (a merged SGLang file is split into its
    ranks; vLLM's frontend trace and prefill-only files are left out with a note). Steps come from optiq/step
    annotations (forward and sampling), else vLLM's or SGLang's decode markers (the forward; their sampling and
    drafting are shown apart), else the whole trace is one step. --compare BEFORE AFTER shows what moved.
    """
    catalog = {}
    if model_type:
        from optiq.catalog.recipes import load_catalog  # the catalog imports the patching, so torch: only here

        catalog = load_catalog(recipes_dir)
        known_model_type(model_type, catalog)
    if before:
        given = [flag for flag, value in (("--eager-companion", eager_companion), ("--csv", csv_path),
                                          ("--proposals", model_type)) if value]
        if given:
            raise OptiqError(f"--compare shows what moved by class and role; it takes no {', '.join(given)}")
        with status(f"reading {len(before) + len(traces)} trace(s)"):
            run_compare(list(before), list(traces), top, as_json)
        return
    with status(f"reading {len(traces)} trace(s)"):
        read, file_notes = read_ranks(list(traces))
        if eager_companion:
            align_with_companion(read, eager_companion)
    results = [(f"rank {t.rank} · {Path(t.path).name}{f' [{t.label}]' if t.label else ''}", [t],
                attribute([t], by, top)) for t in read]
    if len(read) > 1:
        results.append((f"all {len(read)} ranks", read, attribute(read, by, top)))
    for _, _, attribution in results:
        attribution.notes[:0] = file_notes

    proposals = {}
    if model_type:
        from optiq.catalog.proposals import propose

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
        out.print(attribution_view(attribution, f"{title} · by {by}", wide))
        out.print(step_line(attribution))
        for note in attribution.notes:
            out.print(f"  note: {visible(note)}")
        if proposals:
            out.print(proposals_table(proposals[title], f"proposals · {title}", wide))
