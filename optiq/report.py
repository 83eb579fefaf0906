"""The before/after report of ``optiq apply-fusion`` and the comparison of two runs, rendered from ``report.json``.

Everything here is a pure function of the report documents, so a report can be re-rendered at any time from the run
directory alone. A report is first built as a :class:`Document` (facts, tables, plot descriptions); Markdown and HTML
are two renderings of the same document, so they never disagree. Only the HTML needs plotly, imported when rendering:
without it the Markdown is still written and the HTML is skipped with a note.
"""

from __future__ import annotations

import html
import math
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from optiq import record
from optiq.errors import OptiqError
from optiq.record import CompiledAhead, EndToEndVerdict, Fusion, Row, RunRecord
from optiq.rundir import write_atomic
from optiq.text import visible

STACK_CLASSES = 8  # op classes drawn in the stacked bars; the rest are summed as REST
REST = "the rest"  # not "other", which is an op class of its own
FLOOR_REACH = 1.0  # decades beyond the measured values a plot's axis stretches to show the bandwidth floor
NOT_MEANINGFUL = "not meaningful"
RATIO_NOT_MEANINGFUL = "n/m"  # a ratio's cell on a smoke run: what it divides says nothing of a GPU


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""


@dataclass
class Lines:
    """Measured values against concurrency, one line per series (``dash`` tells the model's own from a peer's),
    log-log, with the bandwidth floor as a reference where the axis fitted to the measurements reaches it
    (``y_range``)."""

    title: str
    y_title: str
    series: list[tuple[str, dict[int, float], str]]  # (name, {concurrency: value}, "solid" | "dash")
    floor: tuple[str, dict[int, float]] = ("", {})  # (name, {concurrency: value}), drawn dotted

    @property
    def empty(self) -> bool:
        return not any(_logs(values) for _, values, _ in self.series)

    def y_range(self) -> tuple[tuple[float, float], str]:
        """The log10 range of the y axis, and what to say where the floor lies off it.

        The axis fits the measured values; the floor joins them when it lies within FLOOR_REACH decades. On the CPU
        it does not (a floor of ~10^5 tok/s over measurements of 1 to 10^3 would squash them at the bottom of five
        decades), so it is left out and named in the returned text instead.
        """
        measured = [log for _, values, _ in self.series for log in _logs(values)]
        low, high = min(measured), max(measured)
        name, values = self.floor
        floor = _logs(values)
        off = ""
        if floor and low - FLOOR_REACH <= min(floor) and max(floor) <= high + FLOOR_REACH:
            low, high = min(low, *floor), max(high, *floor)
        elif floor:
            side, factor = ("above", 10 ** (min(floor) - high)) if min(floor) > high else (
                "below", 10 ** (low - max(floor)))
            off = (f"{name}: {_number(10 ** min(floor))} to {_number(10 ** max(floor))} {self.y_title}, off this axis "
                   f"({factor:,.0f}x {side} the measured lines)")
        pad = max(0.05, 0.08 * (high - low))
        return (low - pad, high + pad), off


def _logs(values: dict[int, float]) -> list[float]:
    """The log10 of the values a log axis can show: positive and finite (a hand-edited record may hold others)."""
    return [math.log10(v) for v in values.values() if 0 < v < math.inf]


@dataclass
class Stack:
    """Profiled ms/step by op class, one stacked bar per (concurrency, state), and the timed step of the same state
    as a marker beside it: the two measure different things, which ``note`` says."""

    title: str
    bars: list[tuple[str, str, dict[str, float], float | None]]  # (concurrency label, state label,
    # {op class: ms/step}, the timed ms/step)
    note: str = ""

    @property
    def empty(self) -> bool:
        return not self.bars


@dataclass
class Document:
    """A report: its notice (what its numbers mean, first), facts, tables and plots. In the HTML the plots come after
    the first ``lead`` tables: a report leads with the gate's verdict, then the throughput they illustrate."""
    title: str
    facts: list[tuple[str, str]]
    tables: list[Table]
    plots: list[Lines | Stack] = field(default_factory=list)
    notice: str = ""
    lead: int = 0


# --- reading -------------------------------------------------------------------------------------------------------

def load_report(run_dir: Path | str) -> RunRecord:
    """The run's record (report.json of apply-fusion, results.json of bench), checked; anything else is a one-line
    user error."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise OptiqError(f"{run_dir} is not a directory")
    names = record.RECORD_FILES.values()
    path = next((run_dir / name for name in names if (run_dir / name).is_file()), None)
    if path is None:
        raise OptiqError(f"{run_dir} has no {' or '.join(names)} (is it an apply-fusion or bench run directory?)")
    return record.load(path)


def _rows(run: RunRecord, state: str, compiled: bool = False) -> dict[int, Row]:
    """One row per concurrency: the model's own rows (after: the fused model's), or torch.compile's peer rows."""
    rows = run.after if state == "after" else [r for r in run.before
                                               if r.variant in (run.mode, record.compile_variant(run.mode))]
    return {r.concurrency: r for r in rows if r.is_compile == compiled}


