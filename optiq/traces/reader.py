"""Read a Kineto trace (torch.profiler, vLLM, SGLang; .json or .json.gz) into a kernel table, in one streaming pass.

Memory is bounded by the number of GPU activities and CPU ops, never by the file size: each event is parsed by ijson
(the yajl2_c backend when present), the few fields attribution needs go into typed arrays, and the event is dropped.
Events may come in any order, so linkage and enclosure are resolved after the pass, with numpy:

- launching op: the kernel's ``External id`` equals the innermost ``cpu_op``'s (never for CUDA-graph replays, whose
  kernels share one ``cudaGraphLaunch`` and have no op);
- launch: the ``cuda_runtime``/``cuda_driver`` event with the kernel's ``correlation``; its thread and time place the
  kernel inside the ``optiq/step``, ``optiq/layer`` and ``optiq/role`` record_function ranges around it
  (innermost wins; a kernel inside a layer but outside any role gets role "other");
- step: ``optiq/step/<n>`` ranges (the forward and sampling), else the decode markers of vLLM or SGLang (the forward
  only: ``STEP_GRAMMARS`` says which names count as decode), else the whole trace is one step (and the table says so);
- phase: a kernel launched in a step is "step"; launched after an engine's decode step ends and before its next marker
  begins it is "sampling" (both engines sample, and vLLM drafts, outside the step's range); in an SGLang draft span,
  or after one, "draft"; anything else (prefill, warm-up) "outside".

SGLang's merged file (``merged-{id}.trace.json.gz``) holds every rank, told apart only by the label its merger put
before each pid (``"[TP01] 4242"``): such a file is read as one trace per label. vLLM's frontend trace
(``*.async_llm.*``: Python events only) is recognised, by its name or by Python events without any op, and marked
``frontend`` rather than refused, so that the caller can leave it out of a folder of worker traces.

Hostile input is bounded before it costs memory or time (``ReadLimits``): the byte stream is checked, chunk by chunk
and before ijson sees it, for nesting depth (ijson keeps the path of every open container, quadratic in the depth) and
for strings and numbers longer than a limit (buffered whole; yajl crashes on a number of a few hundred MB); events,
and the text of the distinct names kept, are counted. An event repeated verbatim is counted once.

A GPU activity's ``ts`` and ``dur`` are its own time: from the end of the activities before it on its stream, where
that is later than its start (a kernel launched with programmatic dependent launch starts waiting before its
predecessor ends). A trace without GPU activity (a CPU-only profile) gives a table of CPU ops with their self time
instead.
"""

from __future__ import annotations

import gzip
import os
import re
import stat
import zlib
from array import array
from collections import Counter
from dataclasses import dataclass, field, replace
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

# The engines' step markers and which of them are decode steps (tests/data/engine_traces.py cites the source lines).
# vLLM: Worker.annotate_profile writes ``execute_context_{requests}({tokens})_generation_{requests}({tokens})``, with
# detailed_trace_annotation ``execute_{tokens}_context_{requests}(sq{tokens}sk..)_generation_{requests}(sq..)``, and
# builds before Dec 2025 ``execute_new_{new requests}_cached_{running requests}``: a decode step schedules no context
# (new) request and at least one generating one. SGLang: ModelRunner.forward's ``step[{MODE} bs={n}...]``; under
# speculative decoding the target model's verify pass (VERIFY, older builds TARGET_VERIFY) is the decode step (it is
# the forward that emits the tokens) and DRAFT/DRAFT_EXTEND spans are the draft model's work, shown apart.
VLLM_STEP = re.compile(r"execute_(?:\d+_)?context_(\d+)\((?:sq)?\d+[^)]{0,200}\)_generation_(\d+)\(")
VLLM_OLD_STEP = re.compile(r"execute_new_(\d+)_cached_(\d+)")
SGLANG_STEP = re.compile(r"step\[(\w+) bs=\d+")
SGLANG_DECODE, SGLANG_DRAFT = {"DECODE", "VERIFY", "TARGET_VERIFY"}, {"DRAFT", "DRAFT_EXTEND", "DRAFT_EXTEND_V2"}


def _vllm_kind(match: re.Match) -> str:
    """A vLLM step with a context (prefill) request is prefill or mixed; only all-generating steps are decode."""
    return "decode" if match.group(1) == "0" and match.group(2) != "0" else "other"


def _sglang_kind(match: re.Match) -> str:
    """SGLang's mode names say it: decode (or the target's verify), the draft model's work, or anything else."""
    mode = match.group(1).upper()
    return "decode" if mode in SGLANG_DECODE else "draft" if mode in SGLANG_DRAFT else "other"


