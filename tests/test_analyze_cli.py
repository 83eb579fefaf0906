"""``optiq analyze`` end to end through click: tables, JSON, CSV, ranks, graph alignment and malformed input."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from data.make_traces import cpu_trace
from optiq.cli import cli

DATA = Path(__file__).parent / "data"
EAGER, GRAPH = str(DATA / "gpu_eager.json.gz"), str(DATA / "gpu_graph.json.gz")


def run(*args):
    return CliRunner().invoke(cli, ["analyze", *args])


def test_table_names_classes_and_attribution_methods():
    result = run(EAGER)
    assert result.exit_code == 0, result.output
    for text in ("copy_", "gemm", "attention", "attributed by linkage 100.0%", "126 kernels, 126 launches per step"):
        assert text in result.output


def test_json_document_matches_the_csv(tmp_path):
    csv = tmp_path / "rows.csv"
    result = run(EAGER, "--by", "role", "--json", "--csv", str(csv))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    (scope,) = doc["results"]
    assert scope["by"] == "role" and scope["methods"]["linkage"] == 1.0 and len(scope["steps"]) == 3
    rows = pd.read_csv(csv)
    assert list(rows["role"]) == [r["role"] for r in scope["table"]]
    assert rows["pct"].sum() == pytest.approx(100)


def test_graph_trace_with_eager_companion_is_attributed_by_alignment():
    result = run(GRAPH, "--eager-companion", EAGER, "--json")
    doc = json.loads(result.stdout)["results"][0]
    assert doc["methods"]["alignment"] == pytest.approx(1.0)
    assert any("378 of 378 replayed kernels aligned" in note for note in doc["notes"])
    plain = json.loads(run(GRAPH, "--json").stdout)["results"][0]
    assert plain["methods"]["name"] + plain["methods"]["none"] == pytest.approx(1.0)
    assert "unattributed" in [row["class"] for row in plain["table"]]


def test_several_files_are_ranks_shown_alone_and_together(tmp_path):
    for rank in (0, 1):
        shutil.copy(EAGER, tmp_path / f"host-TP-{rank}.trace.json.gz")
    result = run(str(tmp_path / "host-TP-1.trace.json.gz"), str(tmp_path / "host-TP-0.trace.json.gz"), "--json")
    scopes = json.loads(result.stdout)["results"]
    assert [s["scope"].split(" · ")[0] for s in scopes] == ["rank 0", "rank 1", "all 2 ranks"]
    assert scopes[2]["summary"]["gpu_ms_per_step"] == pytest.approx(2 * scopes[0]["summary"]["gpu_ms_per_step"])
    assert "all 2 ranks" in run(str(tmp_path / "host-TP-0.trace.json.gz"),
                                str(tmp_path / "host-TP-1.trace.json.gz")).output


def test_cpu_only_trace_says_so(tmp_path):
    result = run(str(cpu_trace(tmp_path / "cpu.json")), "--by", "layer")
    assert result.exit_code == 0, result.output
    assert "no GPU events: attributing CPU op self time instead" in result.output and "CPU ms/step" in result.output


@pytest.mark.parametrize("content, message", [
    (b"\x1f\x8b\x08\x00garbage", "truncated or corrupt gzip"), (b"<html>", "not a JSON trace"),
    (b'{"schemaVersion": 1}', "no traceEvents"),
    (b'{"traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "a", "ts": 1, "dur": 1}]}', "no GPU events"),
])
def test_malformed_input_is_one_line_and_exit_1(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    result = run(str(path))
    assert result.exit_code == 1
    # One line of error; the progress line before it (stderr is no terminal here) says what was being read.
    errors = [line for line in result.stderr.splitlines() if line.startswith("optiq: error: ")]
    assert len(errors) == 1 and message in errors[0] and result.stdout == "" and "Traceback" not in result.output