def time_to_optimized(run: RunRecord) -> tuple[float, float | None] | None:
    """Seconds from the loaded model to the optimized one serving (patch + gate + the after graphs' capture), and
    torch.compile's warm-up at the same concurrencies when it was measured: the wait a user trades for the speed."""
    if run.fusion is None or run.fusion.timings.capture_s is None:
        return None
    timings = run.fusion.timings
    compiled = [r.warmup_s for r in _rows(run, "before", compiled=True).values()]
    warmup = sum(compiled) if compiled and None not in compiled else None
    return timings.patch_s + timings.gate_s + timings.capture_s, warmup


def time_to_optimized_text(run: RunRecord) -> str | None:
    """``time_to_optimized`` as a reader takes it: against compile's warm-up where measured, and named no measure
    of anything on a smoke run (the interpreter's seconds)."""
    if (waits := time_to_optimized(run)) is None:
        return None
    optimized, warmup = waits
    text = f"{optimized:.1f} s (patch + gate + capture)"
    if warmup:
        text += f"; torch.compile's warm-up {warmup:.1f} s, {optimized / warmup:.2f}x of it"
    return f"{text} (not meaningful: smoke numbers)" if run.smoke else text


def _ok(row: Row | None, key: str):
    """A row's number, "oom" for a point that ran out of memory, None when not measured."""
    if row is None:
        return None
    return getattr(row, key) if row.status == "ok" else row.status


def _floor(concurrency: int, *row_maps: dict[int, Row]):
    """The bandwidth floor in tok/s, from the first run that measured this concurrency (it is the same for all)."""
    return next((rows[concurrency].floor_tok_per_s for rows in row_maps
                 if concurrency in rows and rows[concurrency].status == "ok"), None)


def _concurrencies(run: RunRecord) -> list[int]:
    measured = {c for state in ("before", "after") for compiled in (False, True)
                for c in _rows(run, state, compiled)}
    return sorted(set(run.concurrency) | measured)


def _ratio(num, den):
    return num / den if isinstance(num, (int, float)) and isinstance(den, (int, float)) and den else None


def _op_classes(attribution: dict, concurrency: int) -> dict[str, float]:
    table = attribution.get(str(concurrency), {}).get("table") or []
    return {row["label"]: row["gpu_ms_per_step"] for row in table}


def _kernels(attribution: dict, concurrency: int):
    return attribution.get(str(concurrency), {}).get("summary", {}).get("kernels_per_step")


def _fusion(run: RunRecord) -> Fusion:
    """The run's fusion, or an empty one for a run that measured without recipes."""
    return run.fusion or Fusion([])


# --- the numbers ---------------------------------------------------------------------------------------------------

def headline(run: RunRecord) -> list[dict]:
    """Per concurrency: before, after, torch.compile and floor tok/s (None: not measured, "oom": out of memory)."""
    before, after, compiled = _rows(run, "before"), _rows(run, "after"), _rows(run, "before", compiled=True)
    result = []
    for c in _concurrencies(run):
        b, a, t = _ok(before.get(c), "tok_per_s"), _ok(after.get(c), "tok_per_s"), _ok(compiled.get(c), "tok_per_s")
        result.append({"concurrency": c, "before_tok_per_s": b, "after_tok_per_s": a, "speedup": _ratio(a, b),
                       "compile_tok_per_s": t, "after_vs_compile": _ratio(a, t),
                       "floor_tok_per_s": _floor(c, before, after),
                       "after_pct_of_floor": _ok(after.get(c), "pct_of_floor")})
    return result


def savings(run: RunRecord) -> dict:
    """Predicted saving per applied recipe, and the applied set's measured saving, per concurrency.

    The recipes run together in one patched model, so only the set's saving is measured; per recipe there is only the
    profile's prediction (the time it covers, an upper bound).
    """
    before, after, fusion = _rows(run, "before"), _rows(run, "after"), _fusion(run)
    predicted = {recipe: {} for recipe in fusion.applied}
    measured_ms, kernels_removed = {}, {}
    for c in _concurrencies(run):
        for p in fusion.proposals.get(str(c)) or []:
            if p.recipe in predicted:
                predicted[p.recipe][c] = p.covered_ms_per_step
        b, a = _ok(before.get(c), "ms_per_step"), _ok(after.get(c), "ms_per_step")
        measured_ms[c] = b - a if isinstance(b, (int, float)) and isinstance(a, (int, float)) else None
        kb, ka = _kernels(run.attribution_before, c), _kernels(run.attribution_after, c)
        kernels_removed[c] = kb - ka if kb is not None and ka is not None else None
    return {"predicted_ms_per_step": predicted, "measured_ms_per_step": measured_ms,
            "kernels_removed_per_step": kernels_removed}


def _final_state(run: RunRecord) -> str:
    """What a run ended with: the patched model when it was re-measured, else the model as it was."""
    return "after" if _rows(run, "after") else "before"


def _attribution(run: RunRecord, state: str) -> dict:
    return run.attribution_after if state == "after" else run.attribution_before


