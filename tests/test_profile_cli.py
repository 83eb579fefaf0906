"""`optiq profile` on the CPU: a real annotated trace per concurrency, attributed and kept in the run directory."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from optiq.cli import cli
from optiq.traces.reader import read_trace

FAST = ["--prompt-len", "16", "--max-len", "64", "--steps", "2", "--json"]


def test_profile_keeps_traces_and_attributes_every_role(tmp_path):
    result = CliRunner().invoke(cli, ["profile", "--model", "tiny-qwen3-moe", "--concurrency", "1,3", "--by", "role",
                                      *FAST, "--runs-dir", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    run_dir = Path(doc["run_dir"])
    assert json.loads((run_dir / "run.json").read_text())["status"] == "complete"
    assert [r["concurrency"] for r in doc["results"]] == [1, 3]
    for result_doc in doc["results"]:
        batch = result_doc["concurrency"]
        trace = read_trace(run_dir / f"trace_eager_C{batch}.json.gz")
        assert len(trace.steps) == 2
        roles = {row["label"] for row in result_doc["table"]}
        assert {"attention", "qkv_proj", "rope", "kv_write", "norm", "moe_router", "experts", "lm_head",
                "sampling"} <= roles
        assert sum(row["pct"] for row in result_doc["table"]) == pytest.approx(100, abs=0.01)
        saved = json.loads((run_dir / f"attribution_C{batch}.json").read_text())
        assert saved["table"] == result_doc["table"]


def test_profile_rejects_a_cache_too_short(tmp_path):
    result = CliRunner().invoke(cli, ["profile", "--model", "tiny-llama", "--prompt-len", "60", "--max-len", "64",
                                      "--runs-dir", str(tmp_path)])
    assert result.exit_code == 1 and "too short" in result.stderr and "--steps" in result.stderr
