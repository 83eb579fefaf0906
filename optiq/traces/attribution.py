"""Attribution: from kernel tables to where each step's GPU time goes, per op class, role, kernel or layer.

Every number is per decode step, so traces of different lengths and ranks compare: a rank's kernels weigh
1 / (its number of steps). What a step holds differs (``Trace.step_definition``): optiq's own steps hold the forward
and its sampling, the engines' only the forward, with sampling and drafting after it. The table counts the kernels of
the step phase; the engines' sampling and drafting are summed apart (``attribute(..., phases=WORK_PHASES)`` adds them
in, so that an engine's trace compares like for like with optiq's). The share of GPU time placed by each method
(linkage to the launching op, alignment of a graph replay with an eager step, the kernel's name, or nothing) is always
reported, and time that nothing placed stays "unattributed": it is never shown as an op.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from functools import wraps
from pathlib import Path

import numpy as np
import pandas as pd

from optiq.errors import OptiqError
from optiq.traces.op_classes import short_kernel_name
from optiq.traces.reader import WORK_PHASES, Trace

METHODS = ("linkage", "alignment", "name", "none", "cpu_op")
GROUPINGS = {"class": "op_class", "role": "role", "kernel": "name", "layer": "layer"}
NO_ROLE = "(no role)"
NO_LAYER = "(no layer)"
_INHERITED = ("op", "top_op", "op_class", "role", "layer")  # what a graph kernel takes from its eager twin


@dataclass
class Attribution:
    """The attribution of one rank, or of several ranks together."""

    by: str
    table: pd.DataFrame  # one row per class/role/kernel/layer; see attribution_table
    steps: pd.DataFrame  # one row per (rank, step); see step_stats
    methods: dict[str, float]  # share of in-step GPU time placed by each method
    summary: dict  # per-step means and the share of GPU time outside every step
    notes: list[str] = field(default_factory=list)


def _out_of_memory_is_one_line(what: str):
    """Turn a MemoryError (numpy's or Python's, on a trace the reader let through but the tables cannot hold) into
    the one-line error every command prints."""
    def wrap(function):
        @wraps(function)
        def guarded(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except MemoryError:
                raise OptiqError(f"out of memory {what} (fewer or smaller traces would fit)") from None
        return guarded
    return wrap


@_out_of_memory_is_one_line("aligning the graph trace with its eager companion")
def align_graph_with_eager(graph: Trace, eager: Trace) -> int:
    """Align a graph trace's replayed kernels with an eager trace (``_align``) and note on the graph trace how many
    were; returns that count."""
    aligned = _align(graph, eager)
    graph.notes.append(f"{aligned} of {int(graph.kernels['graph'].sum())} replayed kernels aligned with "
                       f"{Path(eager.path).name}")
    return aligned


def _align(graph: Trace, eager: Trace) -> int:
    """Give CUDA-graph kernels the op, class, role and layer of their twins in an eager step of the same model and
    batch: the replay runs the same kernels in the same order. The eager reference is its most frequent step
    sequence; sequences are matched by kernel name (``_in_order_pairs``), so a kernel the graph added or dropped just
    stays unmatched. Returns how many kernels were aligned; they are marked with method "alignment"."""
    reference = _reference_step(eager.kernels)
    if reference is None:
        return 0
    ref_names = list(reference["name"].astype(object))
    ref_linked = (reference["method"] == "linkage").to_numpy()
    graph_rows = graph.kernels[graph.kernels["graph"] & (graph.kernels["step"] >= 0)].sort_values(["step", "ts"])
    targets, twins = [], []
    for sequence, rows in _sequences(graph_rows).items():
        mine, theirs = _in_order_pairs(sequence, ref_names)
        keep = ref_linked[theirs]
        mine, theirs = mine[keep], theirs[keep]
        targets.append(rows[:, mine].ravel())
        twins.append(np.tile(theirs, len(rows)))
    targets = np.concatenate(targets) if targets else np.array([], np.int64)
    if not len(targets):
        return 0
    twins = np.concatenate(twins)
    table = graph.kernels
    for col in _INHERITED:
        values = reference[col].to_numpy()[twins]
        if col in ("op", "top_op"):
            new = {v for v in values if isinstance(v, str)} - set(table[col].cat.categories)
            table[col] = table[col].cat.add_categories(sorted(new))
        table.loc[targets, col] = values
    table.loc[targets, "method"] = "alignment"
    return len(targets)


def _in_order_pairs(a: tuple, b: list, window: int = 16, confirm: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Positions (i in ``a``, j in ``b``) of equal names, increasing in both: a walk along both that, where they
    differ, resumes at the nearest equal pair ahead, preferring one the next ``confirm`` names agree with. The
    candidates are the next occurrence in ``b`` of each of ``a``'s next ``window`` names, and the other way round,
    so the walk costs O(window log n) a difference and a step of identical sequences costs one comparison a kernel,
    where difflib's longest-block search is quadratic in the step's length."""
    where_a, where_b = _positions(a), _positions(b)
    pairs_a, pairs_b = [], []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            pairs_a.append(i)
            pairs_b.append(j)
            i += 1
            j += 1
            continue
        candidates = [(x, _next(where_b, a[i + x], j) - j) for x in range(min(window, len(a) - i))]
        candidates += [(_next(where_a, b[j + y], i) - i, y) for y in range(min(window, len(b) - j))]
        best = None
        for x, y in candidates:
            if x < 0 or y < 0:
                continue
            span = min(confirm, len(a) - i - x, len(b) - j - y)
            agreed = next((k for k in range(span) if a[i + x + k] != b[j + y + k]), span) == span
            key = (not agreed, x + y)
            if best is None or key < best[0]:
                best = (key, x, y)
        if best is None:  # nothing in the window recurs on the other side: both kernels differ
            i, j = i + 1, j + 1
        else:
            i, j = i + best[1], j + best[2]
    return np.array(pairs_a, np.int64), np.array(pairs_b, np.int64)