def compare_runs(a: RunRecord, b: RunRecord) -> dict:
    """Run B against run A at every concurrency either measured: tok/s and GPU ms/step per op class."""
    state_a, state_b = _final_state(a), _final_state(b)
    rows_a, rows_b = _rows(a, state_a), _rows(b, state_b)
    concurrencies = sorted(set(_concurrencies(a)) | set(_concurrencies(b)))
    throughput, op_classes = [], []
    for c in concurrencies:
        ta, tb = _ok(rows_a.get(c), "tok_per_s"), _ok(rows_b.get(c), "tok_per_s")
        throughput.append({"concurrency": c, "tok_per_s_a": ta, "tok_per_s_b": tb, "ratio": _ratio(tb, ta),
                           "floor_tok_per_s": _floor(c, rows_a, rows_b)})
        ca, cb = _op_classes(_attribution(a, state_a), c), _op_classes(_attribution(b, state_b), c)
        for label in sorted(ca.keys() | cb.keys(), key=lambda k: -max(ca.get(k, 0), cb.get(k, 0))):
            # A class missing from a profiled step took no time there; without a profile it is unknown.
            ms_a, ms_b = ca.get(label, 0.0) if ca else None, cb.get(label, 0.0) if cb else None
            op_classes.append({"concurrency": c, "label": label, "gpu_ms_per_step_a": ms_a, "gpu_ms_per_step_b": ms_b,
                               "delta_ms": ms_b - ms_a if ca and cb else None})
    return {"state_a": state_a, "state_b": state_b, "throughput": throughput, "op_classes": op_classes}


# --- formatting ----------------------------------------------------------------------------------------------------

def _fmt(value, spec: str = ",.1f", suffix: str = "") -> str:
    """A table cell: numbers formatted, "oom" kept, not measured as a dash."""
    if isinstance(value, str):
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:{spec}}{suffix}"


def _c_label(concurrency: int) -> str:
    return f"C={concurrency}"


def _throughput_title(*runs: RunRecord) -> str:
    """The throughput table's title, which on a smoke run says what its numbers are before anyone reads them."""
    return "Decode throughput" + (": smoke numbers, not GPU speed" if any(r.smoke for r in runs) else "")


def headline_table(run: RunRecord) -> Table:
    """Throughput per concurrency; on a smoke run the speed-up is labelled not meaningful where it stands, so a
    0.03x of interpreted kernels is never read as a result."""
    def ratio(value, *spec):
        return RATIO_NOT_MEANINGFUL if run.smoke and value is not None else _fmt(value, *spec)

    rows = [[str(h["concurrency"]), _fmt(h["before_tok_per_s"]), _fmt(h["after_tok_per_s"]),
             ratio(h["speedup"], ".2f", "×"), _fmt(h["compile_tok_per_s"]), ratio(h["after_vs_compile"], ".2f", "×"),
             _fmt(h["floor_tok_per_s"]), ratio(h["after_pct_of_floor"])] for h in headline(run)]
    note = "speed-up = after / before; floor = the bytes a step must read over the copy bandwidth"
    if run.smoke:
        note = (f"{RATIO_NOT_MEANINGFUL} = {NOT_MEANINGFUL}: smoke numbers ({_smoke_cause(run)}), so the speed-up, "
                f"after / compile and % of floor say nothing; {note}")
    return Table(_throughput_title(run), ["C", "before tok/s", "after tok/s", "speed-up", "torch.compile tok/s",
                                          "after / compile", "floor tok/s", "after % of floor"], rows, note)


def gated_parameters(run: RunRecord) -> str:
    """What the per-recipe checks ran on: the model's own parameters, and a second pass with its constant ones
    redrawn where it had any."""
    constants = _fusion(run).gate.constant_parameters
    return f"own + {len(constants)} constant redrawn" if constants else "own (none constant)"


def gate_table(run: RunRecord) -> Table:
    """One row per recipe the run considered, with the gate's numbers where it ran."""
    fusion = _fusion(run)
    gate = fusion.gate.recipes
    rows = []
    for recipe in dict.fromkeys([*fusion.applied, *fusion.rolled_back, *gate, *fusion.not_applicable]):
        status = ("applied" if recipe in fusion.applied else "rolled back" if recipe in fusion.rolled_back
                  else "not applicable" if recipe in fusion.not_applicable else "not applied")
        g, mutation = gate.get(recipe), fusion.mutants.get(recipe)
        score = "—" if mutation is None or mutation.score is None else (
            f"{100 * mutation.score:.0f}% of {mutation.counted}")
        if g is None:
            rows.append([recipe, status, "", *["—"] * 5, score, "—", fusion.not_applicable.get(recipe, "")])
            continue
        rows.append([recipe, status, g.tolerance, _fmt(g.calls, "d"), _fmt(g.err_fused, ".2e"),
                     _fmt(g.err_unfused, ".2e"), _fmt(g.margin, ".2f"), _fmt(g.bound, ".2e"), score,
                     _fmt(g.seconds, ".1f"), g.reason or fusion.not_applicable.get(recipe, "")])
    return Table("Validation gate: per recipe", ["recipe", "status", "tolerance", "calls", "err fused",
                                                 "err unfused", "fused / unfused", "bound", "mutants killed", "s",
                                                 "reason"], rows,
                 f"err = relative error against a float64 run of the unfused path, at the worst call; fused / "
                 f"unfused = the largest ratio over all calls; parameters gated on: {gated_parameters(run)}; "
                 f"mutants killed: with --mutants")


