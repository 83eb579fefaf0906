"""`optiq bench` end to end on the CPU: JSON output, run directories, out-of-memory points, clear errors."""

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from optiq import engine as decode_engine
from optiq import record
from optiq.cli import cli
from optiq.errors import EXIT_GATE_REJECTED_ALL
from optiq.measure.sweep import compiled_forward, sweep
from optiq.models import load_model
from optiq.record import Workload
from optiq.report import time_to_optimized

FAST = ["--model", "tiny-llama", "--prompt-len", "8", "--new-tokens", "4", "--max-len", "32", "--repeats", "2"]


def run_cli(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def without_printed_keys(doc: dict) -> dict:
    """``--json``'s document less what it adds to the run record (bench --help names them)."""
    return {k: v for k, v in doc.items() if k not in ("run_dir", "device_kind", "timing_note")}


def rows(doc: dict) -> list[dict]:
    """Every measured point of a bench run record, in the order measured."""
    return doc["before"] + doc["after"]


def test_bench_json_has_positive_throughput_per_concurrency(tmp_path):
    result = run_cli("bench", *FAST, "--concurrency", "1,2", "--json", "--runs-dir", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [row["concurrency"] for row in rows(doc)] == [1, 2]
    for row in rows(doc):
        assert row["status"] == "ok" and row["tok_per_s"] > 0 and 0 < row["floor_ms_per_step"] < row["ms_per_step"]
        assert row["tok_per_s"] == pytest.approx(row["concurrency"] * 1e3 / row["ms_per_step"])
    run_dir = tmp_path / doc["run_dir"].rsplit("/", 1)[-1]
    saved = json.loads((run_dir / "results.json").read_text())
    assert saved == without_printed_keys(doc) and record.from_json(saved).command == "bench"
    assert doc["device_kind"] == "cpu" and "say nothing about a GPU" in doc["timing_note"]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "complete"
    assert (run_dir / "results.csv").read_text().count("\n") == 3


def test_hf_peer_is_hfs_own_step_beside_the_engine(tmp_path):
    """--compare hf adds HF's own step (its own cache, eager) as rows of their own, first, beside the engine's."""
    result = run_cli("bench", *FAST, "--concurrency", "1,2", "--compare", "hf", "--json", "--runs-dir", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    measured = rows(json.loads(result.stdout))
    assert [(row["variant"], row["mode"], row["concurrency"]) for row in measured] == [
        ("hf", "eager", 1), ("hf", "eager", 2), ("eager", "eager", 1), ("eager", "eager", 2)]
    assert all(row["status"] == "ok" and row["tok_per_s"] > 0 for row in measured)


def test_the_table_gives_each_point_over_hfs_own_step_and_over_compile():
    """With hf and compile among the variants each ratio column divides by its own baseline at the same C."""
    from optiq.commands.views import results_table
    point = dict(ms_per_step=1.0, floor_ms_per_step=0.5, pct_of_floor=50.0, prefill_ms=1.0, warmup_s=0.1)
    points = [record.Row(variant, "graph", 16, "ok", tok_per_s=tok_per_s, **point)
              for variant, tok_per_s in (("hf", 100.0), ("compile+graph", 400.0), ("optiq+graph", 1000.0))]
    table = results_table(points, "t")
    ratios = [table.columns.index("× hf"), table.columns.index("× compile")]
    assert [[row[i].plain for i in ratios] for row in table.rows] == [["1.00", "0.25"], ["4.00", "1.00"],
                                                                    ["10.00", "2.50"]]


def test_two_runs_never_share_a_directory(tmp_path):
    runs = tmp_path / "runs"
    first = json.loads(run_cli("bench", *FAST, "--concurrency", "1", "--json", "--runs-dir", str(runs)).stdout)
    second = json.loads(run_cli("bench", *FAST, "--concurrency", "1", "--json", "--runs-dir", str(runs)).stdout)
    assert first["run_dir"] != second["run_dir"]
    assert len(list(runs.iterdir())) == 2


def test_out_of_memory_concurrency_is_recorded_and_the_sweep_goes_on(tmp_path):
    # A billion sequences' KV cache (terabytes) cannot be allocated; the points either side still run.
    result = run_cli("bench", *FAST, "--concurrency", "1,1000000000,2", "--json", "--runs-dir", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    points = rows(json.loads(result.stdout))
    assert [r["status"] for r in points] == ["ok", "oom", "ok"]
    assert points[1]["concurrency"] == 1_000_000_000 and points[1]["error"]


def test_table_output(tmp_path):
    result = run_cli("bench", *FAST, "--concurrency", "1", "--runs-dir", str(tmp_path))
    assert result.exit_code == 0
    assert "tok/s" in result.stdout and "% of floor" in result.stdout and "run directory:" in result.stdout


@pytest.mark.parametrize(("args", "message", "code"), [
    (["--model", "nope"], "unknown model 'nope'", 1),
    (["--concurrency", "1,x"], "comma-separated list of integers", 2),  # checked as the flags are parsed: usage
    (["--concurrency", "0"], "positive integers", 2),
    (["--max-len", "10"], "too short", 1),
    (["--dtype", "fp4"], "unknown dtype", 1),
])
def test_bad_input_is_one_line_and_a_non_zero_exit(tmp_path, args, message, code):
    result = run_cli("bench", *FAST, *args, "--runs-dir", str(tmp_path))
    assert result.exit_code == code
    # One line says what is wrong (click's usage text around a usage error's); before optiq's, stderr (no terminal
    # here) may hold progress lines ("optiq: loading").
    lines = result.stderr.splitlines()
    (error,) = [line for line in lines if line.startswith(("optiq: error: ", "Error: "))]
    assert message in error and (code == 2 or all(line.startswith("optiq: ") for line in lines))
    assert "Traceback" not in result.stderr


def test_graph_mode_without_cuda_is_a_clear_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = run_cli("bench", *FAST, "--mode", "graph", "--runs-dir", str(tmp_path))
    assert result.exit_code == 1 and "needs a CUDA device" in result.stderr


def test_python_dash_m_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "optiq", "bench", *FAST, "--concurrency", "1", "--json",
                           "--runs-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["before"][0]["tok_per_s"] > 0


def test_a_failing_peer_is_recorded_and_the_sweep_goes_on():
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))

    def broken_peer(**kwargs):
        raise RuntimeError("inductor gave up")

    variants = [("eager", "eager", None), ("compile+eager", "eager", broken_peer)]
    points = sweep(model, [1, 2], Workload(8, 2, 32, 1), variants, bandwidth=1e11)
    assert [(r.variant, r.status) for r in points] == [
        ("eager", "ok"), ("eager", "ok"), ("compile+eager", "failed"), ("compile+eager", "failed")]
    assert points[2].error == "RuntimeError: inductor gave up"
    from optiq.commands.views import results_table  # the console says why a point has no number
    assert "compile+eager C=2: RuntimeError: inductor gave up" in results_table(points, "t").caption


def test_a_peer_past_its_warm_up_budget_says_so_and_the_next_peer_compiles():
    """torch.compile of a real model, stopped by the budget mid-compile: a failed row with why, its other
    concurrency not tried, and what it left behind reset, so that torch.compile works again afterwards."""
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    workload = Workload(8, 2, 32, 1)
    variants = [("compile+eager", "eager", compiled_forward(model))]
    points = sweep(model, [1, 2], workload, variants, bandwidth=1e11, peer_budget_s=0.05)
    assert [(r.variant, r.concurrency, r.status) for r in points] == [("compile+eager", 1, "failed"),
                                                                       ("compile+eager", 2, "failed")]
    assert points[0].error == ("over budget: its warm-up at C=1 did not finish within 0.05 s (--peer-budget)")
    assert points[1].error.startswith("not tried: its warm-up at C=1")
    again = sweep(model, [1], workload, [("compile+eager", "eager", compiled_forward(model))], bandwidth=1e11,
                  peer_budget_s=600)
    assert again[0].status == "ok" and again[0].tok_per_s > 0


def test_recipes_add_the_gated_optiq_variant_beside_the_baseline(tmp_path):
    """One run: the unpatched model, then the model fused with the named recipes, each gated, with its wait."""
    result = run_cli("bench", *FAST, "--concurrency", "1,2", "--recipes", "rmsnorm,greedy_sample", "--gate-steps", "3",
                     "--json", "--runs-dir", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [(r["variant"], r["concurrency"], r["status"]) for r in rows(doc)] == [
        ("eager", 1, "ok"), ("eager", 2, "ok"), ("optiq+eager", 1, "ok"), ("optiq+eager", 2, "ok")]
    fusion = doc["fusion"]
    assert fusion["applied"] == ["rmsnorm", "greedy_sample"] and fusion["rolled_back"] == []
    # The run unpatched its model: the engine's sampler (a function patch, global to the process) is torch's again.
    assert decode_engine.sample_greedy.__module__ == "optiq.engine"
    assert all(r["passed"] for r in fusion["gate"]["recipes"].values())
    assert [e["concurrency"] for e in fusion["gate"]["end_to_end"]] == [1, 2]
    timings = fusion["timings"]
    saved = json.loads((tmp_path / doc["run_dir"].rsplit("/", 1)[-1] / "results.json").read_text())
    assert saved == without_printed_keys(doc) and "interpreter" in doc["timing_note"]
    assert timings["capture_s"] > 0 and time_to_optimized(record.from_json(saved)) == (
        pytest.approx(timings["patch_s"] + timings["gate_s"] + timings["capture_s"]), None)


def test_a_recipe_the_gate_rejects_is_not_measured_and_exits_3(tmp_path):
    from wrong_kernels import user_recipe

    user_recipe(tmp_path / "mine", "rmsnorm", "eps_less_norm", fusion="wrong_kernels:norm_without_eps")
    result = run_cli("bench", *FAST, "--concurrency", "1", "--recipes", "eps_less_norm", "--recipes-dir",
                     str(tmp_path / "mine"), "--gate-steps", "3", "--runs-dir", str(tmp_path / "runs"))
    assert result.exit_code == EXIT_GATE_REJECTED_ALL, result.stderr
    assert "rolled back eps_less_norm" in result.stdout and "optiq+" not in result.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    doc = json.loads((run_dir / "results.json").read_text())
    assert [r["variant"] for r in rows(doc)] == ["eager"] and doc["fusion"]["rolled_back"] == ["eps_less_norm"]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "rejected"


@pytest.mark.parametrize(("args", "message"), [
    (["--recipes", "warp_drive"], "unknown recipe(s) warp_drive"),
    (["--compare", "eager,vllm"], "vllm: choose from hf, eager, compile"),
])
def test_bad_recipes_or_peers_fail_before_any_work(tmp_path, args, message):
    result = run_cli("bench", *FAST, *args, "--runs-dir", str(tmp_path))
    assert result.exit_code in (1, 2) and message in result.stderr and "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())  # nothing was measured, so no run directory


def test_command_modules_leave_triton_unimported():
    """On a CPU the commands choose Triton's interpreter before triton is imported; importing them must not."""
    code = ("import sys, optiq.commands.bench, optiq.commands.apply_fusion, optiq.commands.profile; "
            "sys.exit('triton' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
