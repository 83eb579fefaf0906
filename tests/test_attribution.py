"""Attribution tables, per-step stats and graph/eager alignment on the real H200 fixtures."""

import math
from pathlib import Path

import numpy as np
import pytest

from optiq.traces.attribution import _busy_per_group, align_graph_with_eager, attribute
from optiq.traces.reader import read_trace

DATA = Path(__file__).parent / "data"


def read(name):
    return read_trace(DATA / f"{name}.json.gz")


def busy(ts, dur, start=-np.inf):
    return _busy_per_group(np.zeros(len(ts), np.int64), ts, dur, np.full(len(ts), start), 1)[0]


def test_busy_time_counts_overlap_once():
    ts = np.array([0.0, 1.0, 10.0, 2.0])
    dur = np.array([4.0, 2.0, 2.0, 3.0])
    assert busy(ts, dur) == 7.0  # [0, 5) and [10, 12)
    assert busy(ts[:1] + 5e12, np.array([1.024])) == 1.024
    assert busy(ts, dur, start=3.0) == 4.0  # [3, 5) and [10, 12): what ran before the start is not the step's


def test_busy_time_is_per_group():
    group = np.array([1, 0, 1, 0])
    got = _busy_per_group(group, np.array([0.0, 0.0, 1.0, 5.0]), np.array([2.0, 1.0, 2.0, 1.0]), np.zeros(4), 3)
    assert got.tolist() == [2.0, 3.0, 0.0]


def test_class_table_adds_up_to_the_kernel_table():
    trace = read("gpu_eager")
    a = attribute([trace])
    k = trace.kernels
    steps = len(trace.steps)
    assert steps == 3 and a.summary["kernels_per_step"] == 126 and a.summary["launches_per_step"] == 126
    assert a.table["kernels_per_step"].sum() == pytest.approx(len(k) / steps)
    assert a.table["pct"].sum() == pytest.approx(100)
    for row in a.table.itertuples():
        mine = k[k["op_class"] == row._1]
        assert row.gpu_ms_per_step == pytest.approx(math.fsum(mine["dur"]) / steps / 1000, rel=1e-12)
        assert row.mean_us == pytest.approx(mine["dur"].mean(), rel=1e-12)
    assert a.methods["linkage"] == 1.0
    copy = a.table.set_index("class").loc["copy_"]
    assert "direct_copy_kernel_cuda" in copy["top_kernels"] and "attention: aten::reshape" in copy["where"]


def test_step_stats_show_the_launch_bound_eager_step():
    a = attribute([read("gpu_eager")])
    steps = a.steps
    assert list(steps["kernels"]) == [126] * 3 and list(steps["launches"]) == [126] * 3
    assert ((steps["busy_us"] <= steps["wall_us"]) & (steps["idle_frac"] > 0.5) & (steps["idle_frac"] < 1)).all()
    assert (steps["busy_us"] <= steps["kernel_us"] + 1e-9).all()


def test_graph_trace_without_companion_reports_name_and_unattributed_time():
    a = attribute([read("gpu_graph")])
    assert a.methods["linkage"] == 0 and a.methods["name"] + a.methods["none"] == pytest.approx(1)
    assert a.methods["none"] > 0
    unattributed = a.table.set_index("class").loc["unattributed"]
    assert unattributed["pct"] == pytest.approx(100 * a.methods["none"])
    assert a.summary["launches_per_step"] == 1 and a.summary["kernels_per_step"] == 126


def test_alignment_gives_graph_kernels_their_eager_ops_roles_and_layers():
    graph, eager = read("gpu_graph"), read("gpu_eager")
    assert align_graph_with_eager(graph, eager) == len(graph.kernels)
    a = attribute([graph])
    assert a.methods["alignment"] == pytest.approx(1)
    by_class = a.table.set_index("class")["kernels_per_step"]
    assert by_class.to_dict() == attribute([eager]).table.set_index("class")["kernels_per_step"].to_dict()
    roles = attribute([graph], by="role").table.set_index("role")
    assert roles.loc["mlp", "kernels_per_step"] == pytest.approx(10) and "gemm" in roles.loc["mlp", "where"]
    assert set(attribute([graph], by="layer").table["layer"]) == {0, 1, "(no layer)"}


def test_alignment_tolerates_a_kernel_the_eager_step_lacks():
    graph, eager = read("gpu_graph"), read("gpu_eager")
    first = eager.kernels[eager.kernels["step"] >= 0].sort_values("ts").index
    eager.kernels = eager.kernels.drop(index=[first[k * 126 + 5] for k in range(3)])  # one kernel gone per step
    aligned = align_graph_with_eager(graph, eager)
    assert aligned == len(graph.kernels) - 3
    assert set(graph.kernels["method"]) == {"alignment", "name"}


def test_ranks_together_sum_per_step_time():
    one, other = read("gpu_eager"), read("gpu_eager")
    other.rank = 1
    single = attribute([one])
    both = attribute([one, other])
    assert both.summary["gpu_ms_per_step"] == pytest.approx(2 * single.summary["gpu_ms_per_step"])
    assert both.table["pct"].tolist() == pytest.approx(single.table["pct"].tolist())
    assert len(both.steps) == 6 and set(both.steps["rank"]) == {0, 1}


def test_kernel_grouping_keeps_full_names_and_short_labels():
    t = attribute([read("gpu_eager")], by="kernel", top=2).table
    assert t["kernel"].is_unique and t["label"].str.len().max() <= 60
    assert t["pct"].sum() == pytest.approx(100)


def test_unknown_grouping_is_rejected():
    with pytest.raises(ValueError):
        attribute([read("gpu_eager")], by="module")