def end_to_end_table(run: RunRecord) -> Table:
    rows = [[str(e.concurrency), str(e.steps), "passed" if e.passed else "failed", _fmt(e.rel_err, ".2e"),
             _fmt(e.rel_err_unpatched, ".2e"), _fmt(e.bound, ".2e"), _fmt(e.top1, ".3f"),
             _fmt(e.top1_unpatched, ".3f"), _fmt(e.min_top1, ".3f"), _fmt(e.seconds, ".1f"), ", ".join(e.recipes)]
            for e in _fusion(run).gate.end_to_end]
    return Table("Validation gate: end to end", ["C", "steps", "result", "logits rel err", "unpatched rel err",
                                                 "bound", "top-1", "unpatched top-1", "min top-1", "s", "recipes"], rows,
                 "teacher-forced greedy decode against a higher-precision reference")


def proposals_table(run: RunRecord) -> Table:
    proposals = _fusion(run).proposals
    rows = [[c, str(rank), p.recipe, _fmt(p.covered_ms_per_step, ".3f"), _fmt(p.covered_pct),
             _fmt(p.kernels_per_step, ".0f"), p.where]
            for c in sorted(proposals, key=int) for rank, p in enumerate(proposals[c], 1)]
    return Table("Proposals of the profile", ["C", "#", "recipe", "up to ms/step", "% of step", "kernels/step",
                                              "replaces"], rows,
                 "a proposal's saving is the time the recipe covers: an upper bound")


def savings_table(run: RunRecord) -> Table:
    s, concurrencies = savings(run), _concurrencies(run)
    predicted = s["predicted_ms_per_step"]
    rows = [[f"predicted: {recipe} (ms/step)", *[_fmt(covered.get(c), ".3f") for c in concurrencies]]
            for recipe, covered in predicted.items()]
    if len(predicted) > 1:
        rows.append(["predicted: applied set (ms/step)",
                     *[_fmt(sum(v[c] for v in predicted.values() if c in v) if any(c in v for v in predicted.values())
                           else None, ".3f") for c in concurrencies]])
    smoke = f"; {NOT_MEANINGFUL}: smoke numbers" if run.smoke else ""
    rows.append([f"measured: time saved (ms/step, before − after{smoke})",
                 *[_fmt(s["measured_ms_per_step"][c], ".3f") for c in concurrencies]])
    rows.append(["measured: kernels removed per step (profiled)",
                 *[_fmt(s["kernels_removed_per_step"][c], ",.0f") for c in concurrencies]])
    return Table("Savings: predicted per recipe, measured for the applied set", ["", *map(_c_label, concurrencies)],
                 rows, "the applied recipes run together in one model, so their measured savings are not separable: "
                       "the measured rows are the whole set's")


OUTSIDE_LAYERS = "(outside the layers)"  # the per-layer table's row of the step's time outside every layer


def depth_tables(run: RunRecord) -> list[Table]:
    """A truncated preset's whole model (``RunRecord.full_depth``): per profiled variant the mean time of a layer of
    each of the published model's kinds, then that model's step extrapolated from them; none for another model."""
    depth = run.full_depth
    if depth is None:
        return []
    unit = depth.time_unit or "profiled time"
    variants = list(dict.fromkeys(p.variant for p in depth.points))
    points = sorted(depth.points, key=lambda p: (variants.index(p.variant), p.concurrency))
    layers_note = "; ".join([
        f"layers = the preset's profiled layers of the kind, of {depth.published}'s {depth.layers}",
        *[f"{k.kind}: none of the {depth.measured_layers} profiled layers, its {k.layers} counted at {k.stand_in}'s "
          "time (the nearest by attention type)" for k in depth.kinds if k.stand_in]])
    tables = []
    for variant in variants:
        mine = [p for p in points if p.variant == variant]
        rows = [[k.kind, f"{k.measured} of {k.layers}",
                 *[_fmt(None if k.stand_in else p.ms_per_layer.get(k.kind), ".3f") for p in mine]]
                for k in depth.kinds]
        rows.append([OUTSIDE_LAYERS, "", *[_fmt(p.outside_ms, ".3f") for p in mine]])
        tables.append(Table(f"Per layer ({variant}): {unit}, ms per layer",
                            ["layer kind", "layers", *[_c_label(p.concurrency) for p in mine]], rows, layers_note))
    rows = [[p.variant, str(p.concurrency), _fmt(p.tok_per_s), _fmt(p.ms_per_step, ".3f"),
             _fmt(depth.floor_ms_per_step.get(str(p.concurrency)), ".3f"),
             RATIO_NOT_MEANINGFUL if run.smoke else _fmt(p.pct_of_floor), _fmt(p.scale, ".2f", "×")] for p in points]
    note = (f"an extrapolation from {depth.measured_layers} of {depth.layers} layers, not a measurement: ms/step = "
            f"(outside the layers + each kind's layers × its ms per layer) × scale, the timed step over its profile "
            f"({unit}); floor = {depth.published}'s bytes per step over the copy bandwidth")
    if run.smoke:
        note += f"; % of floor {NOT_MEANINGFUL}: smoke numbers"
    if depth.not_profiled:
        note += f"; not profiled, so not extrapolated: {', '.join(depth.not_profiled)}"
    tables.append(Table(f"Whole model: {depth.published}, {depth.layers} layers, extrapolated from "
                        f"{depth.measured_layers}", ["variant", "C", "tok/s", "ms/step", "floor ms", "% of floor",
                                                     "scale"], rows, note))
    return tables


