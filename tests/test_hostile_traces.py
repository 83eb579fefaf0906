"""Hostile traces, written here by generators: each is read within a bounded time and memory, and either reads or fails
with a one-line error. The ones that cost memory or time run the real CLI in a subprocess under an address-space cap
(RLIMIT_AS) and a timeout; the size limits the reader exposes (ReadLimits) let the large cases stay small and fast."""

import gzip
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_lines import error_line

from optiq.errors import OptiqError
from optiq.traces.attribution import _in_order_pairs, attribute, step_stats
from optiq.traces.reader import ReadLimits, read_trace

REPO = Path(__file__).parent.parent
CAP = 2 << 30  # bytes of address space a hostile trace may cost the whole CLI, torch imported included


def optiq_capped(*args, timeout=60, memory=CAP, **env_vars):
    """``python -m optiq ARGS`` in a subprocess that may map at most ``memory`` bytes and run ``timeout`` seconds."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = {**os.environ, "PYTHONPATH": str(REPO), **env_vars}
    return subprocess.run([sys.executable, "-m", "optiq", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=cap, env=env, cwd=REPO)


def assert_clean_failure(result, message):
    """Exit 1, the message on one line (after progress lines only), no traceback."""
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-2000:]
    assert message in error_line(result.stderr), result.stderr[-2000:]


def write_gz(path: Path, *parts: bytes) -> Path:
    with gzip.open(path, "wb", compresslevel=6) as f:
        for part in parts:
            f.write(part)
    return path


def kernel(ts, name="k", corr=-1, dur=1.0, **args):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": 7, "device": 0, **args}}


def annotation(name, ts, dur, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}


def launch(ts, corr, name="cudaLaunchKernel"):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": 1.0,
            "args": {"correlation": corr}}


def events_file(path: Path, events) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


# --- depth ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["ignored key", "inside an event", "arrays of objects"])
def test_deep_nesting_is_refused_before_it_costs_memory(tmp_path, where):
    """100,000 levels in a ~300-byte .gz once took analyze to 24 GB; ijson keeps the path of every open level."""
    depth = 100_000
    body = {"ignored key": b'{"deviceProperties": ' + b"[" * depth + b"]" * depth + b', "traceEvents": []}',
            "inside an event": b'{"traceEvents": [{"cat": "kernel", "args": ' + b'{"a": ' * depth + b"1" +
                               b"}" * depth + b"}]}",
            "arrays of objects": b'{"traceEvents": ' + b'[{"x": ' * depth + b"0" + b"}]" * depth + b"}"}[where]
    path = write_gz(tmp_path / "deep.json.gz", body)
    assert path.stat().st_size < 2000
    started = time.monotonic()
    result = optiq_capped("analyze", path, timeout=30)
    assert_clean_failure(result, "nests arrays/objects deeper than 100 levels")
    assert time.monotonic() - started < 20


def test_depth_within_the_limit_reads(tmp_path):
    """The limit is on depth, not on the file: an event whose args nest to the limit reads."""
    limits = ReadLimits(max_depth=12)
    deep_arg = json.loads("[" * 8 + "]" * 8)  # top object, list, event, args: 4 levels, then 8
    ok = events_file(tmp_path / "ok.json", [kernel(0.0, dims=deep_arg)])
    assert len(read_trace(ok, limits=limits).kernels) == 1
    too_deep = events_file(tmp_path / "deep.json", [kernel(0.0, dims=[deep_arg])])
    with pytest.raises(OptiqError, match="deeper than 12 levels"):
        read_trace(too_deep, limits=limits)


def test_brackets_inside_strings_do_not_count_as_depth(tmp_path):
    """Depth is counted outside strings, escaped quotes included: names full of brackets are names."""
    name = '[[[[{{{{"[[[[\\' * 50  # written as \" and \\: escaped quotes, and backslashes before real quotes
    path = events_file(tmp_path / "t.json", [kernel(0.0, name=name)])
    assert read_trace(path, limits=ReadLimits(max_depth=8)).kernels["name"].tolist() == [name]


def test_escapes_split_across_chunks_are_followed(tmp_path):
    """A run of backslashes cut by a chunk boundary: the reader (chunks of max_token bytes here) still knows which
    quotes end strings, so the brackets after them are counted and the ones inside are not."""
    for cut in range(1, 9):
        name = "x" * cut + "\\" * 3 + "\"" + "[" * 20  # the quote is escaped: the brackets are inside the name
        path = events_file(tmp_path / f"t{cut}.json", [kernel(0.0, name=name)])
        trace = read_trace(path, limits=ReadLimits(max_depth=6, max_token=48))
        assert trace.kernels["name"].tolist() == [name]


# --- long strings and numbers --------------------------------------------------------------------------------------

def test_a_huge_string_in_a_small_gzip_is_refused_at_the_limit(tmp_path):
    """A string bigger than the 16 MiB limit (the issue's was 3 GB in a 3 MB .gz) stops the read once the limit is
    passed: memory stays at a chunk, whatever the string's length."""
    chunk = b"a" * (1 << 20)
    path = write_gz(tmp_path / "string.json.gz", b'{"traceEvents": [{"cat": "kernel", "name": "', *[chunk] * 40,
                    b'"}]}')
    result = optiq_capped("analyze", path, timeout=30)
    assert_clean_failure(result, "holds a string longer than 16,777,216 bytes")


def test_a_huge_number_is_refused(tmp_path):
    """yajl buffers a number whole (and crashed on one of 200 MB): numbers are tokens bounded like strings."""
    path = write_gz(tmp_path / "number.json.gz", b'{"traceEvents": [{"cat": "kernel", "ts": 1',
                    *[b"7" * (1 << 20)] * 20, b"}]}")
    result = optiq_capped("analyze", path, timeout=30)
    assert_clean_failure(result, "holds a number longer than 16,777,216 bytes")


@pytest.mark.parametrize("length, reads", [(1000, True), (1001, False)])
def test_token_limit_is_exact(tmp_path, length, reads):
    """A name of exactly max_token bytes reads; one byte more does not, wherever the chunks fall."""
    path = events_file(tmp_path / "t.json", [kernel(0.0, name="n" * length)])
    limits = ReadLimits(max_token=1000)
    if reads:
        assert read_trace(path, limits=limits).kernels["name"].str.len().tolist() == [length]
    else:
        with pytest.raises(OptiqError, match="string longer than 1,000 bytes"):
            read_trace(path, limits=limits)


def test_distinct_names_are_bounded_together(tmp_path):
    """Many long distinct names (each within the token limit) are bounded by the text kept, not by the file."""
    events = [kernel(float(i), name=f"{i}_" + "k" * 500) for i in range(100)]
    path = events_file(tmp_path / "t.json", events)
    assert len(read_trace(path, limits=ReadLimits(max_name_bytes=60_000)).kernels) == 100
    with pytest.raises(OptiqError, match="distinct names hold over 20,000 characters"):
        read_trace(path, limits=ReadLimits(max_name_bytes=20_000))


# --- many events ---------------------------------------------------------------------------------------------------

def test_identical_kernels_do_not_grow_memory(tmp_path):
    """300,000 copies of one kernel event (the issue's 10 M took 4 GB): each copy is counted once, so the read
    holds one row."""
    event = json.dumps(kernel(10.0)).encode()
    path = write_gz(tmp_path / "same.json.gz", b'{"traceEvents": [', event, *[b"," + event] * 299_999, b"]}")
    result = optiq_capped("analyze", path, "--json", timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    (scope,) = json.loads(result.stdout)["results"]
    assert scope["summary"]["kernels_per_step"] == 1
    assert "299999 event(s) repeated verbatim counted once" in scope["notes"]


def test_more_events_than_the_limit_is_a_clear_error(tmp_path):
    events = [kernel(float(i), corr=i) for i in range(3000)]
    path = events_file(tmp_path / "t.json", events)
    assert len(read_trace(path, limits=ReadLimits(max_events=3000)).kernels) == 3000
    with pytest.raises(OptiqError, match="more than 2,999 events"):
        read_trace(path, limits=ReadLimits(max_events=2999))


def test_the_event_limit_stops_the_cli_in_bounded_time(tmp_path):
    """Past the event limit (10 M by default; OPTIQ_MAX_TRACE_EVENTS sets it, here small) the read
    stops with the limit named, whatever follows: the trace goes on for 25 times the limit."""
    path = tmp_path / "many.json.gz"
    block = ",".join(json.dumps(kernel(float(i), corr=i)) for i in range(1000)).encode()
    write_gz(path, b'{"traceEvents": [', *[block + b","] * 50, json.dumps(kernel(0.0)).encode(), b"]}")
    result = optiq_capped("analyze", path, timeout=60, OPTIQ_MAX_TRACE_EVENTS="2000")
    assert_clean_failure(result, "holds more than 2,000 events (the limit; OPTIQ_MAX_TRACE_EVENTS raises it)")


@pytest.mark.parametrize("value", ["lots", "0", "-5", ""])
def test_a_bad_event_limit_in_the_environment_is_one_line(tmp_path, monkeypatch, value):
    monkeypatch.setenv("OPTIQ_MAX_TRACE_EVENTS", value)
    with pytest.raises(OptiqError, match="OPTIQ_MAX_TRACE_EVENTS must be a positive whole number of events"):
        read_trace(events_file(tmp_path / "t.json", [kernel(0.0)]))


def test_events_repeated_apart_are_counted_once(tmp_path):
    """The whole event list written three times tripled kernels per step: identical events now count once."""
    events = [annotation("optiq/step/0", 0.0, 100.0), launch(10.0, 1), kernel(20.0, corr=1), launch(30.0, 2),
              kernel(40.0, corr=2, name="other")]
    once = read_trace(events_file(tmp_path / "once.json", events))
    thrice = read_trace(events_file(tmp_path / "thrice.json", events * 3))
    assert step_stats(thrice).drop(columns="marker").equals(step_stats(once).drop(columns="marker"))
    assert list(step_stats(thrice)["kernels"]) == [2] and list(thrice.steps["launches"]) == [2]
    assert "10 event(s) repeated verbatim counted once" in thrice.notes


def run_with_memory_headroom(setup: str, call: str, path, headroom_mb: int) -> subprocess.CompletedProcess:
    """``setup`` run in a fresh interpreter, then ``call`` with its address space capped a few MB above what the
    process maps by then; an OptiqError it raises is printed, exit 1."""
    code = ("import resource, sys\nfrom optiq.errors import OptiqError\n" + setup +
            "vm = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) << 10\n"
            f"resource.setrlimit(resource.RLIMIT_AS, (vm + ({headroom_mb} << 20),) * 2)\n"
            f"try:\n    {call}\nexcept OptiqError as exc:\n    print(exc)\n    sys.exit(1)\n")
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)


def test_out_of_memory_is_one_line(tmp_path):
    """Under a cap the read cannot fit in, the MemoryError (numpy's or Python's) becomes the one-line error; the cap
    leaves room for the interpreter and numpy/pandas, not for 250,000 kernels' columns."""
    path = tmp_path / "big.json.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b'{"traceEvents": [' + ",".join(json.dumps(kernel(float(i), corr=i, name=f"k{i % 1000}"))
                                                for i in range(250_000)).encode() + b"]}")
    result = run_with_memory_headroom("from optiq.traces.reader import read_trace\n", "read_trace(sys.argv[1])", path,
                                      headroom_mb=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "out of memory reading it" in result.stdout


# --- files that are not traces, shapes that are not lists ----------------------------------------------------------

def test_a_fifo_is_named_and_not_opened(tmp_path):
    """Opening a FIFO blocks until a writer comes: it is refused from its stat, at once."""
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    result = optiq_capped("analyze", fifo, timeout=20)
    assert_clean_failure(result, "a named pipe (FIFO), not a trace file")


def test_a_directory_and_a_missing_file_are_named(tmp_path):
    with pytest.raises(OptiqError, match="a directory, not a trace file"):
        read_trace(tmp_path)
    with pytest.raises(OptiqError, match="no such trace file"):
        read_trace(tmp_path / "missing.json")


def test_an_unreadable_file_is_one_line(tmp_path):
    path = events_file(tmp_path / "t.json", [kernel(0.0)])
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads anything
        pytest.skip("running as root: the file stays readable")
    with pytest.raises(OptiqError, match="cannot read it"):
        read_trace(path)


@pytest.mark.parametrize("document, message", [
    ({"traceEvents": {"0": {"cat": "kernel"}}}, "traceEvents is an object, not a list of events"),
    ({"traceEvents": "events"}, "traceEvents is a string, not a list of events"),
    ({"traceEvents": None}, "traceEvents is null, not a list of events"),
    ({"traceEvents": []}, "an empty traceEvents list"),
    ([{"cat": "kernel"}], "the top level is an array, not an object with traceEvents"),
    (3, "the top level is a number, not an object with traceEvents"),
    ({"events": []}, "no traceEvents"),
])
def test_what_stands_in_place_of_the_events_is_said(tmp_path, document, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(document))
    with pytest.raises(OptiqError, match=message) as info:
        read_trace(path)
    assert "\n" not in str(info.value)


# --- numeric nits ----------------------------------------------------------------------------------------------------

def test_cpu_only_trace_without_markers_has_no_negative_idle(tmp_path):
    """A parent op [0, 100) with a child [10, 90): self times 20 and 80 fill the whole trace. The whole-trace step
    once ended at the latest op start plus its self time (90), so idle came out -11%."""
    ops = [annotation("aten::linear", 0.0, 100.0, cat="cpu_op"), annotation("aten::addmm", 10.0, 80.0, cat="cpu_op")]
    trace = read_trace(events_file(tmp_path / "cpu.json", ops))
    steps = step_stats(trace)
    assert trace.cpu_only and steps["wall_us"].tolist() == [100.0] and steps["busy_us"].tolist() == [100.0]
    assert steps["idle_frac"].tolist() == [0.0]


def test_cpu_ops_on_several_threads_never_give_negative_idle(tmp_path):
    ops = [annotation("optiq/step/0", 0.0, 50.0)] + [
        {**annotation("aten::mm", 0.0, 50.0, cat="cpu_op"), "tid": tid} for tid in (1, 2, 3)]
    steps = step_stats(read_trace(events_file(tmp_path / "cpu.json", ops)))
    assert steps["busy_us"].tolist() == [150.0] and steps["idle_frac"].tolist() == [0.0]


def test_negative_step_duration_is_an_instant_not_negative_wall_time(tmp_path):
    events = [annotation("optiq/step/0", 0.0, 100.0), launch(10.0, 1), kernel(20.0, corr=1),
              annotation("optiq/step/1", 200.0, -150.0), launch(210.0, 2), kernel(220.0, corr=2)]
    trace = read_trace(events_file(tmp_path / "t.json", events))
    summary = attribute([trace]).summary
    steps = step_stats(trace)
    assert (steps["wall_us"] >= 0).all() and summary["wall_ms_per_step"] >= 0
    assert ((steps["idle_frac"] >= 0) & (steps["idle_frac"] <= 1)).all()
    assert "1 annotation(s) with a negative duration taken as instants" in trace.notes


def test_kernels_overlapping_from_before_the_wall_time_keep_idle_in_range(tmp_path):
    """A long kernel on another stream that began before the step's wall time counts only the part inside it."""
    events = [kernel(0.0, corr=9, dur=500.0, stream=1), annotation("optiq/step/0", 100.0, 100.0), launch(110.0, 1),
              kernel(120.0, corr=1, dur=10.0)]
    steps = step_stats(read_trace(events_file(tmp_path / "t.json", events)))
    assert (steps["busy_us"] <= steps["wall_us"]).all() and (steps["idle_frac"] >= 0).all()


# --- eager-companion alignment ---------------------------------------------------------------------------------------

def companion_pair(tmp_path: Path, kernels: int, steps: int = 2, dropped: int = 0):
    """An eager trace (each kernel launched by its own aten op inside an optiq/role range) and a graph trace of the
    same kernels replayed by one cudaGraphLaunch a step; the eager one lacks every ``dropped``-th kernel."""
    names = [f"kernel_{i % 97}_{i % 13}" for i in range(kernels)]
    eager, graph, corr = [], [], 0
    for step in range(steps):
        t0 = step * kernels * 10.0
        eager.append(annotation(f"optiq/step/{step}", t0, kernels * 10.0))
        eager.append(annotation("optiq/role/mlp", t0, kernels * 10.0))
        graph.append(annotation(f"optiq/step/{step}", t0, kernels * 10.0))
        graph_corr = corr = corr + 1
        graph.append(launch(t0 + 1, graph_corr, name="cudaGraphLaunch"))
        for i, name in enumerate(names):
            ts = t0 + i * 10.0
            graph.append(kernel(ts + 5, name=name, corr=graph_corr))
            if dropped and i % dropped == dropped - 1:
                continue
            corr += 1
            op = {**annotation("aten::mm", ts, 3.0, cat="cpu_op"), "args": {"External id": corr}}
            eager += [op, launch(ts + 1, corr), kernel(ts + 5, name=name, corr=corr, **{"External id": corr})]
    return events_file(tmp_path / "eager.json", eager), events_file(tmp_path / "graph.json", graph)


def test_alignment_of_long_steps_is_near_linear(tmp_path):
    """32,768 kernels a step took difflib 47 s; every replayed kernel is aligned in a few seconds now."""
    eager, graph = companion_pair(tmp_path, 32_768)
    started = time.monotonic()
    result = optiq_capped("analyze", graph, "--eager-companion", eager, "--json", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    doc = json.loads(result.stdout)["results"][0]
    assert doc["methods"]["alignment"] == pytest.approx(1.0)
    assert any("65536 of 65536 replayed kernels aligned" in note for note in doc["notes"])
    assert time.monotonic() - started < 60


def test_alignment_skips_kernels_the_eager_step_lacks(tmp_path):
    eager, graph = companion_pair(tmp_path, 400, dropped=50)
    from optiq.commands.analyze import align_with_companion

    (trace,) = [read_trace(graph)]
    align_with_companion([trace], str(eager))
    assert (trace.kernels["method"] == "alignment").sum() == 2 * (400 - 8)
    assert set(trace.kernels.loc[trace.kernels["method"] == "alignment", "role"]) == {"mlp"}


@pytest.mark.parametrize("a, b, expected", [
    ("abcdef", "abcdef", 6), ("abcdef", "abdef", 5), ("abdef", "abcdef", 5), ("abcdef", "abXdef", 5),
    ("aaaa", "aa", 2), ("abc", "xyz", 0), ("", "abc", 0), ("ab" * 50 + "c" + "ab" * 50, "ab" * 100, 200),
])
def test_in_order_pairs(a, b, expected):
    i, j = _in_order_pairs(tuple(a), list(b))
    assert len(i) == expected
    assert all(a[x] == b[y] for x, y in zip(i, j))
    assert np.all(np.diff(i) > 0) and np.all(np.diff(j) > 0)


def test_a_gzip_bomb_is_refused_in_seconds(tmp_path):
    """Ten million identical kernels (the issue's 4 GB case) are 1 GB in a few MB of gzip; here one million, 100 MB in
    100 kB: inflating over 250 times past the first 64 MB is refused before the parse costs its time."""
    event = json.dumps(kernel(10.0)).encode()
    block = b"," + b",".join([event] * 10_000)
    path = tmp_path / "bomb.json.gz"
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(b'{"traceEvents": [' + event)
        for _ in range(100):
            f.write(block)
        f.write(b"]}")
    started = time.monotonic()
    with pytest.raises(OptiqError, match="its gzip inflates over 8 times"):
        read_trace(path, limits=ReadLimits(max_inflation=8, inflation_free=1 << 20))
    assert time.monotonic() - started < 5
    result = optiq_capped("analyze", path, timeout=60)
    assert_clean_failure(result, "its gzip inflates over 250 times (a decompression bomb")


def test_many_steps_cost_linear_time(tmp_path):
    """50,000 one-kernel steps: the per-step statistics are vectorised (a loop over steps took ~12 s here, and
    minutes for a million), and every step still gets its own numbers."""
    events = []
    for step in range(50_000):
        t = step * 100.0
        events += [annotation(f"optiq/step/{step}", t, 50.0), launch(t + 1, step), kernel(t + 5, corr=step)]
    trace = read_trace(events_file(tmp_path / "steps.json", events))
    started = time.monotonic()
    steps = attribute([trace]).steps
    assert time.monotonic() - started < 3
    assert len(steps) == 50_000 and (steps["kernels"] == 1).all() and (steps["launches"] == 1).all()
    assert np.allclose(steps["wall_us"], 50.0) and np.allclose(steps["busy_us"], 1.0)


def timed_read(path: Path):
    started = time.monotonic()
    return read_trace(path), time.monotonic() - started


def test_deeply_nested_annotations_cost_linear_time(tmp_path):
    """60,000 role ranges each inside the last, and a kernel launched just after each one ends: the innermost range
    around each launch is found in one sweep (walking up parents launch by launch was quadratic in the depth: 27 s
    here, against 2 s for the same ranges side by side). Timed against that flat twin, so a loaded machine slows
    both."""
    depth = 60_000
    nested, flat = [], []
    for i in range(depth):
        nested.append(annotation(f"optiq/role/r{i}", float(i), 2.0 * (depth - i)))
        flat.append(annotation(f"optiq/role/r{i}", 4.0 * depth + 10.0 * i, 5.0))
    for i in range(1, depth):
        at = 2.0 * depth - i + 0.5  # after range i ends, inside range i - 1
        nested += [launch(at, i), kernel(at + 1, corr=i)]
        flat += [launch(4.0 * depth + 10.0 * i + 1, i), kernel(at + 1, corr=i)]
    trace, nested_s = timed_read(events_file(tmp_path / "nested.json", nested))
    flat_trace, flat_s = timed_read(events_file(tmp_path / "flat.json", flat))
    assert nested_s < 3 * flat_s + 1, (nested_s, flat_s)
    kernels = trace.kernels.sort_values("correlation")
    assert kernels["role"].tolist() == [f"r{i - 1}" for i in range(1, depth)]
    assert flat_trace.kernels.sort_values("correlation")["role"].tolist() == [f"r{i}" for i in range(1, depth)]


def test_many_threads_cost_linear_time(tmp_path):
    """30,000 threads, each with a role range and one launch in it: ranges and launches are matched thread by thread
    through one sorted sweep (a scan of every launch per thread was quadratic in the threads), timed against the
    same events on one thread."""
    spread, single = [], []
    for tid in range(30_000):
        spread += [{**annotation("optiq/role/mlp", 0.0, 10.0), "tid": tid}, {**launch(5.0, tid), "tid": tid},
                   kernel(6.0 + tid, corr=tid)]
        single += [annotation("optiq/role/mlp", 20.0 * tid, 10.0), launch(20.0 * tid + 5, tid),
                   kernel(20.0 * tid + 6, corr=tid)]
    trace, spread_s = timed_read(events_file(tmp_path / "threads.json", spread))
    _, single_s = timed_read(events_file(tmp_path / "single.json", single))
    assert spread_s < 3 * single_s + 1, (spread_s, single_s)
    assert (trace.kernels["role"] == "mlp").all() and len(trace.kernels) == 30_000


def test_out_of_memory_while_attributing_is_one_line(tmp_path):
    """A trace that reads but whose tables do not fit what is left: attribution's MemoryError is the one-line error
    too (the cap is set after the read, a few MB above what the process then maps)."""
    events = [kernel(float(i), corr=i, name=f"k{i % 500}") for i in range(200_000)]
    path = events_file(tmp_path / "big.json", events)
    result = run_with_memory_headroom(
        "from optiq.traces.attribution import attribute\nfrom optiq.traces.reader import read_trace\n"
        "trace = read_trace(sys.argv[1])\n", "attribute([trace], 'kernel')", path, headroom_mb=8)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stdout.strip() == "out of memory attributing the traces (fewer or smaller traces would fit)"
