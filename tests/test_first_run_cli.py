"""A newcomer's first ten minutes (issue 24), the command-line half: tables that fit an 80-column terminal, progress
lines in a log, no profiler noise, flags checked before torch is imported, an exit code of its own when no recipe
applies, and a CPU run that says what its numbers mean."""

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.cells import cell_len
from rich.console import Console
from test_report import h200_report

from optiq import errors, report
from optiq.cli import HELP, cli
from optiq.commands import common, recipes, views
from optiq.record import Proposal, Row, from_json
from optiq.traces.attribution import attribute
from optiq.traces.reader import read_trace

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parent.parent
TINY = ["--model", "tiny-llama", "--concurrency", "1", "--prompt-len", "8", "--max-len", "32"]


def rendered(renderable, width: int = 80) -> list[str]:
    console = Console(file=io.StringIO(), width=width, markup=False, emoji=False, color_system=None)
    console.print(renderable)
    return console.file.getvalue().splitlines()


def assert_fits(fitted: views.Fitted, width: int = 80) -> list[str]:
    """No line past ``width``, and one line per row: no cell wrapped. Returns the lines of header and rows."""
    lines = rendered(fitted, width)
    assert all(cell_len(line) <= width for line in lines), "\n".join(lines)
    assert sum(line.startswith("┃") for line in lines) == 1, "\n".join(lines)  # the header, on one line
    assert sum(line.startswith("│") for line in lines) == len(fitted.rows), "\n".join(lines)
    return [line for line in lines if line[:1] in "┃│"]


def assert_wide_shows_every_column(fitted: views.Fitted) -> None:
    fitted.wide = True
    header = " ".join(line for line in rendered(fitted, 1000) if line.startswith("┃"))
    assert all(column in header for column in fitted.columns)


def record_on(kind: str):
    doc = h200_report()
    doc["environment"].update(device=kind if kind == "cpu" else doc["environment"]["device"], kind=kind)
    return from_json(doc)


def proposals() -> list[Proposal]:
    where = "copy_ in repeat_kv 70.8%, attention in attention 14.7%, gemm in mlp 6.1%, reduction in norm 1.1%"
    return [Proposal(name, ms, pct, 192.0, where, "") for name, ms, pct in (("decode_attention", 45.867, 85.8),
                                                                           ("gate_up_swiglu", 3.4, 6.4))]


def rows() -> list[Row]:
    return [Row(variant, "eager", c, "ok", tok_per_s=123456.7, ms_per_step=12.345, prefill_ms=1234.5, warmup_s=89.2,
                floor_ms_per_step=1.448, pct_of_floor=10.5, peak_mem_gb=61.3)
            for variant in ("graph", "compile+graph", "optiq+graph") for c in (1, 64)]


@pytest.mark.parametrize("table", ["attribution", "proposals", "results", "gate", "headline", "end to end",
                                   "compare", "mutants"])
def test_every_table_fits_80_columns_and_wide_shows_every_column(table):
    record = record_on("cuda")
    fitted = {
        "attribution": lambda: views.attribution_view(attribute([read_trace(DATA / "gpu_eager.json.gz")], "class"),
                                                      "llama · C=64 · eager · by class"),
        "proposals": lambda: views.proposals_table(proposals(), "proposals · C=64"),
        "results": lambda: views.results_table(rows(), "llama-3.1-8b · bf16", interpreted={"optiq+graph"}),
        "gate": lambda: views.rich_table(report.gate_table(record)),
        "headline": lambda: views.headline_view(record),
        "end to end": lambda: views.rich_table(report.end_to_end_table(record)),
        "compare": lambda: views.rich_table(report.compare_document(record, record, "a", "b").tables[0]),
        "mutants": lambda: views.mutation_table({"rope": "no site in the model for its module patch of rotary "
                                                         "embeddings, which this model computes inline"}, "verify"),
    }[table]()
    assert_fits(fitted)
    assert_wide_shows_every_column(fitted)


def test_numbers_are_never_cut_or_split_only_names_are():
    gate = views.rich_table(report.gate_table(record_on("cuda")))
    text = "\n".join(assert_fits(gate))
    for row in gate.rows:
        assert row[0].plain in text  # the recipe names whole
    margins = [row[gate.columns.index("fused / unfused")].plain for row in gate.rows]
    assert all(m in text for m in margins)
    attribution = views.attribution_view(attribute([read_trace(DATA / "gpu_eager.json.gz")], "class"), "t")
    text = "\n".join(assert_fits(attribution))
    assert all(row[1].plain in text for row in attribution.rows) and "…" in text  # ms/step whole, kernels cut


def test_the_recipes_catalog_fits_80_columns(monkeypatch):
    console = Console(file=io.StringIO(), width=80, markup=False, emoji=False, color_system=None)
    monkeypatch.setattr(recipes, "out", console)
    assert CliRunner().invoke(cli, ["recipes"]).exit_code == 0
    lines = console.file.getvalue().splitlines()
    assert all(cell_len(line) <= 80 for line in lines)
    assert sum(line.startswith("│") for line in lines) == sum(1 for _ in (ROOT / "recipes").glob("*.toml"))


def test_the_cpu_headline_shows_its_ratios_as_not_meaningful():
    cpu = "\n".join(rendered(views.headline_view(record_on("cpu"))))
    gpu = "\n".join(rendered(views.headline_view(record_on("cuda"))))
    assert "×" not in cpu and "n/m" in cpu and "not meaningful" in cpu
    assert "×" in gpu and "n/m" not in gpu
    results = "\n".join(rendered(views.results_table(rows(), "t", interpreted={"optiq+graph"}), 200))
    assert results.count("n/m │") == 2 and "not meaningful" in results  # the optiq rows' ratios; the others stay