def _series(rows: dict[int, Row], key: str) -> dict[int, float]:
    return {c: getattr(r, key) for c, r in rows.items() if r.status == "ok" and getattr(r, key) is not None}


def _throughput_plots(runs: list[tuple[str, dict[int, Row], str]], floor_name: str, reference: dict[int, Row],
                      smoke: bool) -> list[Lines]:
    """tok/s and ms/step against concurrency for each run, with the bandwidth floor of ``reference``; on a smoke run
    the titles say what the numbers are."""
    suffix = " (smoke numbers, not GPU speed)" if smoke else ""
    return [Lines(title + suffix, y_title, [(name, _series(rows, key), dash) for name, rows, dash in runs],
                  (floor_name, _series(reference, floor)))
            for title, y_title, key, floor in (
                ("Decode throughput against concurrency", "tok/s", "tok_per_s", "floor_tok_per_s"),
                ("Decode step time against concurrency", "ms/step", "ms_per_step", "floor_ms_per_step"))]


def _time_unit(attributions: list[dict]) -> str:
    """What the profiles timed: "GPU time" (kernels), "CPU self time" (ops, without a GPU), or both named when the
    runs compared differ; "profiled time" without a profile."""
    units = sorted({entry.get("summary", {}).get("time_unit") for attribution in attributions
                    for entry in attribution.values()} - {None})
    return " / ".join(units) or "profiled time"


STACK_NOTE = ("Bars: the profiled steps' {unit} summed by op class, from the profiler's own run. Diamonds: the timed "
              "step of the throughput table (its median repeat). They measure different things: the profile counts "
              "the ops or kernels alone, not the time between them, and adds the profiler's cost to each; on a CPU "
              "shared with other work the two runs also meet different loads.")


def _stack(states: list[tuple[str, dict, dict[int, Row]]], concurrencies: list[int]) -> Stack:
    """Op-class bars per concurrency and state (label, attribution, timed rows), titled by what was profiled, each
    beside its state's timed step."""
    unit = _time_unit([attribution for _, attribution, _ in states])
    bars = []
    for c in concurrencies:
        for label, attribution, rows in states:
            if classes := _op_classes(attribution, c):
                timed = _ok(rows.get(c), "ms_per_step")
                bars.append((_c_label(c), label, classes, timed if isinstance(timed, float) else None))
    return Stack(f"{unit} per decode step by op class (profiled), beside the timed step", bars,
                 STACK_NOTE.format(unit=unit))


def _describe(run: RunRecord) -> str:
    return f"{run.model} · {run.dtype} · {run.mode} · {run.environment.device}"


STATUS_NOTE = {"complete": "complete",
               "incomplete": "incomplete: interrupted, the numbers are those measured before the interruption",
               "rejected": "rejected: the validation gate rejected every recipe; the model was not re-measured",
               "failed": "failed: the numbers are those measured before the error"}


def _compiled_ahead(child: CompiledAhead) -> str:
    """One worker of compile_ahead: its engine, how it ended, when it was ready and how long it compiled."""
    batch, cache, _ = child.engine
    times = [f"{label} {value:.1f} s" for value, label in ((child.ready_s, "ready after"),
                                                            (child.sent_s, "names after")) if value is not None]
    if child.seconds is not None:
        times.append(f"compiled {child.seconds:.1f} s after the names")
    return f"C={batch} cache {cache} {child.status}" + (f" ({', '.join(times)})" if times else "")


def _smoke_cause(run: RunRecord) -> str:
    """Why a smoke run's timings say nothing about a GPU: the device, and Triton's interpreter where it ran."""
    where = "timed on the CPU" if run.environment.kind == "cpu" else f"timed on {run.environment.device}"
    return where + (", Triton's kernels interpreted" if run.environment.triton_interpreter else "")


def smoke_notice(run: RunRecord, verdict_at: str = "first below") -> str:
    """What a smoke run's report must say first (empty for a run whose timings mean what they say): its timings are
    not GPU speed, and what the run proves all the same, the gate's verdict (``verdict_at`` says where it is)."""
    if not run.smoke:
        return ""
    where = "on the CPU" if run.environment.kind == "cpu" else f"on {run.environment.device}"
    interpreted = (", with the fused Triton kernels running under Triton's interpreter (as Python on the host, far "
                   "slower than compiled code)" if run.environment.triton_interpreter and _fusion(run).applied
                   else "")
    text = (f"Smoke run: timed {where}{interpreted}, so the timings below say nothing about GPU speed: the "
            f"speed-up, the time saved and the share of the bandwidth floor are {NOT_MEANINGFUL}.")
    if run.fusion is None:
        return text + " What it shows: the model loads and decodes under optiq's engine."
    pipeline = ", and that the whole pipeline (profile, fuse, gate, re-measure, report) runs" if (
        run.status == "complete") else ""
    return (text + f" What it proves holds on any device: the validation gate's verdict ({verdict_at}), each fused "
            "kernel checked against a float64 run of the original path and the fused model's greedy decode, end to "
            f"end, against a higher-precision reference{pipeline}. For speed, run it on a CUDA GPU.")