STEP_GRAMMARS = (("vllm", VLLM_STEP, _vllm_kind), ("vllm", VLLM_OLD_STEP, _vllm_kind),
                 ("sglang", SGLANG_STEP, _sglang_kind))
STEP_DEFINITIONS = {
    "optiq": "one optiq/step range: the forward and its sampling",
    "vllm": "one decode forward (vLLM's execute_..._generation_N range); sampling and drafting run after it, "
            "shown apart",
    "sglang": "one target-model forward (SGLang's step[DECODE] or, speculative, step[VERIFY]); sampling after it "
              "and step[DRAFT] spans shown apart",
    "whole trace": "the whole trace (no step markers)",
}
WORK_PHASES = ("step", "sampling", "draft")  # a decode step's work, wherever the markers put it
PHASES = (*WORK_PHASES, "outside")  # outside: prefill, warm-up, anything no decode step owns
RANK_LABEL = re.compile(r"\[((?:TP|DP|PP|EP)\d+(?:-(?:TP|DP|PP|EP)\d+)*)\] ")
GPU_KINDS = {"kernel": 0, "gpu_memcpy": 1, "gpu_memset": 2}
KIND_NAMES = ("kernel", "memcpy", "memset", "cpu_op")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
GRAPH_LAUNCH = "cudaGraphLaunch"


@dataclass(frozen=True)
class ReadLimits:
    """How much of a trace optiq will read. Real traces sit below each: Kineto nests 6 deep, its longest names are C++
    signatures of a few kB, optiq's own traces hold well under a million events, a 1 GB vLLM one about 4 M and the
    2 GB trace of issue 7 about 7.3 M. ``max_events`` (10 M unless OPTIQ_MAX_TRACE_EVENTS says otherwise) bounds the
    time of a plain file (ijson parses ~300 k events a second, checks included); a compressed one that repeats an
    event millions of times inflates past ``max_inflation`` first. The others bound memory."""

    max_depth: int = 100
    max_token: int = 16 << 20  # bytes in one string or number
    max_events: int | None = None  # None: OPTIQ_MAX_TRACE_EVENTS, else 10 M
    max_name_bytes: int = 16 << 20  # the distinct names (kernels, ops, markers, threads) kept, together
    max_inflation: int = 250  # bytes a compressed byte may inflate to (real traces: under 40), past the first...
    inflation_free: int = 64 << 20  # ...this many bytes inflated: a gzip bomb is refused in seconds, not after GBs

    def resolved(self) -> "ReadLimits":
        """These limits with ``max_events`` read from the environment where it is None."""
        if self.max_events is not None:
            return self
        text = os.environ.get(EVENTS_VARIABLE)
        if text is None:
            return replace(self, max_events=10_000_000)
        if not text.strip().isdecimal() or int(text) < 1:
            raise OptiqError(f"{EVENTS_VARIABLE} must be a positive whole number of events, not {text!r}")
        return replace(self, max_events=int(text))


EVENTS_VARIABLE = "OPTIQ_MAX_TRACE_EVENTS"


class _Refused(Exception):
    """A limit of ``ReadLimits`` was reached; the message says which."""


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
    label: str = ""  # the rank's label in a merged file ("TP01"), else empty
    frontend: bool = False  # a CPU-only trace of Python events (vLLM's async_llm): nothing to attribute

    @property
    def step_definition(self) -> str:
        return STEP_DEFINITIONS[self.step_source]


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

    def __init__(self, limits: ReadLimits):
        self.limits = limits
        self.name_bytes = 0
        self.names: dict[str, int] = {}  # every kept name, interned to a code
        self.threads: dict[object, int] = {}  # string pids/tids -> integer codes
        self.gpu = _Columns(name="l", kind="b", ts="d", dur="d", device="l", stream="l", corr="q", ext="q", pid="l")
        self.ops = _Columns(name="l", ts="d", dur="d", pid="l", tid="l", ext="q")
        self.launches = _Columns(name="l", ts="d", pid="l", tid="l", corr="q")
        self.marks: list[tuple[str, float, float, int, int]] = []  # name, ts, end, pid, tid
        self.events = 0
        self.no_duration = 0  # GPU events without a duration or with a negative one: left out
        self.negative_ranges = 0  # annotations with a negative duration: taken as instants
        self.repeated = 0  # events identical to one already read: counted once
        self.python_events = 0  # with_stack's python_function events (a frontend trace holds nothing else)

    def keep(self, text) -> None:
        """Account for one more distinct name kept (only strings are names), within ``max_name_bytes``."""
        _check_name(text)
        self.name_bytes += len(text)
        if self.name_bytes > self.limits.max_name_bytes:
            raise _Refused(f"its distinct names hold over {self.limits.max_name_bytes:,} characters (the limit)")

    def drop(self, columns: "_Columns", repeated: np.ndarray) -> None:
        """Remove the rows flagged in ``repeated`` from ``columns``, counting them."""
        keep = ~repeated
        for name in vars(columns):
            setattr(columns, name, array(getattr(columns, name).typecode, columns.numpy(name)[keep].tobytes()))
        self.repeated += int(repeated.sum())