def _positions(names) -> dict:
    where: dict = {}
    for position, name in enumerate(names):
        where.setdefault(name, []).append(position)
    return where


def _next(where: dict, name, start: int) -> int:
    """The first position of ``name`` at or after ``start``, or -1 when there is none."""
    found = where.get(name)
    if found:
        k = bisect_left(found, start)
        if k < len(found):
            return found[k]
    return -1


def _reference_step(kernels: pd.DataFrame) -> pd.DataFrame | None:
    """The eager step whose kernel sequence occurs most often (the first step may carry one-time work)."""
    in_steps = kernels[(kernels["step"] >= 0) & ~kernels["graph"]].sort_values(["step", "ts"])
    if in_steps.empty:
        return None
    bounds = _step_bounds(in_steps)
    names = in_steps["name"].astype(object).to_numpy()
    keys = [tuple(names[lo:hi]) for lo, hi in bounds]
    best = Counter(keys).most_common(1)[0][0]
    lo, hi = bounds[keys.index(best)]
    return in_steps.iloc[lo:hi]


def _step_bounds(rows: pd.DataFrame) -> list[tuple[int, int]]:
    """(first, end) positions of each step's rows in ``rows``, sorted by step: one pass, however many steps."""
    cuts = (np.flatnonzero(np.diff(rows["step"].to_numpy())) + 1).tolist()
    return list(zip([0, *cuts], [*cuts, len(rows)]))


def _sequences(rows: pd.DataFrame) -> dict[tuple, np.ndarray]:
    """Distinct kernel-name sequences of the steps in ``rows`` (sorted by step), each with its row labels as
    [steps, position]."""
    names, labels = rows["name"].astype(object).to_numpy(), rows.index.to_numpy()
    found: dict[tuple, list] = {}
    for lo, hi in _step_bounds(rows) if len(rows) else []:
        found.setdefault(tuple(names[lo:hi]), []).append(labels[lo:hi])
    return {seq: np.stack(indexes) for seq, indexes in found.items()}