def _end_to_end(e: EndToEndVerdict) -> str:
    """One end-to-end check in a line: where it ran, its result, and its numbers against their bounds."""
    numbers = (f"logits rel err {_fmt(e.rel_err, '.2e')} against bound {_fmt(e.bound, '.2e')}, top-1 "
               f"{_fmt(e.top1, '.3f')} against at least {_fmt(e.min_top1, '.3f')}")
    return f"{_c_label(e.concurrency)} {'passed' if e.passed else 'failed'} ({e.problem or numbers})"


def verdict(run: RunRecord) -> str:
    """The gate's verdict in one line: the recipes kept, those rolled back or not applicable with why, and the end-to-
    end checks; empty for a run that fused nothing."""
    if run.fusion is None:
        return ""
    fusion, gate = run.fusion, run.fusion.gate.recipes

    def why(recipe: str, reason: str) -> str:
        return f"{recipe} ({reason})" if reason else recipe
    parts = [f"kept {', '.join(fusion.applied) or 'none'}"]
    if fusion.rolled_back:
        parts.append("rolled back " + ", ".join(why(r, gate[r].reason if r in gate else "")
                                                  for r in fusion.rolled_back))
    if fusion.not_applicable:
        parts.append("not applicable " + ", ".join(why(r, reason) for r, reason in fusion.not_applicable.items()))
    checks = fusion.gate.end_to_end
    parts.append("end to end " + ("; ".join(map(_end_to_end, checks)) if checks else "not run"))
    return "; ".join(parts)


def _device(run: RunRecord) -> str:
    """The device, with how its kernels ran and the threads it was timed on where those qualify the numbers."""
    env = run.environment
    threads = sorted({r.threads for r in run.before + run.after if r.threads is not None})
    how = [*(["Triton's kernels interpreted"] if env.triton_interpreter else []),
           *([f"timed on {', '.join(map(str, threads))} torch thread{'' if threads == [1] else 's'}"]
             if threads else [])]
    return env.device + (f" ({'; '.join(how)})" if how else "")


def report_document(run: RunRecord) -> Document:
    """The report of one run. It leads with what its numbers mean (``smoke_notice``) and the gate's verdict, then the
    throughput: a speed-up is worth something only for a model that still computes the same function."""
    env, work, fusion = run.environment, run.workload, _fusion(run)
    versions = ", ".join(f"{k} {getattr(env, k)}" for k in ("torch", "transformers", "cuda", "python", "optiq")
                         if getattr(env, k))
    repeats = f"median of {work.repeats} repeats" + (", each its median step" if env.kind == "cpu" else "")
    facts = [("status", STATUS_NOTE.get(run.status, run.status)),
             *([("gate verdict", verdict(run))] if run.fusion is not None else []),
             ("device", _device(run)), ("versions", versions),
             ("workload", f"prompt {work.prompt_len} tokens, {work.new_tokens} new tokens, KV cache {work.max_len}, "
                          f"{repeats}"),
             ("recipes requested", ", ".join(fusion.requested) or "—"),
             ("applied", ", ".join(fusion.applied) or "none"),
             ("rolled back", ", ".join(fusion.rolled_back) or "none")]
    if run.fusion is not None:
        facts.append(("timings", ", ".join(f"{k.removesuffix('_s')} {_fmt(v, '.1f', ' s')}"
                                           for k, v in asdict(fusion.timings).items())))
    if fusion.gate.constant_parameters:
        names = fusion.gate.constant_parameters
        facts.append(("gated on constant parameters", f"{len(names)} of the model's parameters were one value "
                      f"throughout ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): a kernel that ignores "
                      "them computes the same function there, so the per-recipe checks ran a second pass with them "
                      "drawn anew"))
    if fusion.compile_ahead:
        facts.append(("kernels compiled ahead", "; ".join(map(_compiled_ahead, fusion.compile_ahead))))
    if (waited := time_to_optimized_text(run)) is not None:
        facts.append(("time to optimized", waited))
    before, after = _rows(run, "before"), _rows(run, "after")
    runs = [(f"before ({run.mode})", before, "solid"), (f"after ({run.mode})", after, "solid"),
            ("torch.compile", _rows(run, "before", compiled=True), "dash")]
    stack = _stack([("before", run.attribution_before, before), ("after", run.attribution_after, after)],
                   _concurrencies(run))
    gate = [gate_table(run), end_to_end_table(run)] if run.fusion is not None else []
    tables = [*gate, headline_table(run), *depth_tables(run), savings_table(run), proposals_table(run)]
    return Document(f"optiq {run.command}: {_describe(run)}", facts, tables,
                    [*_throughput_plots(runs, "bandwidth floor", before or after, run.smoke), stack],
                    smoke_notice(run), lead=len(gate) + 1)