def test_a_profile_in_a_log_shows_progress_lines_and_no_profiler_noise(tmp_path):
    """Redirected stderr (CI, `| tee`): a line per step instead of nothing, and none of kineto's `USDT: ...
    profiler_start` lines."""
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-m", "optiq", "profile", *TINY, "--steps", "1", "--runs-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["optiq: loading tiny-llama", "optiq: profiling tiny-llama C=1 (eager)"]
    assert "USDT" not in done.stderr


def test_apply_fusion_leads_with_the_gate_verdict_and_says_what_a_cpu_run_means(tmp_path):
    result = CliRunner().invoke(cli, ["apply-fusion", *TINY, "--new-tokens", "2", "--repeats", "1", "--gate-steps",
                                      "2", "--recipes", "rmsnorm,moe_experts", "--runs-dir", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    log = result.stderr.splitlines()
    for line in ("optiq: loading tiny-llama", "optiq: measuring tiny-llama: eager C=1 (1/1)",
                 "optiq: gate: rmsnorm kept", "optiq: measuring tiny-llama optiq: optiq+eager C=1 (1/1)"):
        assert line in log, result.stderr
    assert any(re.fullmatch(r"optiq: gate: moe_experts not applicable \(.+\)", line) for line in log)
    assert any(line.startswith("optiq: gate: end to end at C=1 passed") for line in log)
    out = result.stdout
    verdict, gate, throughput = (out.index(text) for text in ("optiq: applied rmsnorm; rolled back none",
                                                               "Validation gate", "Decode throughput"))
    assert verdict < gate < throughput and "end to end: passed over 2 teacher-forced steps at C=1" in out
    assert "n/m" in out and "×" not in out and "Triton's interpreter" in out and "gate's verdict" in out
    assert "report.html in a browser" in out


def test_bench_json_names_the_device_and_what_cpu_timings_mean(tmp_path):
    result = CliRunner().invoke(cli, ["bench", *TINY, "--new-tokens", "2", "--repeats", "1", "--json",
                                      "--runs-dir", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["device_kind"] == "cpu" and "say nothing about a GPU" in doc["timing_note"]
    assert "interpreter" not in doc["timing_note"]  # nothing was fused: no Triton kernel ran
    assert "optiq: measuring tiny-llama: eager C=1 (1/1)" in result.stderr.splitlines()


def test_a_named_recipe_with_no_site_exits_4_before_anything_is_measured(tmp_path):
    started = time.perf_counter()
    result = CliRunner().invoke(cli, ["apply-fusion", *TINY, "--recipes", "moe_experts", "--runs-dir", str(tmp_path)])
    assert result.exit_code == errors.EXIT_NOTHING_APPLIES == 4, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("optiq: error:")]
    assert error.startswith("optiq: error: no recipe applies to this model: moe_experts: ") and "gate" not in error
    (run_dir,) = tmp_path.iterdir()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    assert json.loads((run_dir / "report.json").read_text())["before"] == []  # nothing measured
    assert time.perf_counter() - started < 60


def run_optiq(*args) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "optiq", *args], capture_output=True, text=True, timeout=60)
    return done, time.perf_counter() - started


@pytest.mark.parametrize("args", [["bench", "--concurrency", "0"], ["apply-fusion", "--concurrency", "1,x"],
                                  ["profile", "--concurrency", "0"], ["recipes", "verify", "--concurrency", "-1"]])
def test_a_bad_flag_value_is_a_usage_error_in_well_under_a_second(args):
    done, seconds = run_optiq(*args)
    assert done.returncode == errors.EXIT_USAGE and "Invalid value for '--concurrency'" in done.stderr, done.stderr
    assert seconds < 1.0


@pytest.mark.parametrize("command", ["bench", "apply-fusion", "profile", "recipes", "report"])
def test_help_answers_in_well_under_a_second(command):
    done, seconds = run_optiq(command, "--help")
    assert done.returncode == 0 and "--wide" in done.stdout, done.stderr
    assert seconds < 1.0
    if command == "bench":
        assert all(name in " ".join(done.stdout.split()) for name in common.PRESET_NAMES)


def test_help_and_parsing_import_neither_torch_nor_transformers():
    code = ("import sys\nfrom optiq.cli import cli\n"
            "for args in (['bench', '--help'], ['apply-fusion', '--help'], ['bench', '--concurrency', '0']):\n"
            "    try:\n        cli(args)\n    except SystemExit:\n        pass\n"
            "sys.exit(int(any(m in sys.modules for m in ('torch', 'transformers', 'pandas'))))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


def test_the_preset_names_of_help_are_the_presets():
    from optiq.models import PRESETS

    assert common.PRESET_NAMES == tuple(PRESETS)


def test_every_exit_code_is_in_the_help_and_the_readme():
    readme = " ".join((ROOT / "README.md").read_text().split())
    helped = " ".join(HELP.split())
    for code, words in ((errors.EXIT_GATE_REJECTED_ALL, "the validation gate rejected every recipe"),
                        (errors.EXIT_NOTHING_APPLIES, "no recipe applies to the model"),
                        (errors.EXIT_INTERRUPTED, "interrupted by Ctrl-C or SIGTERM")):
        assert f"| {code} | {words}" in readme and f"{code} {words}" in helped