def _open(path: Path):
    """The file's bytes, inflated where it is gzip (by its magic number, whatever its name)."""
    raw = open(path, "rb")
    if raw.read(2) == b"\x1f\x8b":
        raw.close()
        return gzip.GzipFile(path, mode="rb")  # opened by name, so that closing it closes the file too
    raw.seek(0)
    return raw


_NUMBER_BYTES = b"0123456789+-.eE"


class _Bounded:
    """A byte stream that refuses, before the JSON parser sees them, nesting deeper than ``max_depth``, strings or
    numbers longer than ``max_token`` and gzip that inflates more than ``max_inflation`` times. Reads are at most
    ``max_token`` bytes, so a longer token spans chunks and is measured across them; depth counts brackets outside
    strings (numpy, ~3 ms a MB)."""

    def __init__(self, raw, limits: ReadLimits):
        self.raw, self.limits = raw, limits
        self.compressed = raw.fileobj if isinstance(raw, gzip.GzipFile) else None
        self.inflated = 0
        self.depth = 0
        self.in_string = False
        self.backslashes = 0  # the run of backslashes the last chunk ended with (inside a string)
        self.run = 0  # length of the string or number the last chunk ended in

    def read(self, size: int = -1) -> bytes:
        size = self.limits.max_token if size is None or size < 0 else min(size, self.limits.max_token)
        chunk = self.raw.read(size)
        if chunk:
            self._check(chunk)
            self.inflated += len(chunk)
            if self.compressed is not None and self.inflated > self.limits.inflation_free and \
                    self.inflated > self.limits.max_inflation * self.compressed.tell():
                raise _Refused(f"its gzip inflates over {self.limits.max_inflation} times (a decompression bomb; "
                               "real traces inflate under 40 times)")
        return chunk

    def _quotes(self, a: np.ndarray, chunk: bytes) -> np.ndarray:
        """Where the chunk has an unescaped double quote: one after an even run of backslashes (counting the run the
        last chunk ended with)."""
        quote = a == 0x22
        carried, self.backslashes = self.backslashes, 0
        if not carried and b"\\" not in chunk:
            return quote
        at = np.flatnonzero(quote)
        escapes = np.where(at == 0, carried, 0)
        slash = np.flatnonzero(a == 0x5C)
        if len(slash):
            new_run = np.r_[True, np.diff(slash) != 1]
            run_start = slash[new_run][np.cumsum(new_run) - 1]  # of the run each backslash belongs to
            carry = np.where(run_start == 0, carried, 0)  # a run from the chunk's start continues the last one's
            i = np.minimum(np.searchsorted(slash, at - 1), len(slash) - 1)
            escapes += np.where(slash[i] == at - 1, at - run_start[i] + carry[i], 0)
            if slash[-1] == len(a) - 1:
                self.backslashes = int(len(a) - run_start[-1] + carry[-1])
        quote[at[escapes % 2 == 1]] = False
        return quote

    def _check(self, chunk: bytes) -> None:
        a = np.frombuffer(chunk, np.uint8)
        quote = self._quotes(a, chunk)
        was_in_string = self.in_string
        inside = (np.cumsum(quote, dtype=np.uint8) & 1).astype(bool) ^ was_in_string
        folded = a | 0x20  # "[" and "{" become 0x7B, "]" and "}" 0x7D
        brackets = np.flatnonzero((folded == 0x7B) | (folded == 0x7D))
        brackets = brackets[~inside[brackets]]
        if len(brackets):
            depth = self.depth + np.cumsum(0x7C - folded[brackets].astype(np.int64))
            if depth.max() > self.limits.max_depth:
                raise _Refused(f"it nests arrays/objects deeper than {self.limits.max_depth} levels")
            self.depth = int(depth[-1])
        self.in_string = bool(inside[-1]) if len(a) else was_in_string
        self._measure_run(chunk, quote, was_in_string)

    def _measure_run(self, chunk: bytes, quote: np.ndarray, was_in_string: bool) -> None:
        """Lengthen or end the string or number the last chunk ended in, and start the one this chunk ends in."""
        has_quote = bool(quote.any())
        if was_in_string:
            head = int(quote.argmax()) if has_quote else len(chunk)
            what = "string"
        else:
            head = len(chunk) - len(chunk.lstrip(_NUMBER_BYTES))
            what = "number"
        self.run += head
        if self.run > self.limits.max_token:
            raise _Refused(f"it holds a {what} longer than {self.limits.max_token:,} bytes")
        if head == len(chunk):
            return
        if self.in_string:
            last = len(quote) - 1 - int(quote[::-1].argmax())
            self.run = len(chunk) - last - 1
        else:
            self.run = len(chunk) - len(chunk.rstrip(_NUMBER_BYTES))