def compare_document(a: RunRecord, b: RunRecord, name_a: str, name_b: str) -> Document:
    cmp = compare_runs(a, b)
    attributions = [_attribution(a, cmp["state_a"]), _attribution(b, cmp["state_b"])]
    throughput = Table(_throughput_title(a, b), ["C", "A tok/s", "B tok/s", "B / A"],
                       [[str(t["concurrency"]), _fmt(t["tok_per_s_a"]), _fmt(t["tok_per_s_b"]),
                         _fmt(t["ratio"], ".2f", "×")] for t in cmp["throughput"]])
    op_classes = Table(f"{_time_unit(attributions)}: ms/step by op class", ["C", "op class", "A ms/step",
                                                                            "B ms/step", "B − A"],
                       [[str(o["concurrency"]), o["label"], _fmt(o["gpu_ms_per_step_a"], ".3f"),
                         _fmt(o["gpu_ms_per_step_b"], ".3f"),
                         _fmt(o["delta_ms"], "+.3f")]
                        for o in cmp["op_classes"]], "from each run's profile of the state compared")
    facts = [(f"{side} ({name})", f"{_describe(run)} · {run.status} · applied: "
                                  f"{', '.join(_fusion(run).applied) or 'none'} · compared "
                                  f"{cmp[f'state_{side.lower()}']} patching")
             for side, name, run in (("A", name_a, a), ("B", name_b, b))]
    rows_a, rows_b = _rows(a, cmp["state_a"]), _rows(b, cmp["state_b"])
    concurrencies = [t["concurrency"] for t in cmp["throughput"]]
    stack = _stack([("A", attributions[0], rows_a), ("B", attributions[1], rows_b)], concurrencies)
    notices = [f"{side}: {notice}" for side, run in (("A", a), ("B", b))
               if (notice := smoke_notice(run, "in its own report"))]
    return Document(f"optiq: {name_b} (B) against {name_a} (A)", facts, [throughput, op_classes],
                    [*_throughput_plots([(f"A: {name_a}", rows_a, "solid"), (f"B: {name_b}", rows_b, "solid")],
                                        f"bandwidth floor ({'A' if rows_a else 'B'})", rows_a or rows_b,
                                        a.smoke or b.smoke), stack],
                    " ".join(notices), lead=1)


# --- rendering -----------------------------------------------------------------------------------------------------

# What Markdown would read as syntax inside a line: a table's cell end, raw HTML, a link or image, code, emphasis,
# and the backslash that escapes them all. Underscores stay: inside a word (triton_poi_fused_add_0) they emphasise
# nothing.
_MD_SYNTAX = {ord(c): f"\\{c}" for c in "\\|<[]`*"}


def _md(text: str) -> str:
    """``text`` (a name, a reason, a path) as one line of Markdown that renders as itself: control characters and
    newlines shown as escapes, syntax escaped with backslashes."""
    return visible(text, limit=None).translate(_MD_SYNTAX)


def render_markdown(doc: Document) -> str:
    lines = [f"# {_md(doc.title)}", ""] + ([f"> **{_md(doc.notice)}**", ""] if doc.notice else [])
    lines += [f"- **{_md(k)}**: {_md(v)}" for k, v in doc.facts]
    for table in doc.tables:
        lines += ["", f"## {_md(table.title)}", ""]
        if not table.rows:
            lines.append("(none)")
            continue
        lines += ["| " + " | ".join(map(_md, table.columns)) + " |", "|" + "---|" * len(table.columns)]
        lines += ["| " + " | ".join(map(_md, row)) + " |" for row in table.rows]
        if table.note:
            lines += ["", f"*{_md(table.note)}*"]
    return "\n".join(lines) + "\n"


PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf"]  # the lines of the runs and states, in their order
FLOOR_COLOUR = "#555555"
# One colour per op class (optiq.traces.op_classes.CLASSES and UNATTRIBUTED) on every page, whatever else a plot
# holds: a class keeps its colour between report.html and compare.html, and between runs. Greys are kept for "other"
# and the rest; a label outside the classes (a user's) is hashed into the same colours.
OP_CLASS_COLOURS = {
    "gemm": "#1f77b4", "attention": "#ff7f0e", "copy_": "#2ca02c", "elementwise": "#d62728", "mul": "#9467bd",
    "add": "#8c564b", "reduction": "#e377c2", "norm": "#bcbd22", "rope": "#17becf", "activation": "#aec7e8",
    "bmm": "#ffbb78", "grouped_gemm": "#98df8a", "routing": "#ff9896", "scatter_gather": "#c5b0d5",
    "sampling": "#c49c94", "clamp_min": "#f7b6d2", "memcpy/memset": "#dbdb8d", "unattributed": "#9edae5",
    "collective": "#393b79", "other": "#7f7f7f", REST: "#c7c7c7"}
# For a label with no colour of its own (a trace's kernel or role names): darker shades no class above uses, so it is
# never drawn in a listed class's colour beside it
_HASHED = ["#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39", "#ad494a", "#a55194",
           "#6b6ecf", "#b5cf6b", "#e7ba52", "#d6616b", "#ce6dbd"]


def op_class_colour(label: str) -> str:
    """The colour of op class ``label`` on every page: its own, or one of _HASHED picked by the label's CRC (the
    same in every process, unlike ``hash``)."""
    return OP_CLASS_COLOURS.get(label) or _HASHED[zlib.crc32(label.encode()) % len(_HASHED)]