def step_stats(trace: Trace) -> pd.DataFrame:
    """Per step: wall time, GPU busy time (union of kernel intervals within the wall time), summed kernel time, idle
    fraction (1 - busy / wall: the launch gaps), kernels, launches.

    A step's wall time runs from when both the host has begun it and the GPU has finished the work queued before it,
    to the later of its host end and its last kernel's end. For CPU-bound eager steps that is the host's range; for
    steps the host only enqueues (graph replays run ahead of the GPU) it is the GPU's time on the step, queueing
    excluded. A CPU-only trace has no queue: its wall time is the step's range, and its busy time the ops' self time
    (several threads at once can fill more than the wall time: idle is then 0, never negative).

    Vectorised over steps (a trace may hold a million): each kernel is placed by its step's row, and per-step
    sums, extremes and interval unions are taken with bincount and one sort."""
    steps = trace.steps
    n = len(steps)
    kernels = trace.kernels[trace.kernels["step"] >= 0]
    step_ids = steps["step"].to_numpy(np.int64)
    by_id = np.argsort(step_ids, kind="stable")
    k_step = kernels["step"].to_numpy(np.int64)
    found = np.minimum(np.searchsorted(step_ids[by_id], k_step), max(n - 1, 0))
    known = (step_ids[by_id][found] == k_step) if n else np.zeros(len(k_step), bool)
    row = by_id[found][known]  # each kernel's row in ``steps``
    ts, dur = kernels["ts"].to_numpy(float)[known], kernels["dur"].to_numpy(float)[known]
    count = np.bincount(row, minlength=n)
    kernel_us = np.bincount(row, weights=dur, minlength=n)
    last_end, first_ts = np.full(n, -np.inf), np.full(n, np.inf)
    np.maximum.at(last_end, row, ts + dur)
    np.minimum.at(first_ts, row, ts)
    end = np.maximum(steps["end"].to_numpy(float), last_end)
    start = steps["start"].to_numpy(float)
    if trace.cpu_only:
        busy = kernel_us
    else:
        # When the GPU finished everything that started before a given time (in a step or not, e.g. warm-up work).
        all_ts = np.sort(trace.kernels["ts"].to_numpy(float), kind="stable")
        order = np.argsort(trace.kernels["ts"].to_numpy(float), kind="stable")
        done_by = np.maximum.accumulate((trace.kernels["ts"] + trace.kernels["dur"]).to_numpy(float)[order]) \
            if len(order) else np.array([])
        before = np.searchsorted(all_ts, first_ts, side="left")
        gpu_free = np.where((count > 0) & (before > 0), done_by[np.maximum(before - 1, 0)] if len(done_by) else 0,
                            -np.inf)
        start = np.maximum(start, gpu_free)
        busy = _busy_per_group(row, ts, dur, start[row], n)
    wall = np.maximum(end - start, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        idle = np.where(wall > 0, np.maximum(1 - busy / wall, 0.0), 0.0)
    return pd.DataFrame({"rank": trace.rank, "step": step_ids, "marker": steps["name"].to_numpy(object),
                         "wall_us": wall, "busy_us": busy, "kernel_us": kernel_us, "idle_frac": idle,
                         "kernels": count, "launches": steps["launches"].to_numpy(np.int64)},
                        columns=["rank", "step", "marker", "wall_us", "busy_us", "kernel_us", "idle_frac", "kernels",
                                 "launches"])


def _busy_per_group(group: np.ndarray, ts: np.ndarray, dur: np.ndarray, start: np.ndarray, groups: int) -> np.ndarray:
    """Per group, the length of the union of its intervals from the group's ``start`` on (a kernel another stream
    began earlier counts only its part after it): time on several streams at once counts once. Computed as the summed
    durations less each interval's overlap with those before it, so that without overlap it is exactly their sum
    (timestamps near 5e12 us would lose the nanoseconds in end - start)."""
    early = ts < start
    ts, dur = np.where(early, start, ts), np.where(early, np.clip(ts + dur - start, 0, None), dur)
    order = np.lexsort((ts, group))
    group, ts, dur = group[order], ts[order], dur[order]
    reach = pd.Series(ts + dur).groupby(group).cummax().to_numpy()
    same = np.r_[False, group[1:] == group[:-1]]
    before = np.where(same, np.r_[-np.inf, reach[:-1]], -np.inf)
    overlap = np.clip(np.minimum(ts + dur, before) - ts, 0, None)
    return np.bincount(group, weights=dur, minlength=groups) - np.bincount(group, weights=overlap, minlength=groups)


def weighted_kernels(traces: list[Trace], phases: tuple[str, ...] = ("step",)) -> pd.DataFrame:
    """The kernels of the given phases (``PHASES``) of all traces, each with weight 1 / (its trace's step count)."""
    parts = []
    for trace in traces:
        k = trace.kernels[trace.kernels["phase"].isin(phases)]
        parts.append(pd.DataFrame({
            "rank": trace.rank, "name": k["name"].astype(object), "dur": k["dur"], "op_class": k["op_class"],
            "role": k["role"].fillna(NO_ROLE), "layer": k["layer"].where(k["layer"] >= 0, -1),
            "top_op": k["top_op"].astype(object), "op": k["op"].astype(object), "method": k["method"],
            "w": 1.0 / max(len(trace.steps), 1)}))
    return pd.concat(parts, ignore_index=True)


def _shares(frame: pd.DataFrame, column: str, top: int, label=lambda v: str(v)) -> str:
    """The ``top`` values of ``column`` by weighted time, with their share: "attention 80%, mlp 20%"."""
    time = (frame["dur"] * frame["w"]).groupby(frame[column], dropna=False).sum().sort_values(ascending=False)
    total = time.sum()
    return ", ".join(f"{label(v)} {100 * t / total:.0f}%" for v, t in time.head(top).items() if total > 0)


def _where(frame: pd.DataFrame, by: str, top: int) -> str:
    """Where a group's time is: its roles and the top-level ops under them for a class or kernel; its classes for a
    role or layer."""
    if by in ("role", "layer"):
        return _shares(frame, "op_class", top)
    role = frame["role"].where(frame["role"] != NO_ROLE, "")
    top_level = frame["top_op"].astype(object)
    # Not "Torch-Compiled Region": the aten op under it says more.
    op = top_level.where(top_level.str.startswith("aten::", na=False), frame["op"]).fillna("")
    place = (role + ": " + op).str.strip(": ")
    known = place != ""
    return _shares(frame[known].assign(place=place[known]), "place", top) if known.any() else "unknown"


def attribution_table(frame: pd.DataFrame, by: str = "class", top: int = 3) -> pd.DataFrame:
    """Rows of ``by`` (class, role, kernel, layer), largest first: GPU ms per step, % of GPU time, kernels per step,
    mean us per kernel, the top kernels and where the time is."""
    column = GROUPINGS[by]
    weighted_time = frame["dur"] * frame["w"]
    total = weighted_time.sum()
    rows = []
    for key, group in frame.groupby(column, sort=False):
        time = (group["dur"] * group["w"]).sum()
        label = short_kernel_name(key) if by == "kernel" else NO_LAYER if by == "layer" and key < 0 else key
        rows.append({
            by: label if by != "kernel" else key, "label": label, "gpu_ms_per_step": time / 1000,
            "pct": 100 * time / total if total > 0 else 0.0, "kernels_per_step": group["w"].sum(),
            "mean_us": group["dur"].mean(),
            "top_kernels": "" if by == "kernel" else _shares(group, "name", top, short_kernel_name),
            "where": _where(group, by, top)})
    table = pd.DataFrame(rows, columns=[by, "label", "gpu_ms_per_step", "pct", "kernels_per_step", "mean_us",
                                        "top_kernels", "where"])
    return table.sort_values("gpu_ms_per_step", ascending=False, ignore_index=True)


def _per_step(trace: Trace, rows: pd.Series) -> float:
    """The GPU time (us) of the kernels picked by ``rows``, per step of ``trace``."""
    return float(trace.kernels.loc[rows, "dur"].sum()) / max(len(trace.steps), 1)


def collectives(traces: list[Trace]) -> dict:
    """Collective kernels (NCCL, custom all-reduce) in the step, per rank: ms per step, their share of the rank's
    step GPU time, and the skew across ranks (slowest less fastest rank, in ms per step). A rank that waits on a
    slower one spends the difference in its collective, so the skew says how uneven the ranks are."""
    per_rank, share = {}, {}
    for trace in traces:
        in_step = trace.kernels["phase"] == "step"
        mine = _per_step(trace, in_step & (trace.kernels["op_class"] == "collective"))
        total = _per_step(trace, in_step)
        # keyed by the rank as text, as JSON writes it: a run record that keeps the summary reads back the same
        per_rank[str(trace.rank)], share[str(trace.rank)] = mine / 1000, mine / total if total > 0 else 0.0
    values = list(per_rank.values())
    all_time = sum(_per_step(t, t.kernels["phase"] == "step") for t in traces)
    return {"ms_per_step": per_rank, "share_by_rank": share,
            "share": 1000 * sum(values) / all_time if all_time > 0 else 0.0,
            "skew_ms": max(values) - min(values) if values else 0.0}


@_out_of_memory_is_one_line("attributing the traces")
def attribute(traces: list[Trace], by: str = "class", top: int = 3, phases: tuple[str, ...] = ("step",)) -> Attribution:
    """The attribution of one trace, or of several (one per rank) taken together, counting the kernels of
    ``phases``."""
    if by not in GROUPINGS:
        raise ValueError(f"by must be one of {', '.join(GROUPINGS)}, not {by!r}")
    frame = weighted_kernels(traces, phases)
    steps = pd.concat([step_stats(t) for t in traces], ignore_index=True)
    time = frame["dur"] * frame["w"]
    total = time.sum()
    methods = {m: float(time[frame["method"] == m].sum() / total) if total > 0 else 0.0 for m in METHODS}
    all_time = sum(float(t.kernels["dur"].sum()) for t in traces)
    outside = sum(float(t.kernels.loc[~t.kernels["phase"].isin(WORK_PHASES), "dur"].sum()) for t in traces)
    apart = {phase: sum(_per_step(t, t.kernels["phase"] == phase) for t in traces) / 1000
             for phase in WORK_PHASES if phase not in phases}
    per_rank = steps.groupby("rank")[["wall_us", "busy_us", "kernel_us", "kernels", "launches"]].mean()
    summary = {
        "ranks": len({t.rank for t in traces}), "steps": int(sum(len(t.steps) for t in traces)),
        "step_definition": "; ".join(dict.fromkeys(t.step_definition for t in traces)),
        "counted_phases": list(phases), "outside_step_ms_per_step": apart, "collectives": collectives(traces),
        "gpu_ms_per_step": float(per_rank["kernel_us"].sum() / 1000),
        "busy_ms_per_step": float(per_rank["busy_us"].sum() / 1000),
        "wall_ms_per_step": float(per_rank["wall_us"].mean() / 1000),
        "idle_frac": float(steps["idle_frac"].mean()) if len(steps) else 0.0,
        "kernels_per_step": float(per_rank["kernels"].sum()), "launches_per_step": float(per_rank["launches"].sum()),
        "outside_steps_frac": outside / all_time if all_time > 0 else 0.0,
        "time_unit": "CPU self time" if all(t.cpu_only for t in traces) else "GPU time",
    }
    notes = [note for t in traces for note in t.notes]
    if any(apart.values()):
        notes.append(" and ".join(f"{'drafting' if p == 'draft' else p} {ms:.3f} ms/step" for p, ms in apart.items()
                                  if ms) + " ran after the step's forward: shown apart, not in the table")
    if summary["outside_steps_frac"] > 0:
        notes.append(f"{100 * summary['outside_steps_frac']:.1f}% of the time lies outside every step (and its "
                     "sampling) and is left out of the table")
    if by == "role" and (frame["role"] == NO_ROLE).all():
        notes.append("no optiq/role annotations in this trace: every kernel is outside a role")
    return Attribution(by=by, table=attribution_table(frame, by, top), steps=steps, methods=methods,
                       summary=summary, notes=list(dict.fromkeys(notes)))


def attribution_document(attribution: Attribution, traces: list[Trace]) -> dict:
    """The attribution as one JSON document, as ``optiq analyze --json`` and ``optiq profile`` write it."""
    return {"by": attribution.by, "files": [t.path for t in traces], "ranks": [t.rank for t in traces],
            "step_source": sorted({t.step_source for t in traces}), "summary": attribution.summary,
            "methods": attribution.methods, "notes": attribution.notes,
            "table": attribution.table.to_dict(orient="records"),
            "steps": attribution.steps.to_dict(orient="records")}


def compare(before: Attribution, after: Attribution) -> pd.DataFrame:
    """What moved from ``before`` to ``after`` (same grouping): per row, ms per step and share on each side and the
    change, largest change first. A row only one side has counts 0 on the other."""
    if before.by != after.by:
        raise ValueError(f"both sides must be grouped alike, not by {before.by} and {after.by}")
    sides = [a.table[[a.by, "gpu_ms_per_step", "pct"]].astype({a.by: str}) for a in (before, after)]
    both = sides[0].merge(sides[1], on=before.by, how="outer", suffixes=("_before", "_after")).fillna(0.0)
    table = pd.DataFrame({
        before.by: both[before.by].to_numpy(),
        "before_ms_per_step": both["gpu_ms_per_step_before"].to_numpy(),
        "after_ms_per_step": both["gpu_ms_per_step_after"].to_numpy(),
        "before_pct": both["pct_before"].to_numpy(), "after_pct": both["pct_after"].to_numpy()})
    table["delta_ms_per_step"] = table["after_ms_per_step"] - table["before_ms_per_step"]
    table["delta_pct"] = table["after_pct"] - table["before_pct"]
    order = table["delta_ms_per_step"].abs().sort_values(ascending=False, kind="stable").index
    return table.loc[order].reset_index(drop=True)