def _is_marker(name: str) -> bool:
    return name.startswith("optiq/") or any(pattern.search(name) for _, pattern, _ in STEP_GRAMMARS)


def _scan(stream, limits: ReadLimits) -> _Scan:
    """The one pass. The loop body is the hot path of a 1 GB trace: local names, one dict lookup per name, and
    integer pids/tids stored as they are (only string ones go through the intern table)."""
    scan = _Scan(limits)
    names, threads, keep = scan.names, scan.threads, scan.keep
    g, o, la = scan.gpu, scan.ops, scan.launches
    g_name, g_kind, g_ts, g_dur = g.name.append, g.kind.append, g.ts.append, g.dur.append
    g_dev, g_stream, g_corr, g_ext, g_pid = g.device.append, g.stream.append, g.corr.append, g.ext.append, g.pid.append
    o_name, o_ts, o_dur, o_pid, o_tid, o_ext = o.name.append, o.ts.append, o.dur.append, o.pid.append, \
        o.tid.append, o.ext.append
    l_name, l_ts, l_pid, l_tid, l_corr = la.name.append, la.ts.append, la.pid.append, la.tid.append, la.corr.append
    marks = scan.marks
    op_codes: dict[str, int] = {}  # cpu_op name -> code, or -1 - code for a step/layer/role marker
    launch_codes: dict[str, int] = {}  # runtime call name -> code, or -1 when it launches nothing
    marker_names: dict[str, str] = {}  # one string per distinct marker name (ijson makes a new one per event)
    count, max_events, previous = 0, limits.max_events, object()  # equal to no event
    for ev in _ijson.items(stream, "traceEvents.item", use_float=True, buf_size=1 << 20):
        count += 1
        if count > max_events:
            raise _Refused(f"it holds more than {max_events:,} events (the limit; {EVENTS_VARIABLE} raises it)")
        if ev == previous:  # an exporter that wrote one event many times (events repeated apart: see _dedupe)
            scan.repeated += 1
            continue
        previous = ev
        cat = ev.get("cat")
        if cat == "cpu_op":
            name = ev["name"]
            code = op_codes.get(name)
            if code is None:
                keep(name)
                code = names.setdefault(name, len(names))
                code = op_codes[name] = -1 - code if _is_marker(name) else code
            pid, tid = _thread(ev, threads, keep)
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
                keep(name)
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
            pid = ev.get("pid", -1)  # the device; SGLang's merged file labels it with the rank
            g_pid(pid if pid.__class__ is int else _thread(ev, threads, keep)[0])
        elif cat in RUNTIME_CATS:
            name = ev["name"]
            code = launch_codes.get(name)
            if code is None:
                keep(name)
                launches = any(word in name for word in ("Launch", "Memcpy", "Memset"))
                code = launch_codes[name] = names.setdefault(name, len(names)) if launches else -1
            if code < 0:
                continue
            pid, tid = _thread(ev, threads, keep)
            l_name(code)
            l_ts(ev["ts"])
            l_pid(pid)
            l_tid(tid)
            l_corr(ev["args"].get("correlation", -1) if "args" in ev else -1)
        elif cat == "user_annotation":
            name = ev["name"]
            _check_name(name)
            if _is_marker(name):
                if name not in marker_names:
                    keep(name)
                    marker_names[name] = name
                name = marker_names[name]
                pid, tid = _thread(ev, threads, keep)
                ts, dur = ev["ts"], ev.get("dur", 0.0)
                if dur < 0:  # a range that ends before it starts: an instant, and said
                    scan.negative_ranges += 1
                    dur = 0.0
                marks.append((name, ts, ts + dur, pid, tid))
        elif cat == "python_function":
            scan.python_events += 1
    scan.events = count
    return scan


