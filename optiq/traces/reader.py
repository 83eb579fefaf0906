"""Read a Kineto trace (torch.profiler, vLLM, SGLang; .json or .json.gz) into a kernel table, in one streaming pass.

Memory is bounded by the number of GPU activities and CPU ops, never by the file size: each event is parsed by ijson
(the yajl2_c backend when present), the few fields attribution needs go into typed arrays, and the event is dropped.
Events may come in any order, so linkage and enclosure are resolved after the pass, with numpy:

- launching op: the kernel's ``External id`` equals the innermost ``cpu_op``'s (never for CUDA-graph replays, whose
  kernels share one ``cudaGraphLaunch`` and have no op);
- launch: the ``cuda_runtime``/``cuda_driver`` event with the kernel's ``correlation``; its thread and time place the
  kernel inside the ``optiq/step``, ``optiq/layer`` and ``optiq/role`` record_function ranges around it
  (innermost wins; a kernel inside a layer but outside any role gets role "other");
- step: ``optiq/step/<n>`` ranges, else vLLM (``execute_context_..._generation_...``) or SGLang (``step[DECODE bs=N]``)
  markers, else the whole trace is one step (and the table says so).

A GPU activity's ``ts`` and ``dur`` are its own time: from the end of the activities before it on its stream, where
that is later than its start (a kernel launched with programmatic dependent launch starts waiting before its
predecessor ends). A trace without GPU activity (a CPU-only profile) gives a table of CPU ops with their self time
instead.
"""

from __future__ import annotations

import gzip
import re
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import ijson
import numpy as np
import pandas as pd

from optiq.errors import OptiqError
from optiq.traces.op_classes import UNATTRIBUTED, class_of_kernel, class_of_op, class_of_top_op

try:
    _ijson = ijson.get_backend("yajl2_c")
except ImportError:  # the pure-Python backend is ~10x slower but gives the same answer
    _ijson = ijson

