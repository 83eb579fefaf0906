"""Fuzz the trace reader: 10,000+ generated and mutated traces, seeded from the real H200 traces in traces/, must each
read into a Trace or fail with a one-line OptiqError; any other exception is a reader bug.

The last test draws size and depth instead (nesting, long strings and numbers, event and name counts) against small
ReadLimits, and holds the reader to refusing exactly the documents that break a limit.

Examples are derandomized so CI runs are reproducible; traces stay small (a few hundred events) so the whole file
runs in about two minutes on two cores.
"""

import functools
import gzip
import json
import math
import random
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optiq.errors import OptiqError
from optiq.traces.reader import ReadLimits, Trace, read_trace

TRACES = Path(__file__).parent.parent / "traces"
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
FIELDS = ("ts", "dur", "name", "cat", "ph", "pid", "tid", "args")
ARG_FIELDS = ("External id", "correlation", "device", "stream")
RAW = "__optiq_fuzz_raw__"  # a name replaced by raw (possibly invalid UTF-8) bytes after serialization
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.sampled_from([2 ** 63, -(2 ** 63) - 1, 10 ** 30]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.sampled_from(["optiq/step/x", "optiq/layer/²", "optiq/layer/99999999999999999999", "optiq/role/",
                     "optiq/step/12", "step[DECODE bs=4]", "execute_context_0(0)_generation_1(1)", RAW]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
)


def _seed_events(path: Path, kernels: int) -> list[dict]:
    """A linked slice of one trace: ``kernels`` kernels from its middle with their launches, ops, flow events and
    the annotations around the launches, plus the metadata events."""
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    gpu = [e for e in events if e.get("cat") == "kernel"]
    picked = gpu[len(gpu) // 2:len(gpu) // 2 + kernels]
    corr = {e["args"].get("correlation") for e in picked}
    ext = {e["args"].get("External id") for e in picked} - {None}
    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and e["args"].get("correlation") in corr]
    lo, hi = min(e["ts"] for e in launches), max(e["ts"] for e in launches)
    around = [e for e in events if e.get("cat") in ("user_annotation", "cpu_op") and e["ts"] <= hi
              and e["ts"] + e.get("dur", 0) >= lo and (e["cat"] == "user_annotation" or e["args"].get("External id")
                                                     in ext)]
    flows = [e for e in events if e.get("cat") == "ac2g" and e.get("id") in corr][:kernels]  # a graph's share one id
    meta = [e for e in events if e.get("ph") == "M"][:5]
    return meta + around + launches + picked + flows


@functools.cache
def _seeds() -> list[list[dict]]:
    """Loaded once, and not as a fixture: hypothesis would print its 200 kB repr with every failure."""
    paths = [TRACES / "qwen3-0.6b_eager_C1.json.gz", TRACES / "qwen3-0.6b_graph_C1.json.gz"]
    if not all(p.is_file() for p in paths):
        pytest.skip("no traces/*.json.gz to seed from")
    return [_seed_events(paths[0], 30), _seed_events(paths[1], 45)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _check(path: Path):
    """The property: a Trace, or an OptiqError of one line."""
    try:
        assert isinstance(read_trace(path), Trace)
    except OptiqError as exc:
        assert str(exc) and "\n" not in str(exc), repr(str(exc))


def _mutate_event(event: dict, rnd: random.Random, junk) -> dict:
    """One event with a field deleted, retyped or pushed out of range (top level or in args)."""
    event = json.loads(json.dumps(event))
    target = event
    if rnd.random() < 0.4 and isinstance(event.get("args"), dict):
        target, key = event["args"], rnd.choice(ARG_FIELDS)
    else:
        key = rnd.choice(FIELDS)
    what = rnd.randrange(5)
    if what == 0:
        target.pop(key, None)
    elif what == 1 and key in ("dur", "ts"):
        target[key] = -abs(target.get(key, 1.0) if isinstance(target.get(key), (int, float)) else 1.0)
    elif what == 2 and key == "cat":
        target[key] = rnd.choice(["kernel", "cpu_op", "cuda_runtime", "user_annotation", "gpu_memcpy", "bogus", ""])
    elif what == 2 and key == "ph":
        target[key] = rnd.choice(["X", "B", "E", "i", "f", "M", "?"])
    else:
        target[key] = junk
    return event


def _serialize(trace, raw_bytes: bytes, compress: bool) -> bytes:
    data = json.dumps(trace, allow_nan=True).encode().replace(RAW.encode(), raw_bytes)
    return gzip.compress(data, mtime=0) if compress else data


@st.composite
def traces(draw, seeds):
    """A random subset of one seed trace, reordered, with events dropped, duplicated and mutated."""
    rnd = draw(st.randoms(use_true_random=False))
    seed = seeds[draw(st.integers(0, len(seeds) - 1))]
    events = rnd.sample(seed, rnd.randint(0, len(seed)))
    if draw(st.booleans()):
        events.sort(key=lambda e: e.get("ts", 0))
    for _ in range(draw(st.integers(0, 8))):
        if not events:
            break
        i, what = rnd.randrange(len(events)), rnd.randrange(4)
        if what == 0:
            events.append(events[i])
        elif what == 1:
            del events[i]
        else:
            events[i] = _mutate_event(events[i], rnd, draw(JUNK))
    if draw(st.integers(0, 9)) == 0:
        events.insert(rnd.randint(0, len(events)), draw(JUNK))  # a non-object event
    trace = {"schemaVersion": 1, "traceEvents": events}
    if draw(st.integers(0, 19)) == 0:
        trace = draw(st.sampled_from([{"traceEvents": draw(JUNK)}, {}, events, draw(JUNK)]))
    return trace


@given(data=st.data())
@settings(FUZZ, max_examples=5500)
def test_generated_traces_read_or_fail_clearly(workdir, data):
    trace = data.draw(traces(_seeds()))
    raw = data.draw(st.binary(max_size=6)) + b"\xff\xc3("
    compress = data.draw(st.booleans())
    path = workdir / ("gen.json.gz" if compress else "gen.json")
    path.write_bytes(_serialize(trace, b'"' + raw.replace(b'"', b"") + b'"', compress))
    _check(path)


@given(data=st.data())
@settings(FUZZ, max_examples=4500)
def test_byte_mutated_files_read_or_fail_clearly(workdir, data):
    rnd = data.draw(st.randoms(use_true_random=False))
    seeds = _seeds()
    seed = seeds[data.draw(st.integers(0, len(seeds) - 1))]
    compress = data.draw(st.booleans())
    blob = bytearray(_serialize({"traceEvents": seed[:rnd.randint(1, 60)]}, b"", compress))
    for _ in range(data.draw(st.integers(1, 4))):
        what, at = rnd.randrange(3), rnd.randrange(len(blob) + 1)
        if what == 0:
            del blob[at:]
        elif what == 1 and at < len(blob):
            blob[at] ^= 1 << rnd.randrange(8)
        else:
            blob[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    path = workdir / ("bytes.json.gz" if compress else "bytes.json")
    path.write_bytes(bytes(blob))
    _check(path)


def test_seed_traces_themselves_read(workdir):
    """The unmutated seeds must read, or the fuzz tests above only exercise the error paths."""
    for i, seed in enumerate(_seeds()):
        path = workdir / f"seed{i}.json"
        path.write_bytes(_serialize({"traceEvents": seed}, b"", False))
        trace = read_trace(path)
        assert len(trace.kernels) and math.isfinite(trace.kernels["dur"].sum())


KERNEL = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10.0, "dur": 1.0, "args": {}}


@pytest.mark.parametrize("events, message", [
    ([None], "malformed trace event"),  # a non-object event
    ([{**KERNEL, "cat": "cpu_op", "args": False}], "malformed trace event"),  # args not an object
    ([{**KERNEL, "name": None}], "name None is not a string"),  # classified by name later
    ([{**KERNEL, "name": 5}], "name 5 is not a string"),
    ([{**KERNEL, "name": [1]}], "malformed trace event"),  # unhashable, so refused before the name check
])
def test_crashes_the_fuzzer_found_are_clear_errors(tmp_path, events, message):
    """Regressions: each of these once raised AttributeError or TypeError out of read_trace."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    with pytest.raises(OptiqError, match=message) as info:
        read_trace(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("label", ["²", "99999999999999999999"])
def test_layer_labels_int_refuses_mean_no_layer(tmp_path, label):
    """Regression: "optiq/layer/²" passed isdigit() and crashed int(); a 20-digit label overflowed int64."""
    events = [{"ph": "X", "cat": "user_annotation", "name": f"optiq/layer/{label}", "pid": 1, "tid": 1, "ts": 0.0,
               "dur": 100.0}, {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                               "ts": 5.0, "dur": 1.0, "args": {"correlation": 3}},
              {**KERNEL, "args": {"correlation": 3}}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert read_trace(path).kernels["layer"].tolist() == [-1]


# Size and depth: documents that nest, hold long strings and numbers, and many events around small limits (the same
# checks as the defaults, scaled down so each example is a few kB). The property is exact: the read is refused, for
# one of the limits the document breaks, if and only if it breaks one.
SMALL = ReadLimits(max_depth=24, max_token=64, max_events=40, max_name_bytes=200)


def hostile_text(longest: int):
    """Text of brackets, quotes, backslashes and separators (all escaped or counted apart by the reader), its length
    drawn first so that long texts come as often as short ones."""
    return st.integers(0, longest).flatmap(
        lambda size: st.text(st.sampled_from('[]{}"\\ab,:é'), min_size=size, max_size=size))


LONG_NUMBER = "__optiq_fuzz_number__"  # the string "LONG_NUMBER000..." is written as the number 1000....5 (a
# float: yajl refuses integers past int64 as an overflow, and json.dumps writes no float this long)


def _write_numbers(data: bytes) -> bytes:
    return re.sub(rb'"' + LONG_NUMBER.encode() + rb'(0*)"', lambda m: b"1" + m.group(1) + b".5", data)


@st.composite
def nested(draw, levels: int):
    """A JSON value that nests exactly ``levels`` arrays/objects, with a leaf that may itself be long."""
    value = draw(st.one_of(st.integers(0, 2 * SMALL.max_token).map(lambda zeros: LONG_NUMBER + "0" * zeros),
                           hostile_text(2 * SMALL.max_token), st.none()))
    for _ in range(levels):
        value = [value] if draw(st.booleans()) else {draw(hostile_text(8)): value}
    return value


def _strings_and_numbers(value):
    """Every string (keys included) and number in a JSON value, as they are written."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings_and_numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings_and_numbers(item)
    elif value is not None:
        yield value


@st.composite
def sized_documents(draw):
    """(document, the limits it breaks): well-formed kernel events, with a nested value under an ignored key, in an
    event's args or as a kernel's name, and a number of events around the event limit."""
    n = draw(st.integers(1, SMALL.max_events + 3))
    names = draw(st.lists(hostile_text(SMALL.max_token + 4).filter(bool), min_size=1, max_size=6))
    events = [{"ph": "X", "cat": "kernel", "name": names[i % len(names)], "pid": 0, "tid": 1, "ts": float(i),
               "dur": 1.0, "args": {"correlation": i}} for i in range(n)]
    levels = draw(st.integers(0, SMALL.max_depth))
    value = draw(nested(levels))
    where = draw(st.sampled_from(["top", "args"]))
    document = {"traceEvents": events}
    if where == "top":
        document["otherData"] = value
        depth = 1 + levels
    else:
        events[draw(st.integers(0, n - 1))]["args"]["extra"] = value
        depth = 4 + levels
    tokens = [len(v) - len(LONG_NUMBER) + 3 if v.startswith(LONG_NUMBER) else len(json.dumps(v)) - 2
              for v in _strings_and_numbers(document) if isinstance(v, str)]
    broken = {reason for reason, over in (
        ("deeper than", depth > SMALL.max_depth), ("longer than", max(tokens) > SMALL.max_token),
        ("events", n > SMALL.max_events),
        ("distinct names", sum(map(len, set(names[:n]))) > SMALL.max_name_bytes)) if over}
    return document, broken


@given(data=st.data())
@settings(FUZZ, max_examples=300)
def test_size_and_depth_are_refused_exactly_at_the_limits(workdir, data):
    document, broken = data.draw(sized_documents())
    compress = data.draw(st.booleans())
    path = workdir / ("sized.json.gz" if compress else "sized.json")
    data_bytes = _write_numbers(json.dumps(document).encode())
    path.write_bytes(gzip.compress(data_bytes, mtime=0) if compress else data_bytes)
    try:
        trace = read_trace(path, limits=SMALL)
    except OptiqError as exc:
        message = str(exc)
        assert "\n" not in message and broken and "refused" in message, (message, broken)
        assert any(reason in message for reason in broken), (message, broken)
    else:
        assert not broken, broken
        assert len(trace.kernels) == len(document["traceEvents"])
