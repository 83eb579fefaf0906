"""The streaming reader against independent json.load computations on real traces (H200 fixtures captured by
tests/data/make_traces.py, CPU traces captured here) and against malformed input."""

import bisect
import gzip
import json
import math
import random
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest

from data.make_traces import cpu_trace
from optiq.errors import OptiqError
from optiq.traces.reader import read_trace

DATA = Path(__file__).parent / "data"
GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


def load(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def write_events(path, events, **top):
    path.write_text(json.dumps({**top, "traceEvents": events}))
    return path


def enclosing(ranges, pid, tid, ts, prefix):
    """Innermost range with ``prefix`` around (pid, tid, ts), by brute force."""
    around = [r for r in ranges if r["name"].startswith(prefix) and r["pid"] == pid and r["tid"] == tid
              and r["ts"] <= ts <= r["ts"] + r["dur"]]
    return max(around, key=lambda r: r["ts"])["name"][len(prefix):] if around else None


@pytest.fixture(scope="module")
def cpu_json(tmp_path_factory):
    return cpu_trace(tmp_path_factory.mktemp("cpu") / "cpu.json")


@pytest.mark.parametrize("fixture", ["gpu_eager", "gpu_graph", "gpu_compiled"])
def test_totals_equal_an_independent_sum_exactly(fixture):
    events = load(DATA / f"{fixture}.json.gz")["traceEvents"]
    expected = defaultdict(list)
    for e in events:
        if e.get("cat") in GPU_CATS:
            expected[e["name"]].append(e["dur"])
    kernels = read_trace(DATA / f"{fixture}.json.gz").kernels
    got = {name: sorted(durs) for name, durs in kernels.groupby("name", observed=True)["dur"]}
    assert got == {name: sorted(durs) for name, durs in expected.items()}  # every duration as written, unrounded
    assert math.fsum(kernels["dur"]) == math.fsum(d for durs in expected.values() for d in durs)


def test_linkage_role_layer_and_step_match_a_brute_force_reading():
    events = load(DATA / "gpu_eager.json.gz")["traceEvents"]
    op_of = {e["args"]["External id"]: e["name"] for e in events if e.get("cat") == "cpu_op"}
    launch_of = {e["args"]["correlation"]: e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    kernels = read_trace(DATA / "gpu_eager.json.gz").kernels.sort_values("ts", ignore_index=True)
    gpu = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    steps = sorted(r["ts"] for r in ranges if r["name"].startswith("optiq/step/"))
    for row, e in zip(kernels.itertuples(), gpu):
        launch = launch_of[e["args"]["correlation"]]
        args = (launch["pid"], launch["tid"], launch["ts"])
        layer, role = enclosing(ranges, *args, "optiq/layer/"), enclosing(ranges, *args, "optiq/role/")
        step = enclosing(ranges, *args, "optiq/step/")
        assert row.op == op_of[e["args"]["External id"]]
        assert row.layer == (int(layer) if layer else -1)
        assert (row.role if isinstance(row.role, str) else None) == (role or ("other" if layer else None))
        assert row.step == steps.index(next(r["ts"] for r in ranges if r["name"] == f"optiq/step/{step}"))
        assert row.method == "linkage" and row.launch == launch["name"]
    assert set(kernels["role"].dropna()) >= {"attention", "mlp", "norm", "qkv_proj", "o_proj", "embed", "lm_head",
                                             "sampling", "rope"}


def test_graph_replay_has_no_ops_and_one_launch_per_step():
    trace = read_trace(DATA / "gpu_graph.json.gz")
    k = trace.kernels
    assert k["graph"].all() and k["op"].isna().all() and (k["launch"] == "cudaGraphLaunch").all()
    assert set(k["method"]) == {"name", "none"}
    assert (k.loc[k["method"] == "none", "op_class"] == "unattributed").all()
    assert list(trace.steps["launches"]) == [1, 1, 1]
    assert list(k.groupby("step").size()) == [126, 126, 126]


def test_event_order_does_not_matter(tmp_path):
    document = load(DATA / "gpu_eager.json.gz")
    random.Random(0).shuffle(document["traceEvents"])
    shuffled = read_trace(write_events(tmp_path / "shuffled.json", document["traceEvents"])).kernels
    original = read_trace(DATA / "gpu_eager.json.gz").kernels
    columns = ["ts", "dur", "op", "role", "layer", "step", "op_class", "method"]
    a = shuffled.sort_values("ts", ignore_index=True)[columns].astype(str)
    b = original.sort_values("ts", ignore_index=True)[columns].astype(str)
    assert a.equals(b)


def test_cpu_only_trace_attributes_cpu_self_time(cpu_json, tmp_path):
    events = load(cpu_json)["traceEvents"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    trace = read_trace(cpu_json)
    assert trace.cpu_only and "no GPU events" in trace.notes[0]
    assert len(trace.kernels) == len(ops) and set(trace.kernels["method"]) == {"cpu_op"}
    # self times add up to the time of the outermost ops, thread by thread
    outer = 0.0
    for e in ops:
        if not any(o is not e and o["tid"] == e["tid"] and o["ts"] <= e["ts"] and
                   e["ts"] + e["dur"] <= o["ts"] + o["dur"] and (o["dur"], -o["ts"]) > (e["dur"], -e["ts"])
                   for o in ops):
            outer += e["dur"]
    assert trace.kernels["dur"].sum() == pytest.approx(outer, rel=1e-9)
    assert (trace.kernels["dur"] >= -1e-6).all()
    assert len(trace.steps) == 2 and set(trace.kernels["step"]) <= {-1, 0, 1}
    assert {"attention", "mlp", "norm", "qkv_proj", "sampling"} <= set(trace.kernels["role"].dropna())
    with open(cpu_json, "rb") as src, gzip.open(tmp_path / "cpu.json.gz", "wb") as dst:
        dst.write(src.read())
    assert read_trace(tmp_path / "cpu.json.gz").kernels["dur"].equals(trace.kernels["dur"])


def launch_pair(ts, corr, name="void at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"):
    """A kernel and its cudaLaunchKernel, shaped as Kineto writes them (no op: the trace lacks cpu_ops)."""
    return [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 7, "tid": 7, "ts": ts, "dur": 2,
             "args": {"correlation": corr}},
            {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts + 5, "dur": 3.25,
             "args": {"correlation": corr, "stream": 7, "device": 0}}]


def marker(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 7, "tid": 7, "ts": ts, "dur": dur}


@pytest.mark.parametrize("decode, prefill, source", [
    ("execute_context_0(0)_generation_4(4)", "execute_context_1(16)_generation_0(0)", "vllm"),
    ("execute_4_context_0(sq0sk0sqsq0sqsk0)_generation_4(sq4sk44sqsq4sqsk44)",
     "execute_5_context_1(sq4sk4sqsq16sqsk16)_generation_1(sq1sk11sqsq1sqsk11)", "vllm"),  # detailed_trace_annotation
    ("execute_new_0_cached_4", "execute_new_1_cached_3", "vllm"),  # builds before Dec 2025
    ("step[DECODE bs=4]", "step[EXTEND bs=1 toks=16]", "sglang"),
    ("step[VERIFY bs=4]", "step[MIXED bs=5]", "sglang"),  # speculative: the target's verify is the decode step
    ("step[TARGET_VERIFY bs=4]", "step[DRAFT_EXTEND bs=4]", "sglang"),  # older speculative builds
])
def test_foreign_step_markers(tmp_path, decode, prefill, source):
    events = [marker(prefill, 0, 50), *launch_pair(10, 1), marker(decode, 100, 50), *launch_pair(110, 2),
              *launch_pair(120, 3), *launch_pair(160, 5), marker(decode, 200, 50), *launch_pair(210, 4)]
    trace = read_trace(write_events(tmp_path / "t.json", events))
    assert trace.step_source == source and len(trace.steps) == 2
    ordered = trace.kernels.sort_values("ts")
    assert list(ordered["step"]) == [-1, 0, 0, -1, 1]
    assert list(ordered["phase"]) == ["draft" if "DRAFT" in prefill else "outside", "step", "step", "sampling", "step"]
    assert list(trace.steps["launches"]) == [2, 1]
    assert any("non-decode" in note for note in trace.notes) or "DRAFT" in prefill
    assert set(trace.kernels["method"]) == {"name"} and set(trace.kernels["op_class"]) == {"copy_"}


def test_no_markers_make_one_step_and_say_so(tmp_path):
    trace = read_trace(write_events(tmp_path / "t.json", launch_pair(0, 1) + launch_pair(50, 2)))
    assert trace.step_source == "whole trace" and len(trace.steps) == 1
    assert (trace.kernels["step"] == 0).all() and "whole trace" in trace.notes[0]


def test_memcpy_and_memset_are_their_own_class(tmp_path):
    events = [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0, "tid": 7,
               "ts": 1, "dur": 2.5, "args": {"correlation": 9, "stream": 7, "device": 0}},
              {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "pid": 0, "tid": 7, "ts": 5, "dur": 1.5,
               "args": {"correlation": 10, "stream": 7, "device": 0}}]
    k = read_trace(write_events(tmp_path / "t.json", events)).kernels
    assert list(k["kind"]) == ["memcpy", "memset"] and set(k["op_class"]) == {"memcpy/memset"}


def test_rank_comes_from_distributed_info(tmp_path):
    path = write_events(tmp_path / "t.json", launch_pair(0, 1), distributedInfo={"rank": 3, "world_size": 4})
    assert read_trace(path).rank == 3


def test_malformed_inputs_raise_one_line_errors(tmp_path):
    good = (DATA / "gpu_eager.json.gz").read_bytes()
    (tmp_path / "truncated.json.gz").write_bytes(good[: len(good) // 2])
    (tmp_path / "not.json").write_text("this is not json {")
    (tmp_path / "nokey.json").write_text(json.dumps({"schemaVersion": 1, "events": []}))
    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": []}))
    write_events(tmp_path / "nogpu.json", [marker("optiq/step/0", 0, 5)])
    cases = {"truncated.json.gz": "truncated or corrupt gzip", "not.json": "not a JSON trace",
             "nokey.json": "no traceEvents", "empty.json": "empty traceEvents", "nogpu.json": "no GPU events",
             "missing.json": "no such trace file"}
    for name, message in cases.items():
        with pytest.raises(OptiqError, match=message) as info:
            read_trace(tmp_path / name)
        assert "\n" not in str(info.value)


def _top_level_ops(events):
    """Per thread, the cpu_ops no other op encloses, sorted by start: ([starts], [(ts, end, name)])."""
    by_thread = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    tops = {}
    for thread, ops in by_thread.items():
        ops.sort(key=lambda op: (op[0], -op[1]))
        outer, reach = [], float("-inf")
        for op in ops:
            if op[0] >= reach:
                outer.append(op)
                reach = op[1]
        tops[thread] = ([op[0] for op in outer], outer)
    return tops


def _top_op_at(tops, thread, ts):
    starts, ops = tops.get(thread, ([], []))
    i = bisect.bisect_right(starts, ts) - 1
    return ops[i][2] if i >= 0 and ops[i][0] <= ts <= ops[i][1] else None


def test_real_gpu_traces_in_traces_dir():
    """Traces captured on an H200 by `optiq profile` (traces/*.json.gz), when present: per-class totals equal an
    independent sum over the raw events, classified the same way, each event counted for its own time (less its
    overlap with the one before on its stream: the after-traces since session 7 launch with PDL)."""
    from optiq.traces.op_classes import class_of_kernel, class_of_op, class_of_top_op

    paths = sorted((Path(__file__).parent.parent / "traces").glob("*.json.gz"))
    if not paths:
        pytest.skip("no traces/*.json.gz yet")
    for path in paths:
        events = load(path)["traceEvents"]
        op_of = {e["args"].get("External id"): e["name"] for e in events if e.get("cat") == "cpu_op"}
        launch_of = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
        tops = _top_level_ops(events)
        expected, reach = defaultdict(float), {}
        for e in sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"]):
            lane = (e["args"].get("device"), e["args"].get("stream"))
            own = e["dur"] - min(max(reach.get(lane, -math.inf) - e["ts"], 0.0), e["dur"])
            reach[lane] = max(reach.get(lane, -math.inf), e["ts"] + e["dur"])
            op = op_of.get(e["args"].get("External id"))
            launch = launch_of.get(e["args"].get("correlation"))
            graph = launch is not None and launch["name"] == "cudaGraphLaunch"
            top = _top_op_at(tops, (launch["pid"], launch["tid"]), launch["ts"]) if launch and op else None
            if e["cat"] != "kernel":
                cls = "memcpy/memset"
            elif op is not None and not graph and top is not None and class_of_top_op(top):
                cls = class_of_top_op(top)
            elif op is not None and not graph and class_of_op(op) != "other":
                cls = class_of_op(op)
            else:
                cls = class_of_kernel(e["name"])
                cls = "unattributed" if cls == "other" and (op is None or graph) else cls
            expected[cls] += own
        got = read_trace(path).kernels.groupby("op_class")["dur"].sum().to_dict()
        assert got == pytest.approx(dict(expected), rel=1e-9), path.name


def test_ranks_with_clock_offsets_attribute_as_if_aligned(tmp_path):
    """Each rank's clock starts anywhere (here 0 and 5e12 us later, and 3.7 s earlier): steps, idle gaps and totals
    are measured within a rank, so the offsets change nothing, alone or all ranks together."""
    from optiq.traces.attribution import attribute
    from optiq.commands.analyze import read_ranks

    doc = load(DATA / "gpu_eager.json.gz")

    def shifted(rank, offset):
        events = [dict(e, ts=e["ts"] + offset) if "ts" in e else e for e in doc["traceEvents"]]
        return str(write_events(tmp_path / f"rank{rank}_{offset}.json", events, distributedInfo={"rank": rank}))

    aligned = attribute(read_ranks([shifted(0, 0), shifted(1, 0)])[0], "class")  # (ranks, notes)
    offset = attribute(read_ranks([shifted(0, 5e12), shifted(1, -3.7e6)])[0], "class")
    pd.testing.assert_frame_equal(aligned.table, offset.table)  # to 1e-5: float timestamps near 5e12 us keep ~1 ns
    for key, value in aligned.summary.items():
        assert offset.summary[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key
    single = attribute([read_trace(DATA / "gpu_eager.json.gz")], "class")
    assert offset.summary["gpu_ms_per_step"] == pytest.approx(2 * single.summary["gpu_ms_per_step"])  # both ranks


def test_gpu_events_without_a_usable_duration_are_left_out_and_said(tmp_path):
    negative, missing = launch_pair(20, 2), launch_pair(40, 3)
    negative[1]["dur"] = -4.0
    del missing[1]["dur"]
    trace = read_trace(write_events(tmp_path / "t.json", launch_pair(0, 1) + negative + missing))
    assert list(trace.kernels["dur"]) == [3.25]
    assert "2 GPU event(s) without a duration or with a negative one left out" in trace.notes


def test_kernels_launched_with_pdl_count_their_own_time_once():
    """A session-7 after-trace (qwen3-0.6b, CUDA graph, kernels launched with programmatic dependent launch on one
    stream): in the file each kernel starts while its predecessor runs, so the raw durations add up to far more than
    the steps; read, each counts from its predecessor's end, and a step's kernel time is its busy time, within its
    wall time."""
    from optiq.traces.attribution import step_stats

    path = Path(__file__).parent.parent / "traces" / "qwen3-0.6b_fused_graph_C1.json.gz"
    raw = sum(e["dur"] for e in load(path)["traceEvents"] if e.get("cat") in GPU_CATS)
    trace = read_trace(path)
    assert raw > 1.3 * trace.kernels["dur"].sum()
    steps = step_stats(trace)
    assert len(steps) == 2
    assert (steps["kernel_us"] - steps["busy_us"]).abs().max() < 1e-3
    assert (steps["kernel_us"] <= steps["wall_us"]).all()