def _number(value: float) -> str:
    """A value named in a sentence: grouped digits from 100 on, three significant ones below."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _plot_text(text: str) -> str:
    """A legend entry or title for plotly.js, which reads tags (<b>, <br>, <a href>) and entities in them: escaped,
    a name such as ``gemm<float, 128>`` shows as itself."""
    return html.escape(visible(text))


def _figure(plot: Lines | Stack):
    import plotly.graph_objects as go

    fig = go.Figure()
    if isinstance(plot, Lines):
        y_range, off_axis = plot.y_range()
        floor_name, floor = plot.floor
        lines = [(name, values, {"dash": dash, "color": PALETTE[i % len(PALETTE)]})
                 for i, (name, values, dash) in enumerate(plot.series) if values]  # a peer not measured: no legend
        if floor and not off_axis:
            lines.append((floor_name, floor, {"dash": "dot", "color": FLOOR_COLOUR}))
        for name, values, line in lines:
            xs = sorted(values)
            fig.add_trace(go.Scatter(x=xs, y=[values[c] for c in xs], name=_plot_text(name), mode="lines+markers",
                                     line=line))
        if off_axis:
            fig.add_annotation(text=_plot_text(off_axis), xref="paper", yref="paper", x=0, y=1, xanchor="left",
                               yanchor="bottom", showarrow=False, font={"color": FLOOR_COLOUR})
        ticks = sorted({c for _, values, _ in plot.series for c in values})
        fig.update_xaxes(type="log", title="concurrency", tickvals=ticks, ticktext=[str(c) for c in ticks])
        fig.update_yaxes(type="log", title=plot.y_title, range=list(y_range))
    else:
        totals: dict[str, float] = {}
        for _, _, classes, _ in plot.bars:
            for label, ms in classes.items():
                totals[label] = totals.get(label, 0.0) + ms
        shown = sorted(totals, key=totals.get, reverse=True)[:STACK_CLASSES]
        x = [[c for c, *_ in plot.bars], [state for _, state, *_ in plot.bars]]
        for label in [*shown, REST] if len(totals) > len(shown) else shown:
            y = [sum(ms for k, ms in classes.items() if k not in shown) if label == REST else classes.get(label, 0.0)
                 for _, _, classes, _ in plot.bars]
            fig.add_trace(go.Bar(x=x, y=y, name=_plot_text(label), marker_color=op_class_colour(label)))
        timed = [ms for *_, ms in plot.bars]
        if any(ms is not None for ms in timed):
            fig.add_trace(go.Scatter(x=x, y=timed, name="timed step (throughput table)", mode="markers",
                                     marker={"symbol": "diamond", "size": 11, "color": "#222222"}))
        fig.update_layout(barmode="stack")
        fig.update_yaxes(title="ms/step")
    fig.update_layout(title=_plot_text(plot.title), template="plotly_white", height=460, margin={"t": 80})
    return fig


CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0}th,td{border:1px solid #ccc;padding:.25em .6em;font-size:.9em}
th{background:#f3f3f3}td{font-variant-numeric:tabular-nums}.note{color:#666;font-size:.85em}
.notice{border-left:4px solid #d62728;background:#fff4f4;padding:.6em 1em;font-weight:600}"""


def render_html(doc: Document) -> str:
    """One self-contained page: plotly.js is inlined once and nothing is loaded from the network.

    Raises ImportError when plotly is not installed.
    """
    import plotly.io as pio

    def esc(text: str) -> str:  # control characters shown as escapes there too
        return html.escape(visible(text, limit=None))

    def table_html(table: Table) -> list[str]:
        if not table.rows:
            return [f"<h2>{esc(table.title)}</h2>", "<p>(none)</p>"]
        return [f"<h2>{esc(table.title)}</h2>",
                "<table><tr>" + "".join(f"<th>{esc(c)}</th>" for c in table.columns) + "</tr>",
                *["<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in table.rows],
                "</table>" + (f"<p class=note>{esc(table.note)}</p>" if table.note else "")]

    parts = [f"<h1>{esc(doc.title)}</h1>", *([f"<p class=notice>{esc(doc.notice)}</p>"] if doc.notice else []),
             "<ul>", *[f"<li><b>{esc(k)}</b>: {esc(v)}</li>" for k, v in doc.facts], "</ul>"]
    for table in doc.tables[:doc.lead]:
        parts += table_html(table)
    for i, plot in enumerate(p for p in doc.plots if not p.empty):
        parts.append(pio.to_html(_figure(plot), include_plotlyjs=i == 0, full_html=False, include_mathjax=False,
                                 config={"displaylogo": False}))
        if isinstance(plot, Stack) and plot.note:
            parts.append(f"<p class=note>{esc(plot.note)}</p>")
    for table in doc.tables[doc.lead:]:
        parts += table_html(table)
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{esc(doc.title)}</title>'
            f"<style>{CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")


class Written(NamedTuple):
    paths: list[Path]
    note: str | None  # one line for the user when the HTML was skipped


def write_document(directory: Path | str, stem: str, doc: Document) -> Written:
    """Write ``stem.md`` and ``stem.html``; without plotly only the Markdown, and the note says why."""
    directory = Path(directory)
    write_atomic(directory / f"{stem}.md", render_markdown(doc))
    try:
        page = render_html(doc)
    except ImportError:
        return Written([directory / f"{stem}.md"],
                       f"plotly is not installed: {stem}.md written, {stem}.html skipped")
    write_atomic(directory / f"{stem}.html", page)
    return Written([directory / f"{stem}.md", directory / f"{stem}.html"], None)


def write_report(run_dir: Path | str, run: RunRecord | None = None) -> Written:
    """Render ``report.md`` and ``report.html`` next to the run's record (read from disk when not given)."""
    return write_document(run_dir, "report", report_document(run if run is not None else load_report(run_dir)))