STEP_PREFIX, LAYER_PREFIX, ROLE_PREFIX = "optiq/step/", "optiq/layer/", "optiq/role/"
VLLM_STEP = re.compile(r"execute_(?:\d+_)?context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
SGLANG_STEP = re.compile(r"step\[(\w+) bs=(\d+)")
GPU_KINDS = {"kernel": 0, "gpu_memcpy": 1, "gpu_memset": 2}
KIND_NAMES = ("kernel", "memcpy", "memset", "cpu_op")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
GRAPH_LAUNCH = "cudaGraphLaunch"


@dataclass
class Trace:
    """One file (one rank) read: its kernel table, its steps, and how the steps were found."""

    path: str
    rank: int
    kernels: pd.DataFrame  # one row per GPU activity (or CPU op when cpu_only); see _kernel_table
    steps: pd.DataFrame  # step, name, start, end, launches
    step_source: str  # "optiq", "vllm", "sglang" or "whole trace"
    cpu_only: bool = False
    notes: list[str] = field(default_factory=list)


class _Columns:
    """Typed, growable columns: 8 bytes a number instead of a Python object per event."""

    def __init__(self, **types: str):
        for name, code in types.items():
            setattr(self, name, array(code))

    def numpy(self, name: str) -> np.ndarray:
        return np.frombuffer(getattr(self, name), dtype=getattr(self, name).typecode) \
            if len(getattr(self, name)) else np.array([], dtype=getattr(self, name).typecode)


class _Scan:
    """What one pass over the events keeps."""

    def __init__(self):
        self.names: dict[str, int] = {}  # every kept name, interned to a code
        self.threads: dict[object, int] = {}  # string pids/tids -> integer codes
        self.gpu = _Columns(name="l", kind="b", ts="d", dur="d", device="l", stream="l", corr="q", ext="q")
        self.ops = _Columns(name="l", ts="d", dur="d", pid="l", tid="l", ext="q")
        self.launches = _Columns(name="l", ts="d", pid="l", tid="l", corr="q")
        self.marks: list[tuple[str, float, float, int, int]] = []  # name, ts, end, pid, tid
        self.events = 0
        self.no_duration = 0  # GPU events without a duration or with a negative one: left out


def _open(path: Path):
    raw = open(path, "rb")
    if raw.read(2) == b"\x1f\x8b":
        raw.seek(0)
        return gzip.GzipFile(fileobj=raw, mode="rb")
    raw.seek(0)
    return raw


def _is_marker(name: str) -> bool:
    return name.startswith("optiq/") or VLLM_STEP.search(name) is not None or SGLANG_STEP.match(name) is not None


def _scan(stream) -> _Scan:
    """The one pass. The loop body is the hot path of a 1 GB trace: local names, one dict lookup per name, and
    integer pids/tids stored as they are (only string ones go through the intern table)."""
    scan = _Scan()
    names, threads = scan.names, scan.threads
    g, o, la = scan.gpu, scan.ops, scan.launches
    g_name, g_kind, g_ts, g_dur = g.name.append, g.kind.append, g.ts.append, g.dur.append
    g_dev, g_stream, g_corr, g_ext = g.device.append, g.stream.append, g.corr.append, g.ext.append
    o_name, o_ts, o_dur, o_pid, o_tid, o_ext = o.name.append, o.ts.append, o.dur.append, o.pid.append, \
        o.tid.append, o.ext.append
    l_name, l_ts, l_pid, l_tid, l_corr = la.name.append, la.ts.append, la.pid.append, la.tid.append, la.corr.append
    marks = scan.marks
    op_codes: dict[str, int] = {}  # cpu_op name -> code, or -1 - code for a step/layer/role marker
    launch_codes: dict[str, int] = {}  # runtime call name -> code, or -1 when it launches nothing
    count = 0
    for ev in _ijson.items(stream, "traceEvents.item", use_float=True):
        count += 1
        cat = ev.get("cat")
        if cat == "cpu_op":
            name = ev["name"]
            code = op_codes.get(name)
            if code is None:
                _check_name(name)
                code = names.setdefault(name, len(names))
                code = op_codes[name] = -1 - code if _is_marker(name) else code
            pid, tid = _thread(ev, threads)
            ts, dur = ev["ts"], ev.get("dur", 0.0)
            if dur < 0:  # a clock that stepped back: the op took no time
                dur = 0.0
            if code < 0:  # old traces record record_function ranges as cpu_op
                marks.append((name, ts, ts + dur, pid, tid))
                code = -1 - code
            o_name(code)
            o_ts(ts)
            o_dur(dur)
            o_pid(pid)
            o_tid(tid)
            o_ext(ev["args"].get("External id", -1) if "args" in ev else -1)
        elif cat in GPU_KINDS:
            dur = ev.get("dur")
            if dur is None or dur < 0:  # a server that died mid-write, or a clock that stepped back: no usable time
                scan.no_duration += 1
                continue
            name = ev["name"]
            code = names.get(name)
            if code is None:
                _check_name(name)
                code = names[name] = len(names)
            args = ev.get("args") or {}
            g_name(code)
            g_kind(GPU_KINDS[cat])
            g_ts(ev["ts"])
            g_dur(dur)
            g_dev(args.get("device", -1))
            g_stream(args.get("stream", -1))
            g_corr(args.get("correlation", -1))
            g_ext(args.get("External id", -1))
        elif cat in RUNTIME_CATS:
            name = ev["name"]
            code = launch_codes.get(name)
            if code is None:
                _check_name(name)
                launches = any(word in name for word in ("Launch", "Memcpy", "Memset"))
                code = launch_codes[name] = names.setdefault(name, len(names)) if launches else -1
            if code < 0:
                continue
            pid, tid = _thread(ev, threads)
            l_name(code)
            l_ts(ev["ts"])
            l_pid(pid)
            l_tid(tid)
            l_corr(ev["args"].get("correlation", -1) if "args" in ev else -1)
        elif cat == "user_annotation":
            name = ev["name"]
            _check_name(name)
            if _is_marker(name):
                pid, tid = _thread(ev, threads)
                marks.append((name, ev["ts"], ev["ts"] + ev.get("dur", 0.0), pid, tid))
    scan.events = count
    return scan


def _check_name(name) -> None:
    """Names are interned and matched as text, so anything else (a number, a list) is malformed input."""
    if name.__class__ is not str:
        raise TypeError(f"name {repr(name)[:60]} is not a string")


def _thread(ev: dict, threads: dict) -> tuple[int, int]:
    """pid and tid as integers; a string one (some exporters name threads) gets a code far above any real id."""
    pid, tid = ev.get("pid", -1), ev.get("tid", -1)
    if pid.__class__ is not int:
        pid = threads.setdefault(pid, (1 << 30) + len(threads))
    if tid.__class__ is not int:
        tid = threads.setdefault(tid, (1 << 30) + len(threads))
    return pid, tid


def _has_trace_events(path: Path) -> bool:
    """Whether the top-level object has a ``traceEvents`` key (asked only when the pass found no event)."""
    with _open(path) as stream:
        for prefix, event, value in _ijson.parse(stream):
            if prefix == "" and event == "map_key" and value == "traceEvents":
                return True
    return False


def _rank_of(path: Path, fallback: int) -> int:
    """The rank a file belongs to: its ``distributedInfo`` (read from the head only), else vLLM's ``rank<N>`` or
    SGLang's ``TP-<N>`` in the file name, else its position on the command line."""
    try:
        with _open(path) as stream:
            head = stream.read(1 << 16).decode("utf-8", "replace")
    except (OSError, EOFError, zlib.error):
        head = ""
    found = re.search(r'"distributedInfo"\s*:\s*\{[^}]*?"rank"\s*:\s*(\d+)', head) or \
        re.search(r"(?:rank|TP-)[_-]?(\d+)", path.name)
    return int(found.group(1)) if found else fallback


def _thread_key(pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """One integer per (pid, tid): pids (below 2**31, string ones included) above the tid's low 32 bits."""
    return (np.asarray(pid, np.int64) << 32) | (np.asarray(tid, np.int64) & 0xFFFFFFFF)


def _parents(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Parent index of each interval in a nested family sorted by start (-1 for a root)."""
    parent = np.full(len(starts), -1, np.int64)
    stack: list[int] = []
    end_of = ends.tolist()
    for i, start in enumerate(starts.tolist()):
        while stack and end_of[stack[-1]] < start:
            stack.pop()
        parent[i] = stack[-1] if stack else -1
        stack.append(i)
    return parent


def _innermost(iv_key, iv_start, iv_end, pt_key, pt_time, nested: bool = True) -> np.ndarray:
    """For each point, the index of the innermost interval of the same key (thread) that contains it, else -1.

    Intervals of one key must nest, as record_function ranges and ops on one thread do. With ``nested=False`` only
    the outermost intervals are searched (no parent walk), which is what finding a launch's top-level op needs.
    """
    result = np.full(len(pt_time), -1, np.int64)
    if not len(iv_start) or not len(pt_time):
        return result
    order = np.lexsort((-iv_end, iv_start, iv_key))
    keys_sorted = iv_key[order]
    for key in np.intersect1d(np.unique(iv_key), np.unique(pt_key)):
        lo, hi = np.searchsorted(keys_sorted, key), np.searchsorted(keys_sorted, key, side="right")
        sel = order[lo:hi]
        starts, ends = iv_start[sel], iv_end[sel]
        if nested:
            parent = _parents(starts, ends)
        else:  # keep the roots: an interval is a root when it starts after every earlier one ended
            prior_end = np.maximum.accumulate(np.concatenate(([-np.inf], ends[:-1])))
            roots = starts >= prior_end
            sel, starts, ends = sel[roots], starts[roots], ends[roots]
            parent = np.full(len(sel), -1, np.int64)
        pts = np.flatnonzero(pt_key == key)
        t = pt_time[pts]
        idx = np.searchsorted(starts, t, side="right") - 1
        while True:
            outside = idx >= 0
            outside[outside] = ends[idx[outside]] < t[outside]
            if not outside.any():
                break
            idx[outside] = parent[idx[outside]]
        result[pts] = np.where(idx >= 0, sel[np.maximum(idx, 0)], -1)
    return result


def _lookup(keys: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Index into ``keys`` of each wanted value (first occurrence), or -1 where absent or negative."""
    if not len(keys):
        return np.full(len(wanted), -1, np.int64)
    order = np.argsort(keys, kind="stable")
    pos = np.minimum(np.searchsorted(keys[order], wanted), len(keys) - 1)
    found = (keys[order][pos] == wanted) & (wanted >= 0)
    return np.where(found, order[pos], -1)


def _steps(scan: _Scan) -> tuple[pd.DataFrame, str, list[str]]:
    """Step ranges, from optiq's own annotations first, then vLLM's or SGLang's markers (decode steps only).

    Steps are numbered in time order; the marker's own text stays in ``name`` (numbers in markers can repeat, e.g.
    one sweep per concurrency)."""
    notes: list[str] = []
    rows = sorted((ts, name, end, pid) for name, ts, end, pid, _ in scan.marks
                  if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit())
    rows = [(i, name, ts, end, pid) for i, (ts, name, end, pid) in enumerate(rows)]
    source = "optiq"
    if not rows:
        for source, pattern, is_decode in (
                ("vllm", VLLM_STEP, lambda m: m.group(1) == "0" and m.group(3) != "0"),
                ("sglang", SGLANG_STEP, lambda m: m.group(1).upper() == "DECODE")):
            found = [(name, ts, end, pid, pattern.search(name)) for name, ts, end, pid, _ in scan.marks]
            found = [f for f in found if f[4]]
            if found:
                decode = [f for f in found if is_decode(f[4])]
                if len(decode) < len(found):
                    notes.append(f"{len(found) - len(decode)} non-decode {source} step(s) (prefill/mixed) left out")
                rows = [(0, name, ts, end, pid) for name, ts, end, pid, _ in sorted(decode, key=lambda f: f[1])]
                rows = [(i, *row[1:]) for i, row in enumerate(rows)]
                break
    if not rows:
        source = "whole trace"
        notes.append("no step markers (optiq/step, vLLM, SGLang): the whole trace is treated as one step")
    return pd.DataFrame(rows, columns=["step", "name", "start", "end", "pid"]), source, notes


def _annotation_index(scan: _Scan, prefix: str) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """The ranges of one annotation kind: their labels (after the prefix), thread keys, starts and ends."""
    picked = [m for m in scan.marks if m[0].startswith(prefix)]
    labels = [m[0][len(prefix):] for m in picked]
    keys = _thread_key(np.array([m[3] for m in picked], np.int64), np.array([m[4] for m in picked], np.int64))
    return labels, keys, np.array([m[1] for m in picked], float), np.array([m[2] for m in picked], float)


def _place(scan: _Scan, steps: pd.DataFrame, pid, tid, ts) -> dict[str, np.ndarray]:
    """Step, layer and role of launch points (pid, tid, ts codes; ts NaN where the launch is unknown)."""
    known = ~np.isnan(ts)
    thread = np.where(known, _thread_key(pid, tid), -1)
    t = np.where(known, ts, -np.inf)
    if len(steps):
        idx = _innermost(steps["pid"].to_numpy(np.int64), steps["start"].to_numpy(float),
                         steps["end"].to_numpy(float), np.where(known, pid, -1), t, nested=False)
        step = np.where(idx >= 0, steps["step"].to_numpy()[np.maximum(idx, 0)], -1)
    else:
        step = np.zeros(len(ts), np.int64)
    labels, keys, starts, ends = _annotation_index(scan, LAYER_PREFIX)
    idx = _innermost(keys, starts, ends, thread, t)
    # isdigit() also passes "²", which int() refuses; over 18 digits would overflow int64
    layer_numbers = np.array([int(x) if x.isdecimal() and len(x) < 19 else -1 for x in labels] or [-1], np.int64)
    layer = np.where(idx >= 0, layer_numbers[np.maximum(idx, 0)], -1)
    labels, keys, starts, ends = _annotation_index(scan, ROLE_PREFIX)
    idx = _innermost(keys, starts, ends, thread, t)
    role_labels = np.array(labels + [None], dtype=object)
    role = role_labels[idx]  # idx -1 picks the trailing None
    role[(role == None) & (layer >= 0)] = "other"  # noqa: E711 (elementwise comparison)
    return {"step": step, "layer": layer, "role": role}


def _cpu_self_time(scan: _Scan) -> np.ndarray:
    """Each CPU op's duration less its direct children's: the time that op itself spent."""
    ops = scan.ops
    key = _thread_key(ops.numpy("pid"), ops.numpy("tid"))
    ts, dur = ops.numpy("ts"), ops.numpy("dur")
    own = dur.copy()
    order = np.lexsort((-dur, ts, key))
    stack: list[int] = []
    for i, k, start, end in zip(order.tolist(), key[order].tolist(), ts[order].tolist(), (ts + dur)[order].tolist()):
        while stack and (stack[-1][1] != k or stack[-1][2] < start):
            stack.pop()
        if stack:
            own[stack[-1][0]] -= dur[i]
        stack.append((i, k, end))
    return own


def _categorical(codes: np.ndarray, names: list[str]) -> pd.Categorical:
    return pd.Categorical.from_codes(codes.astype(np.int64), categories=pd.Index(names, dtype=object))


def _classes(codes: np.ndarray, names: list[str], classify) -> np.ndarray:
    """Classify each distinct name once, then spread the classes over the rows."""
    used = np.unique(codes[codes >= 0])
    table = np.full(len(names) + 1, None, dtype=object)
    for code in used.tolist():
        table[code] = classify(names[code])
    return table[codes]


def _own_intervals(device: np.ndarray, stream: np.ndarray, ts: np.ndarray,
                   dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, duration) of each GPU activity's own time: from the end of those before it on its stream, if later than
    its start. One stream runs in order, but a kernel launched with programmatic dependent launch is resident, waiting,
    before its predecessor ends; that time is the predecessor's, and counted twice a step's kernels would add up to
    more than the step (in optiq's own fused traces, nearly twice). Without such overlap these are ``ts`` and
    ``dur``."""
    if not len(ts):
        return ts, dur
    order = np.lexsort((ts, stream, device))
    same_stream = np.r_[False, (device[order][1:] == device[order][:-1]) & (stream[order][1:] == stream[order][:-1])]
    reach = pd.Series((ts + dur)[order]).groupby(np.cumsum(~same_stream)).cummax().to_numpy()
    overlap = np.empty_like(dur)
    overlap[order] = np.clip(np.where(same_stream, np.r_[-np.inf, reach[:-1]], -np.inf) - ts[order], 0, dur[order])
    return ts + overlap, dur - overlap


def _gpu_table(scan: _Scan, steps: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    g, ops, la = scan.gpu, scan.ops, scan.launches
    kind, ext, corr = g.numpy("kind"), g.numpy("ext"), g.numpy("corr")
    ts, dur = _own_intervals(g.numpy("device"), g.numpy("stream"), g.numpy("ts"), g.numpy("dur"))
    launch = _lookup(la.numpy("corr"), corr)
    has_launch = launch >= 0
    launch_code = np.where(has_launch, la.numpy("name")[np.maximum(launch, 0)] if len(la.ts) else -1, -1)
    graph_code = scan.names.get(GRAPH_LAUNCH, -2)
    graph = launch_code == graph_code
    op = np.where(graph, -1, _lookup(ops.numpy("ext"), ext))  # a graph replay's kernels have no op
    linked = op >= 0
    op_code = np.where(linked, ops.numpy("name")[np.maximum(op, 0)] if len(ops.ts) else -1, -1)

    def from_launch_or_op(launch_col: str, op_col: str, missing):
        a = la.numpy(launch_col)[np.maximum(launch, 0)] if len(la.ts) else np.full(len(ts), missing)
        b = ops.numpy(op_col)[np.maximum(op, 0)] if len(ops.ts) else np.full(len(ts), missing)
        return np.where(has_launch, a, np.where(linked, b, missing))

    at_pid, at_tid = from_launch_or_op("pid", "pid", -1), from_launch_or_op("tid", "tid", -1)
    at_ts = from_launch_or_op("ts", "ts", np.nan)
    place = _place(scan, steps, at_pid, at_tid, at_ts)
    op_key = _thread_key(ops.numpy("pid"), ops.numpy("tid"))
    top = _innermost(op_key, ops.numpy("ts"), ops.numpy("ts") + ops.numpy("dur"),
                     np.where(np.isnan(at_ts), -1, _thread_key(at_pid, at_tid)),
                     np.where(np.isnan(at_ts), -np.inf, at_ts), nested=False)
    top_code = np.where(top >= 0, ops.numpy("name")[np.maximum(top, 0)] if len(ops.ts) else -1, -1)

    name_code = g.numpy("name")
    by_name = _classes(name_code, names, class_of_kernel)
    by_op = _classes(op_code, names, class_of_op)
    by_top = _classes(top_code, names, class_of_top_op)  # None where the innermost op decides
    op_class = np.where(linked & (by_op != "other"), by_op, by_name)
    op_class = np.where(linked & by_top.astype(bool), by_top, op_class)
    op_class[kind > 0] = "memcpy/memset"
    method = np.where(linked, "linkage", np.where(op_class != "other", "name", "none"))
    op_class[method == "none"] = UNATTRIBUTED
    return pd.DataFrame({
        "name": _categorical(name_code, names), "kind": np.array(KIND_NAMES, dtype=object)[kind],
        "device": g.numpy("device"), "stream": g.numpy("stream"), "ts": ts, "dur": dur,
        "correlation": corr, "op": _categorical(op_code, names), "top_op": _categorical(top_code, names),
        "launch": _categorical(launch_code, names), "graph": graph, "launch_ts": at_ts, **place,
        "op_class": op_class, "method": method,
    })


def _cpu_table(scan: _Scan, steps: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    """Without GPU activity: each CPU op with its self time, classified by its own name."""
    ops = scan.ops
    ts, name_code = ops.numpy("ts"), ops.numpy("name")
    place = _place(scan, steps, ops.numpy("pid"), ops.numpy("tid"), ts)
    op_class = _classes(name_code, names, class_of_op)
    name = _categorical(name_code, names)
    return pd.DataFrame({
        "name": name, "kind": "cpu_op", "device": -1, "stream": -1, "ts": ts, "dur": _cpu_self_time(scan),
        "correlation": -1, "op": name, "top_op": name, "launch": None, "graph": False, "launch_ts": ts, **place,
        "op_class": op_class, "method": "cpu_op",
    })


def _launch_counts(scan: _Scan, steps: pd.DataFrame) -> np.ndarray:
    """Launch calls (kernels, graphs, copies) made inside each step, on the step's process."""
    la = scan.launches
    if not len(steps):
        return np.array([], np.int64)
    idx = _innermost(steps["pid"].to_numpy(np.int64), steps["start"].to_numpy(float), steps["end"].to_numpy(float),
                     la.numpy("pid").astype(np.int64), la.numpy("ts"), nested=False)
    return np.bincount(idx[idx >= 0], minlength=len(steps))


def read_trace(path: str | Path, rank: int | None = None) -> Trace:
    """Read one trace file into its kernel table and steps; any malformed input raises a one-line OptiqError."""
    path = Path(path)
    if not path.is_file():
        raise OptiqError(f"{path}: no such trace file")
    try:
        with _open(path) as stream:
            scan = _scan(stream)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise OptiqError(f"{path}: truncated or corrupt gzip ({exc})") from None
    except (ijson.JSONError, ijson.IncompleteJSONError, UnicodeDecodeError) as exc:
        raise OptiqError(f"{path}: not a JSON trace ({str(exc).splitlines()[0][:120]})") from None
    except KeyError as exc:
        raise OptiqError(f"{path}: trace event without a {exc} field") from None
    except (TypeError, AttributeError, ValueError, OverflowError) as exc:  # a field (or the event) of the wrong type
        raise OptiqError(f"{path}: malformed trace event ({' '.join(str(exc).split())[:160]})") from None
    if not scan.events:
        what = "an empty traceEvents list" if _has_trace_events(path) else "no traceEvents"
        raise OptiqError(f"{path}: {what}; not a Kineto/torch.profiler trace")
    names = list(scan.names)
    steps, step_source, notes = _steps(scan)
    if scan.no_duration:
        notes.append(f"{scan.no_duration} GPU event(s) without a duration or with a negative one left out")
    cpu_only = not len(scan.gpu.ts)
    if cpu_only:
        if not len(scan.ops.ts):
            raise OptiqError(f"{path}: no GPU events (kernels, memcpy, memset) and no CPU ops to attribute")
        notes.insert(0, "no GPU events: attributing CPU op self time instead")
        kernels = _cpu_table(scan, steps, names)
    else:
        kernels = _gpu_table(scan, steps, names)
    if step_source == "whole trace":
        first, last = kernels["ts"].min(), (kernels["ts"] + kernels["dur"]).max()
        steps = pd.DataFrame([(0, "whole trace", first, last, -1)], columns=["step", "name", "start", "end", "pid"])
        kernels["step"] = 0
        launches = np.array([len(scan.launches.ts)])
    else:
        launches = _launch_counts(scan, steps)
    steps["launches"] = launches
    return Trace(path=str(path), rank=_rank_of(path, 0) if rank is None else rank, kernels=kernels,
                 steps=steps.drop(columns="pid"), step_source=step_source, cpu_only=cpu_only, notes=notes)
