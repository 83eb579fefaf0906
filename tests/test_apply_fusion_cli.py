"""`optiq apply-fusion` end to end on the CPU, under the Triton interpreter: auto recipes pass the gate and the run
directory holds the report; a set the gate rejects entirely exits 3 with the numbers that failed it."""

import json
from pathlib import Path

from click.testing import CliRunner
from wrong_kernels import user_recipe

from optiq import record
from optiq.cli import cli
from optiq.errors import EXIT_GATE_REJECTED_ALL

# --min-share 0: auto takes every proposal, whatever share the CPU profile's timing gives it (a 0.1 s pause in the
# sampler's one op, seen late in a long test session, left every other proposal under the default 0.25%)
SMALL = ["--model", "tiny-llama", "--concurrency", "1,2", "--prompt-len", "16", "--new-tokens", "2", "--max-len",
         "64", "--repeats", "1", "--gate-steps", "4", "--min-share", "0", "--json"]


def test_auto_recipes_pass_the_gate_and_the_report_is_written(tmp_path):
    result = CliRunner().invoke(cli, ["apply-fusion", "--recipes", "auto", *SMALL, "--runs-dir", str(tmp_path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    run_dir = Path(doc.pop("run_dir"))
    assert doc.pop("device_kind") == "cpu" and "interpreter" in doc.pop("timing_note")  # what --json adds
    assert json.loads((run_dir / "report.json").read_text()) == doc
    assert record.from_json(doc).command == "apply-fusion"
    fusion = doc["fusion"]
    assert doc["status"] == "complete" and fusion["rolled_back"] == []
    assert "decode_attention" in fusion["applied"], {k: v for k, v in fusion.items() if k != "gate"}  # the largest
    # proposal on the tiny model too
    assert all(r["passed"] for r in fusion["gate"]["recipes"].values())
    assert [e["concurrency"] for e in fusion["gate"]["end_to_end"]] == [1, 2]
    assert all(e["passed"] and e["top1"] == 1.0 for e in fusion["gate"]["end_to_end"])  # fp32: identical greedy picks
    for key in ("before", "after"):
        assert [(r["concurrency"], r["status"]) for r in doc[key]] == [(1, "ok"), (2, "ok")]
    assert set(doc["attribution_before"]) == set(doc["attribution_after"]) == {"1", "2"}
    assert fusion["proposals"]["1"][0]["recipe"] in fusion["applied"]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "complete"
    markdown = (run_dir / "report.md").read_text()
    assert "decode_attention" in markdown and (run_dir / "report.html").stat().st_size > 1_000_000  # plotly inlined


def test_a_set_the_gate_rejects_exits_3_and_keeps_the_numbers(tmp_path):
    user_recipe(tmp_path / "mine", "rmsnorm", "eps_less_norm", fusion="wrong_kernels:norm_without_eps")
    result = CliRunner().invoke(cli, ["apply-fusion", "--recipes", "eps_less_norm", "--recipes-dir",
                                      str(tmp_path / "mine"), *SMALL, "--runs-dir", str(tmp_path / "runs")])
    assert result.exit_code == EXIT_GATE_REJECTED_ALL, result.stderr
    doc = json.loads(result.stdout)
    fusion = doc["fusion"]
    assert doc["status"] == "rejected" and fusion["applied"] == [] and fusion["rolled_back"] == ["eps_less_norm"]
    gate = fusion["gate"]["recipes"]["eps_less_norm"]
    assert not gate["passed"] and gate["err_fused"] > gate["bound"]
    assert doc["after"] == []


def test_auto_chooses_again_without_a_recipe_the_gate_rolled_back(tmp_path):
    """A wrong gate_up_swiglu (a user recipe that replaces the built-in) had kept its rival swiglu out, as both patch
    the MLP: once the gate rolls it back, swiglu is chosen, gated and measured instead."""
    user_recipe(tmp_path / "mine", "gate_up_swiglu", "gate_up_swiglu", fusion="wrong_kernels:gate_up_swapped",
                replaces="gate_up_swiglu")
    result = CliRunner().invoke(cli, ["apply-fusion", "--recipes-dir", str(tmp_path / "mine"), *SMALL, "--runs-dir",
                                      str(tmp_path / "runs")])
    assert result.exit_code == 0, result.stderr
    fusion = json.loads(result.stdout)["fusion"]
    assert fusion["rolled_back"] == ["gate_up_swiglu"]
    assert "swiglu" in fusion["applied"] and "gate_up_swiglu" not in fusion["applied"]
    assert fusion["gate"]["recipes"]["swiglu"]["passed"] and not fusion["gate"]["recipes"]["gate_up_swiglu"]["passed"]
    assert all(e["passed"] for e in fusion["gate"]["end_to_end"])


def test_unknown_recipe_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(cli, ["apply-fusion", "--recipes", "warp_drive", *SMALL, "--runs-dir", str(tmp_path)])
    assert result.exit_code == 1 and "unknown recipe(s) warp_drive" in result.stderr