def _repeated_rows(columns: _Columns) -> np.ndarray:
    """Rows equal in every column to an earlier row: the same event written twice (some exporters repeat the whole
    list). Sorting keeps it O(n log n) in time and a few bytes a row in memory."""
    values = [columns.numpy(name) for name in vars(columns)]
    values = [v.view(np.int64) if v.dtype == np.float64 else v for v in values]  # NaN equals itself bitwise
    repeated = np.zeros(len(values[0]), bool)
    if len(repeated) < 2:
        return repeated
    order = np.lexsort(values)
    same = np.ones(len(order) - 1, bool)
    for v in values:
        sorted_v = v[order]
        same &= sorted_v[1:] == sorted_v[:-1]
    repeated[order[1:][same]] = True  # lexsort is stable: the first of equal rows stays
    return repeated


def _dedupe(scan: _Scan) -> None:
    """Count each distinct GPU activity, op, launch and marker once."""
    for columns in (scan.gpu, scan.ops, scan.launches):
        repeated = _repeated_rows(columns)
        if repeated.any():
            scan.drop(columns, repeated)
    distinct = list(dict.fromkeys(scan.marks))
    scan.repeated += len(scan.marks) - len(distinct)
    scan.marks = distinct


def _check_name(name) -> None:
    """Names are interned and matched as text, so anything else (a number, a list) is malformed input."""
    if name.__class__ is not str:
        raise TypeError(f"name {repr(name)[:60]} is not a string")


def _thread(ev: dict, threads: dict, keep) -> tuple[int, int]:
    """pid and tid as integers; a string one (some exporters name threads) gets a code far above any real id."""
    pid, tid = ev.get("pid", -1), ev.get("tid", -1)
    if pid.__class__ is not int:
        pid = threads.get(pid) or _thread_code(pid, threads, keep)
    if tid.__class__ is not int:
        tid = threads.get(tid) or _thread_code(tid, threads, keep)
    return pid, tid


def _thread_code(value, threads: dict, keep) -> int:
    if value.__class__ is str:
        keep(value)
    return threads.setdefault(value, (1 << 30) + len(threads))


_JSON_KINDS = {"start_map": "an object", "start_array": "an array", "string": "a string", "number": "a number",
               "boolean": "a boolean", "null": "null"}


def _without_events(path: Path, limits: ReadLimits) -> str:
    """What the file holds instead of events (asked only when the pass found none): no ``traceEvents`` key, an empty
    list, or a ``traceEvents`` (or a top level) of another JSON kind."""
    with _open(path) as raw:
        events = iter(_ijson.parse(_Bounded(raw, limits)))
        _, top, _ = next(events)
        if top != "start_map":
            return f"the top level is {_JSON_KINDS.get(top, top)}, not an object with traceEvents"
        for prefix, event, value in events:
            if prefix == "" and event == "map_key" and value == "traceEvents":
                _, kind, _ = next(events)
                if kind == "start_array":
                    return "an empty traceEvents list"
                return f"traceEvents is {_JSON_KINDS.get(kind, kind)}, not a list of events"
    return "no traceEvents"


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


def _innermost(iv_key, iv_start, iv_end, pt_key, pt_time, nested: bool = True) -> np.ndarray:
    """For each point, the index of the innermost interval of the same key (thread) that contains it, else -1.

    Intervals of one key must nest, as record_function ranges and ops on one thread do. With ``nested=False`` only
    the outermost intervals are searched, which is what finding a launch's top-level op needs.

    One sweep over the points in (key, time) order with a stack of open intervals: each interval is pushed once and
    popped once (one that ended before a point cannot hold a later one), so the cost is linear after the sorts
    however deep the nesting or many the threads (a parent walk per point, or a scan per thread, is quadratic)."""
    result = np.full(len(pt_time), -1, np.int64)
    if not len(iv_start) or not len(pt_time):
        return result
    order = np.lexsort((-iv_end, iv_start, iv_key))  # outer first where starts tie
    if not nested:  # the roots: an interval is one when it starts after every earlier one of its key ended
        key, end = iv_key[order], iv_end[order]
        reach = pd.Series(end).groupby(key).cummax().to_numpy()
        prior_end = np.where(np.r_[False, key[1:] == key[:-1]], np.r_[-np.inf, reach[:-1]], -np.inf)
        order = order[iv_start[order] >= prior_end]
    keys, starts, ends = iv_key[order].tolist(), iv_start[order].tolist(), iv_end[order].tolist()
    points = np.lexsort((pt_time, pt_key))
    stack: list[int] = []
    pushed, current = 0, None
    for point, key, time in zip(points.tolist(), pt_key[points].tolist(), pt_time[points].tolist()):
        if key != current:
            stack.clear()
            current = key
            while pushed < len(keys) and keys[pushed] < key:
                pushed += 1
        while pushed < len(keys) and keys[pushed] == key and starts[pushed] <= time:
            if not nested:
                stack.clear()  # roots do not nest: only the latest to start can hold the point
            stack.append(pushed)
            pushed += 1
        while stack and ends[stack[-1]] < time:
            stack.pop()
        if stack:
            result[point] = order[stack[-1]]
    return result


def _lookup(keys: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Index into ``keys`` of each wanted value (first occurrence), or -1 where absent or negative."""
    if not len(keys):
        return np.full(len(wanted), -1, np.int64)
    order = np.argsort(keys, kind="stable")
    pos = np.minimum(np.searchsorted(keys[order], wanted), len(keys) - 1)
    found = (keys[order][pos] == wanted) & (wanted >= 0)
    return np.where(found, order[pos], -1)


def _steps(scan: _Scan) -> tuple[pd.DataFrame, pd.DataFrame, str, list[str]]:
    """Decode step ranges and every engine marker range (for phases), from optiq's own annotations first, then the
    first engine grammar (``STEP_GRAMMARS``) any marker matches.

    Steps are numbered in time order; the marker's own text stays in ``name`` (numbers in markers can repeat, e.g.
    one sweep per concurrency). A trace whose markers hold no decode step has no steps (a prefill-only file, such as
    SGLang's ``-EXTEND`` one of profile_by_stage), not one whole-trace step."""
    notes: list[str] = []
    rows = sorted((ts, name, end, pid) for name, ts, end, pid, _ in scan.marks
                  if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit())
    markers = pd.DataFrame([(ts, end, pid, "decode", i) for i, (ts, name, end, pid) in enumerate(rows)],
                           columns=["start", "end", "pid", "kind", "step"])
    rows = [(i, name, ts, end, pid) for i, (ts, name, end, pid) in enumerate(rows)]
    source = "optiq"
    if not rows:
        source = "whole trace"
        for grammar, pattern, kind_of in STEP_GRAMMARS:
            found = [(ts, name, end, pid, kind_of(m)) for name, ts, end, pid, _ in scan.marks
                     if (m := pattern.search(name))]
            if not found:
                continue
            source = grammar
            found.sort(key=lambda f: f[0])
            kinds = Counter(f[4] for f in found)
            if kinds["other"]:
                notes.append(f"{kinds['other']} non-decode {grammar} step(s) (prefill/mixed) left out")
            if not kinds["decode"]:
                notes.append(f"no decode step among its {len(found)} {grammar} step marker(s)")
            number = np.cumsum([f[4] == "decode" for f in found]) - 1
            markers = pd.DataFrame([(ts, end, pid, kind, n if kind == "decode" else -1)
                                    for (ts, _, end, pid, kind), n in zip(found, number.tolist())],
                                   columns=["start", "end", "pid", "kind", "step"])
            rows = [(n, name, ts, end, pid) for (ts, name, end, pid, kind), n in zip(found, number.tolist())
                    if kind == "decode"]
            break
        else:
            notes.append("no step markers (optiq/step, vLLM, SGLang): the whole trace is treated as one step")
    return pd.DataFrame(rows, columns=["step", "name", "start", "end", "pid"]), markers, source, notes


def _annotation_index(scan: _Scan, prefix: str) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """The ranges of one annotation kind: their labels (after the prefix), thread keys, starts and ends."""
    picked = [m for m in scan.marks if m[0].startswith(prefix)]
    labels = [m[0][len(prefix):] for m in picked]
    keys = _thread_key(np.array([m[3] for m in picked], np.int64), np.array([m[4] for m in picked], np.int64))
    return labels, keys, np.array([m[1] for m in picked], float), np.array([m[2] for m in picked], float)


def _phases(markers: pd.DataFrame, pid: np.ndarray, ts: np.ndarray, source: str) -> tuple[np.ndarray, np.ndarray]:
    """Step number and phase (``PHASES``) of launch points: inside a decode marker, its step and "step"; inside a
    draft marker or after one, "draft"; after an engine's decode step and before the next marker, "sampling" (optiq's
    own steps hold their sampling, so after one is "outside"). Markers of one process follow one another, so a point
    belongs to the last marker that began before it on its process."""
    step = np.full(len(ts), -1, np.int64)
    phase = np.full(len(ts), "outside", dtype=object)
    after_decode = "outside" if source == "optiq" else "sampling"
    for process, group in markers.groupby("pid", sort=False):
        group = group.sort_values("start", kind="stable")
        mine = np.flatnonzero((pid == process) & ~np.isnan(ts))
        last = np.searchsorted(group["start"].to_numpy(float), ts[mine], side="right") - 1
        began = last >= 0
        mine, last = mine[began], last[began]
        inside = ts[mine] <= group["end"].to_numpy(float)[last]
        kind = group["kind"].to_numpy(object)[last]
        step[mine] = np.where(inside & (kind == "decode"), group["step"].to_numpy(np.int64)[last], -1)
        phase[mine] = np.select([kind == "draft", (kind == "decode") & inside, kind == "decode"],
                                ["draft", "step", after_decode], "outside")
    return step, phase


def _place(scan: _Scan, markers: pd.DataFrame, source: str, pid, tid, ts) -> dict[str, np.ndarray]:
    """Step, phase, layer and role of launch points (pid, tid, ts codes; ts NaN where the launch is unknown)."""
    known = ~np.isnan(ts)
    thread = np.where(known, _thread_key(pid, tid), -1)
    t = np.where(known, ts, -np.inf)
    if source == "whole trace":
        step, phase = np.zeros(len(ts), np.int64), np.full(len(ts), "step", dtype=object)
    else:
        step, phase = _phases(markers, np.where(known, pid, -1), ts, source)
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
    return {"step": step, "phase": phase, "layer": layer, "role": role}


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


def _gpu_table(scan: _Scan, markers: pd.DataFrame, source: str, names: list[str]) -> pd.DataFrame:
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
    place = _place(scan, markers, source, at_pid, at_tid, at_ts)
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


def _cpu_table(scan: _Scan, markers: pd.DataFrame, source: str, names: list[str]) -> pd.DataFrame:
    """Without GPU activity: each CPU op with its self time, classified by its own name."""
    ops = scan.ops
    ts, name_code = ops.numpy("ts"), ops.numpy("name")
    place = _place(scan, markers, source, ops.numpy("pid"), ops.numpy("tid"), ts)
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


_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _check_regular_file(path: Path) -> None:
    """Refuse, without opening it (opening a FIFO blocks until a writer comes), anything but a readable regular
    file."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise OptiqError(f"{path}: no such trace file") from None
    except OSError as exc:
        raise OptiqError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    for test, what in _NOT_REGULAR:
        if test(mode):
            raise OptiqError(f"{path}: {what}, not a trace file")
    if not stat.S_ISREG(mode):
        raise OptiqError(f"{path}: not a regular file, not a trace file")


def read_trace(path: str | Path, rank: int | None = None, limits: ReadLimits = ReadLimits()) -> Trace:
    """Read one trace file of one rank into its kernel table and steps; any malformed or oversized input, or a
    merged file of several ranks, raises a one-line OptiqError."""
    traces = read_traces(path, limits)
    if len(traces) > 1:
        raise OptiqError(f"{path}: holds {len(traces)} ranks ({', '.join(t.label for t in traces)}); one rank's "
                         "trace is needed here")
    if rank is not None:
        traces[0].rank = rank
    return traces[0]


def read_traces(path: str | Path, limits: ReadLimits = ReadLimits()) -> list[Trace]:
    """Read one trace file into one Trace per rank it holds (several only for a merged file); any malformed or
    oversized input raises a one-line OptiqError."""
    path = Path(path)
    limits = limits.resolved()
    _check_regular_file(path)
    try:
        return _read(path, limits)
    except _Refused as exc:
        raise OptiqError(f"{path}: refused: {exc}") from None
    except MemoryError:
        raise OptiqError(f"{path}: out of memory reading it (a smaller trace, or fewer steps, would fit)") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise OptiqError(f"{path}: truncated or corrupt gzip ({exc})") from None
    except (ijson.JSONError, ijson.IncompleteJSONError, UnicodeDecodeError) as exc:
        raise OptiqError(f"{path}: not a JSON trace ({str(exc).splitlines()[0][:120]})") from None
    except KeyError as exc:
        raise OptiqError(f"{path}: trace event without a {' '.join(str(exc).split())[:80]} field") from None
    except (TypeError, AttributeError, ValueError, OverflowError) as exc:  # a field (or the event) of the wrong type
        raise OptiqError(f"{path}: malformed trace event ({' '.join(str(exc).split())[:160]})") from None
    except OSError as exc:  # a read error of the disk, or a file that went away
        raise OptiqError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def _read(path: Path, limits: ReadLimits) -> list[Trace]:
    with _open(path) as raw:
        scan = _scan(_Bounded(raw, limits), limits)
    if not scan.events:
        raise OptiqError(f"{path}: {_without_events(path, limits)}; not a Kineto/torch.profiler trace")
    _dedupe(scan)
    labels = _rank_labels(scan)
    if not labels:
        return [_trace(scan, path, _rank_of(path, 0), "")]
    ordered = sorted(labels.items(), key=lambda item: _label_order(item[0]))
    return [_trace(_only(scan, codes), path, rank, label) for rank, (label, codes) in enumerate(ordered)]


def _rank_labels(scan: _Scan) -> dict[str, set[int]]:
    """The pid codes under each rank label SGLang's merger put before the pids (``"[TP01] 4242"``), if any."""
    labels: dict[str, set[int]] = {}
    for value, code in scan.threads.items():
        found = RANK_LABEL.match(value) if value.__class__ is str else None
        if found:
            labels.setdefault(found.group(1), set()).add(code)
    return labels


def _label_order(label: str) -> tuple[int, ...]:
    """The merger's own order of ranks: by DP, then EP, PP and TP."""
    ranks = dict(re.findall(r"([A-Z]+)(\d+)", label))
    return tuple(int(ranks.get(kind, 0)) for kind in ("DP", "EP", "PP", "TP"))


def _only(scan: _Scan, pids: set[int]) -> _Scan:
    """The part of a merged file's scan on the given pids: one rank. Correlation and External ids repeat across
    ranks, so linkage must be resolved within one."""
    part = _Scan(scan.limits)
    part.names, part.threads, part.events = scan.names, scan.threads, scan.events
    part.no_duration, part.negative_ranges, part.repeated = scan.no_duration, scan.negative_ranges, scan.repeated
    wanted = np.array(sorted(pids), np.int64)
    for name in ("gpu", "ops", "launches"):
        columns, target = getattr(scan, name), getattr(part, name)
        keep = np.isin(columns.numpy("pid"), wanted)
        for column in vars(columns):
            setattr(target, column, array(getattr(columns, column).typecode, columns.numpy(column)[keep].tobytes()))
    part.marks = [m for m in scan.marks if m[3] in pids]
    return part


def _trace(scan: _Scan, path: Path, rank: int, label: str) -> Trace:
    """The Trace of one rank's scan."""
    names = list(scan.names)
    steps, markers, step_source, notes = _steps(scan)
    if scan.no_duration:
        notes.append(f"{scan.no_duration} GPU event(s) without a duration or with a negative one left out")
    if scan.negative_ranges:
        notes.append(f"{scan.negative_ranges} annotation(s) with a negative duration taken as instants")
    if scan.repeated:
        notes.append(f"{scan.repeated} event(s) repeated verbatim counted once")
    cpu_only = not len(scan.gpu.ts)
    # vLLM names its frontend's trace {host}_{pid}.async_llm.*; without that name, Python frames and no op tell it
    frontend = cpu_only and (".async_llm." in path.name or (not len(scan.ops.ts) and scan.python_events > 0))
    if cpu_only and not len(scan.ops.ts) and not frontend:
        raise OptiqError(f"{path}: no GPU events (kernels, memcpy, memset) and no CPU ops to attribute")
    if cpu_only:
        notes.insert(0, "a CPU-only frontend trace (vLLM's async_llm): no GPU events" if frontend else
                     "no GPU events: attributing CPU op self time instead")
        kernels = _cpu_table(scan, markers, step_source, names)
        ends = scan.ops.numpy("ts") + scan.ops.numpy("dur")  # an op's whole range, not its self time
    else:
        kernels = _gpu_table(scan, markers, step_source, names)
        ends = (kernels["ts"] + kernels["dur"]).to_numpy()
    if step_source == "whole trace":
        first, last = (kernels["ts"].min(), ends.max()) if len(ends) else (0.0, 0.0)
        steps = pd.DataFrame([(0, "whole trace", first, last, -1)], columns=["step", "name", "start", "end", "pid"])
        launches = np.array([len(scan.launches.ts)])
    else:
        launches = _launch_counts(scan, steps)
    steps["launches"] = launches
    return Trace(path=str(path), rank=rank, kernels=kernels, steps=steps.drop(columns="pid"),
                 step_source=step_source, cpu_only=cpu_only, notes=notes, label=label, frontend=frontend)
