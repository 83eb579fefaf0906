"""The apply-fusion report and `optiq report`: numbers, Markdown, self-contained HTML, comparison, missing plotly."""

import copy
import json
import re
import sys

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from optiq.cli import cli
from optiq.errors import OptiqError
from optiq.record import SCHEMA_VERSION, from_json
from optiq.report import (compare_runs, headline, load_report, render_html, report_document, savings,
                          time_to_optimized, write_report)
from optiq.rundir import write_json

FLOOR_MS = {1: 3.568, 16: 3.836, 64: 4.693}
BEFORE = {1: 8.220, 16: 19.240, 64: 51.898}  # graph, llama-3.1-8b bf16 on the H200 (README's bench table)
COMPILED = {1: 6.028, 16: 10.523, 64: 24.494}
AFTER = {1: 1e3 / 150, 16: 16e3 / 1500, 64: 64e3 / 4000}  # 150, 1,500 and 4,000 tok/s


def bench_row(variant, concurrency, ms):
    return {"variant": variant, "mode": "graph", "concurrency": concurrency, "status": "ok",
            "tok_per_s": concurrency * 1e3 / ms, "ms_per_step": ms, "ms_per_step_repeats": [ms] * 3,
            "prefill_ms": 300.0, "warmup_s": 0.3, "peak_mem_gb": 16.3, "floor_ms_per_step": FLOOR_MS[concurrency],
            "floor_tok_per_s": concurrency * 1e3 / FLOOR_MS[concurrency],
            "pct_of_floor": 100 * FLOOR_MS[concurrency] / ms}


def attribution(classes: dict[str, tuple[float, float]]) -> dict:
    """{op class: (GPU ms/step, kernels/step)} as profile writes it."""
    total = sum(ms for ms, _ in classes.values())
    table = [{"label": label, "gpu_ms_per_step": ms, "pct": 100 * ms / total, "kernels_per_step": k,
              "mean_us": 1e3 * ms / k, "top_kernels": f"{label}_kernel 100%", "where": "attention: x 100%"}
             for label, (ms, k) in classes.items()]
    return {"summary": {"gpu_ms_per_step": total, "kernels_per_step": sum(k for _, k in classes.values()),
                        "time_unit": "GPU time"}, "table": table}


def proposal(recipe, ms, pct, kernels):
    return {"recipe": recipe, "covered_ms_per_step": ms, "covered_pct": pct, "kernels_per_step": kernels,
            "where": f"copy_ in repeat_kv | {pct}%", "why": "why"}


def h200_report() -> dict:
    """An apply-fusion report of llama-3.1-8b on the H200: two recipes applied, one rolled back, one not applicable."""
    return {
        "schema": SCHEMA_VERSION, "command": "apply-fusion", "model": "llama-3.1-8b", "dtype": "bfloat16",
        "mode": "graph", "status": "complete",
        "environment": {"device": "NVIDIA H200", "torch": "2.13.0+cu130", "transformers": "5.17.0", "cuda": "13.0",
                        "python": "3.12.3", "optiq": "0.1.0"},
        "workload": {"prompt_len": 512, "new_tokens": 128, "max_len": 1024, "repeats": 3},
        "concurrency": [1, 16, 64],
        "fusion": {
        "requested": ["auto"],
        "proposals": {"64": [proposal("decode_attention", 45.867, 85.8, 192.0), proposal("rmsnorm", 1.555, 2.9, 584.0),
                             proposal("rope", 0.738, 1.4, 320.0)],
                      "1": [proposal("decode_attention", 2.1, 26.0, 192.0), proposal("rmsnorm", 0.9, 11.1, 584.0)]},
        "applied": ["decode_attention", "rmsnorm"], "not_applicable": {"gate_up_swiglu": "no fused gate_up weight"},
        "rolled_back": ["rope"],
        "gate": {"recipes": {
            "decode_attention": {"recipe": "decode_attention", "tolerance": "reassociation", "passed": True,
                                 "reason": "", "calls": 32, "err_fused": 1.2e-3, "err_unfused": 1.1e-3,
                                 "bound": 4.4e-3, "site": "LlamaAttention"},
            "rmsnorm": {"recipe": "rmsnorm", "tolerance": "exact_order", "passed": True, "reason": "", "calls": 65,
                        "err_fused": 2.0e-3, "err_unfused": 2.1e-3, "bound": 4.3e-3, "site": "LlamaRMSNorm"},
            "rope": {"recipe": "rope", "tolerance": "exact_order", "passed": False,
                     "reason": "err 9.1e-02 > bound 6.2e-03 at call 3", "calls": 32, "err_fused": 9.1e-2,
                     "err_unfused": 2.0e-3, "bound": 6.2e-3, "site": "apply_rotary_pos_emb", "seconds": 0.9,
                     "margin": 45.5}},
            "end_to_end": [{"concurrency": c, "steps": 64, "passed": True, "rel_err": 3e-3, "rel_err_unpatched": 2e-3,
                            "bound": 9e-3, "top1": 0.99, "top1_unpatched": 0.99, "min_top1": 0.94,
                            "recipes": ["decode_attention", "rmsnorm"]} for c in (1, 64)]},
        "timings": {"patch_s": 0.4, "gate_s": 12.0, "capture_s": 1.2}},
        "before": [bench_row("graph", c, ms) for c, ms in BEFORE.items()]
                  + [bench_row("compile+graph", c, ms) for c, ms in COMPILED.items()],
        "after": [bench_row("optiq+graph", c, ms) for c, ms in AFTER.items()],
        "attribution_before": {
            "1": attribution({"gemm": (5.1, 321.0), "attention": (1.0, 32.0), "copy_": (1.2, 326.0),
                              "mul": (0.4, 292.0), "reduction": (0.2, 65.0), "elementwise": (0.2, 625.0)}),
            "64": attribution({"copy_": (38.541, 326.0), "attention": (7.857, 32.0), "gemm": (4.776, 321.0),
                               "mul": (0.734, 292.0), "reduction": (0.586, 65.0), "elementwise": (0.93, 625.0)})},
        "attribution_after": {
            "1": attribution({"gemm": (5.1, 321.0), "triton": (0.9, 97.0), "copy_": (0.1, 20.0), "mul": (0.2, 160.0),
                              "elementwise": (0.2, 500.0)}),
            "64": attribution({"gemm": (4.776, 321.0), "triton": (9.8, 97.0), "copy_": (0.3, 20.0), "mul": (0.4, 160.0),
                               "elementwise": (0.7, 500.0)})},
    }


def h200_record():
    return from_json(h200_report())


def run_dir_with(tmp_path, report, name="apply-fusion-20261201-120000"):
    path = tmp_path / name
    path.mkdir()
    write_json(path / "report.json", report)
    return path


def run_cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_headline_is_after_over_before_compile_and_floor():
    rows = {h["concurrency"]: h for h in headline(h200_record())}
    assert list(rows) == [1, 16, 64]
    c64 = rows[64]
    assert c64["before_tok_per_s"] == pytest.approx(1233.2, abs=0.1) and c64["after_tok_per_s"] == pytest.approx(4000)
    assert c64["speedup"] == pytest.approx(4000 / 1233.2, rel=1e-4)
    assert c64["after_vs_compile"] == pytest.approx(4000 / 2612.9, rel=1e-4)
    assert c64["floor_tok_per_s"] == pytest.approx(13637, abs=1)
    assert c64["after_pct_of_floor"] == pytest.approx(100 * 4.693 / 16.0)


def test_savings_predicted_per_recipe_measured_for_the_set():
    s = savings(h200_record())
    assert s["predicted_ms_per_step"] == {"decode_attention": {1: 2.1, 64: 45.867}, "rmsnorm": {1: 0.9, 64: 1.555}}
    assert s["measured_ms_per_step"][64] == pytest.approx(51.898 - 16.0)
    assert s["kernels_removed_per_step"] == {1: 1661 - 1098, 16: None, 64: 1661 - 1098}


def test_time_to_optimized_sets_patch_gate_and_capture_against_compile_s_warm_up():
    report = h200_report()
    for row in report["before"]:
        row["warmup_s"] = 30.0 if row["variant"] == "compile+graph" else 0.2
    optimized, warmup = time_to_optimized(from_json(report))
    assert optimized == pytest.approx(0.4 + 12.0 + 1.2) and warmup == pytest.approx(30.0 * len(COMPILED))
    report["before"] = [r for r in report["before"] if r["variant"] == "graph"]
    assert time_to_optimized(from_json(report)) == (pytest.approx(13.6), None)
    report["fusion"]["timings"]["capture_s"] = None  # a run the gate rejected never captures
    assert time_to_optimized(from_json(report)) is None


def test_markdown_has_every_section_and_the_gate_verdicts(tmp_path):
    run = run_dir_with(tmp_path, h200_report())
    written = write_report(run)
    assert written.note is None and [p.name for p in written.paths] == ["report.md", "report.html"]
    md = (run / "report.md").read_text()
    for text in ("llama-3.1-8b · bfloat16 · graph · NVIDIA H200", "torch 2.13.0+cu130", "prompt 512 tokens",
                 "| 64 | 1,233.2 | 4,000.0 | 3.24× | 2,612.9 | 1.53× | 13,637.3 | 29.3 |",
                 "| rope | rolled back | exact_order | 32 | 9.10e-02 | 2.00e-03 | 45.50 | 6.20e-03 | — | 0.9 | err 9.1e-02 > bound",
                 "| gate_up_swiglu | not applicable |", "no fused gate_up weight",
                 "| predicted: decode_attention (ms/step) | 2.100 | — | 45.867 |",
                 "| measured: kernels removed per step (profiled) | 563 | — | 563 |", "not separable",
                 "copy_ in repeat_kv \\| 85.8%", "13.6 s (patch + gate + capture); torch.compile's warm-up"):
        assert text in md, text
    assert md.count("| passed |") == 2


def test_workers_that_compiled_ahead_are_listed_with_their_outcome_and_times(tmp_path):
    report = h200_report()
    report["fusion"]["compile_ahead"] = [
        {"engine": [64, 514, 512], "status": "done", "ready_s": 8.43, "sent_s": 10.0, "seconds": 4.17},
        {"engine": [1, 1024, 512], "status": "stopped", "ready_s": 9.0, "sent_s": 10.0, "seconds": None},
        {"engine": [1, 577, 512], "status": "failed: OSError", "ready_s": None, "sent_s": 10.0, "seconds": None}]
    run = run_dir_with(tmp_path, report)
    write_report(run)
    assert ("C=64 cache 514 done (ready after 8.4 s, names after 10.0 s, compiled 4.2 s after the names); C=1 cache "
            "1024 stopped (ready after 9.0 s, names after 10.0 s); C=1 cache 577 failed: OSError (names after 10.0 s)"
            ) in (run / "report.md").read_text()


def test_html_is_self_contained_with_three_plots():
    import plotly.offline

    page = render_html(report_document(h200_record()))
    assert page.count('class="plotly-graph-div"') == 3 and page.count("Plotly.newPlot(") == 3
    assert page.count(plotly.offline.get_plotlyjs()) == 1
    # plotly.js itself holds URLs it never fetches for these plots (links, the geo maps' cdn.plot.ly); the rest of the
    # page names none and loads nothing: no element with a src or href.
    rest = page.replace(plotly.offline.get_plotlyjs(), "")
    assert "http" not in rest and "cdn.plot.ly" not in rest
    assert not re.search(r"<[a-z]+[^>]*\b(src|href)\s*=", rest, re.I)
    assert "decode_attention" in page and "<h2>Validation gate: per recipe</h2>" in page


def partial(kind):
    report = h200_report()
    if kind == "rejected":
        report.update(status="rejected", after=[], attribution_after={})
        report["fusion"].update(applied=[], rolled_back=["decode_attention", "rmsnorm", "rope"])
    elif kind == "no compile, oom, no after profile":
        report["before"] = [r for r in report["before"] if r["variant"] == "graph"]
        report["after"][2] = {"variant": "optiq+graph", "mode": "graph", "concurrency": 64, "status": "oom",
                              "error": "CUDA out of memory"}
        report["attribution_after"] = {}
    elif kind == "bare":
        report = {key: report[key] for key in ("schema", "command", "environment", "workload", "dtype", "mode")}
        report.update(model="tiny-llama", status="incomplete", concurrency=[])
    return report


@pytest.mark.parametrize("kind", ["rejected", "no compile, oom, no after profile", "bare"])
def test_missing_parts_render(tmp_path, kind):
    report = partial(kind)
    run = run_dir_with(tmp_path, report)
    assert write_report(run).note is None
    md, page = (run / "report.md").read_text(), (run / "report.html").read_text()
    rows = {h["concurrency"]: h for h in headline(from_json(report))}
    if kind == "rejected":
        assert rows[64]["after_tok_per_s"] is None and "| 64 | 1,233.2 | — | — |" in md and "rejected" in md
        assert page.count('class="plotly-graph-div"') == 3  # the before profile still stacks
    elif kind == "bare":
        assert rows == {} and "# optiq apply-fusion: tiny-llama" in md and "(none)" in md
        assert page.count('class="plotly-graph-div"') == 0
    else:
        assert rows[64]["after_tok_per_s"] == "oom" and rows[64]["compile_tok_per_s"] is None
        assert "| 64 | 1,233.2 | oom | — | — | — | 13,637.3 | oom |" in md
        assert "| measured: kernels removed per step (profiled) | — | — | — |" in md


def test_without_plotly_markdown_is_written_and_html_skipped(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "plotly" or m.startswith("plotly.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "plotly", None)
    run = run_dir_with(tmp_path, h200_report())
    result = run_cli("report", run)
    assert result.exit_code == 0, result.stderr
    assert (run / "report.md").exists() and (run / "report.json").exists() and not (run / "report.html").exists()
    assert result.stderr.strip().splitlines() == [
        "note: plotly is not installed: report.md written, report.html skipped"]


def test_report_command_rerenders_and_summarises(tmp_path):
    run = run_dir_with(tmp_path, h200_report())
    result = run_cli("report", run)
    assert result.exit_code == 0, result.stderr
    assert (run / "report.md").exists() and (run / "report.html").exists()
    assert "Decode throughput" in result.stdout and "4,000.0" in result.stdout and "rolled back" in result.stdout
    doc = json.loads(run_cli("report", run, "--json").stdout)
    assert doc["status"] == "complete" and [h["concurrency"] for h in doc["headline"]] == [1, 16, 64]
    assert doc["written"].endswith("report.html")


def test_nan_gate_numbers_survive_the_round_trip(tmp_path):
    report = h200_report()
    report["fusion"]["gate"]["recipes"]["rmsnorm"].update(err_fused=float("nan"), err_unfused=float("nan"))
    run = run_dir_with(tmp_path, report)
    write_report(run)
    assert "| rmsnorm | applied | exact_order | 65 | — | — | — | 4.30e-03 | — |" in (run / "report.md").read_text()


def test_a_gate_on_constant_parameters_says_it_redrew_them(tmp_path):
    report = h200_report()
    report["fusion"]["gate"]["constant_parameters"] = [f"model.layers.{i}.input_layernorm.weight" for i in range(4)]
    run = run_dir_with(tmp_path, report)
    write_report(run)
    assert ("**gated on constant parameters**: 4 of the model's parameters were one value throughout "
            "(model.layers.0.input_layernorm.weight, model.layers.1.input_layernorm.weight, "
            "model.layers.2.input_layernorm.weight, ...)") in (run / "report.md").read_text()
    assert "parameters gated on: own + 4 constant redrawn" in (run / "report.md").read_text()


def test_the_gate_table_shows_each_recipes_mutation_score(tmp_path):
    report = h200_report()
    report["fusion"]["mutants"] = {"rmsnorm": {"killed": 8, "counted": 8},
                                   "decode_attention": {"killed": 6, "counted": 7, "survived": ["length - 1"]}}
    run = run_dir_with(tmp_path, report)
    write_report(run)
    text = (run / "report.md").read_text()
    assert "| 100% of 8 |" in text and "| 86% of 7 |" in text and "parameters gated on: own (none constant)" in text


def test_compare_two_runs(tmp_path):
    a = run_dir_with(tmp_path, partial("rejected"), "a")  # the model as it was
    b = run_dir_with(tmp_path, h200_report(), "b")
    cmp = compare_runs(load_report(a), load_report(b))
    assert (cmp["state_a"], cmp["state_b"]) == ("before", "after")
    c64 = cmp["throughput"][2]
    assert c64["concurrency"] == 64 and c64["ratio"] == pytest.approx(4000 / 1233.2, rel=1e-4)
    copy_64 = next(o for o in cmp["op_classes"] if o["concurrency"] == 64 and o["label"] == "copy_")
    assert copy_64["delta_ms"] == pytest.approx(0.3 - 38.541)
    triton_64 = next(o for o in cmp["op_classes"] if o["concurrency"] == 64 and o["label"] == "triton")
    assert triton_64["gpu_ms_per_step_a"] == 0.0
    assert cmp["op_classes"][0]["label"] == "gemm"  # C=1 first, largest class first

    out = tmp_path / "cmp" / "nested"
    result = run_cli("report", a, b, "--out", out)
    assert result.exit_code == 0, result.stderr
    assert "B / A" in result.stdout and "3.24×" in result.stdout and "copy_" in result.stdout
    assert (out / "compare.md").exists() and (out / "compare.html").read_text().count('class="plotly-graph-div"') == 3
    doc = json.loads(run_cli("report", a, b, "--json").stdout)
    assert doc["throughput"] == json.loads(json.dumps(cmp["throughput"])) and doc["written"] == ""


def test_compare_runs_with_different_concurrencies():
    a, b = h200_report(), copy.deepcopy(h200_report())
    b["after"] = b["after"][:1]
    b["concurrency"] = [1]
    ratios = {t["concurrency"]: t["ratio"] for t in compare_runs(from_json(a), from_json(b))["throughput"]}
    assert ratios[1] == pytest.approx(1.0) and ratios[16] is None and ratios[64] is None


@pytest.mark.parametrize(("setup", "message"), [
    (lambda p: None, "is not a directory"),
    (lambda p: p.mkdir(), "has no report.json or results.json"),
    (lambda p: (p.mkdir(), (p / "report.json").write_text("{oops")), "is not valid JSON"),
    (lambda p: (p.mkdir(), (p / "report.json").write_text('{"model": "x"}')), "schema version none (an older optiq)"),
    (lambda p: (p.mkdir(), write_json(p / "report.json", {**h200_report(), "status": 3})),
     "report.json.status: expected str, not 3"),
    (lambda p: (p.touch()), "is not a directory"),
])
def test_bad_run_is_one_line_and_exit_1(tmp_path, setup, message):
    run = tmp_path / "run"
    setup(run)
    for args in ([run], [run, run]):
        result = run_cli("report", *args)
        assert result.exit_code == 1 and message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_too_many_runs_or_out_without_compare_is_usage(tmp_path):
    run = run_dir_with(tmp_path, h200_report())
    assert run_cli("report", run, run, run).exit_code == 2
    assert run_cli("report", run, "--out", tmp_path / "x").exit_code == 2


def _set(*path_and_value):
    """A change to the H200 report: the place at ``path`` (keys and list indices) set to ``value``, or removed."""
    *path, value = path_and_value

    def change(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        if value is _REMOVED:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return doc
    return change


_REMOVED = object()
# Well-formed JSON of the wrong shape, as a careless edit or another tool's file would hold: each must be one line.
WRONG_SHAPES = {
    "a list": lambda doc: [doc],
    "a string": lambda doc: "report",
    "null": lambda doc: None,
    "a number": lambda doc: 1,
    "an empty object": lambda doc: {},
    "schema true": _set("schema", True),
    "no model": _set("model", _REMOVED),
    "model null": _set("model", None),
    "concurrency a string": _set("concurrency", "1,16"),
    "concurrency of strings": _set("concurrency", ["1"]),
    "environment a list": _set("environment", []),
    "workload of floats": _set("workload", "prompt_len", 512.5),
    "a row a string": _set("before", 0, "row"),
    "a row missing its status": _set("before", 0, "status", _REMOVED),
    "tok/s a string": _set("before", 0, "tok_per_s", "fast"),
    "tok/s a bool": _set("before", 0, "tok_per_s", True),
    "ms/step of 400 digits": _set("before", 0, "ms_per_step", 10 ** 400),
    "repeats of nulls": _set("before", 0, "ms_per_step_repeats", [None]),
    "fusion a list": _set("fusion", []),
    "applied a string": _set("fusion", "applied", "rmsnorm"),
    "a verdict of the wrong type": _set("fusion", "gate", "recipes", "rope", ["rope"]),
    "an end-to-end field unknown": _set("fusion", "gate", "end_to_end", 0, "tolerence", 1),
    "proposals keyed by a word": _set("fusion", "proposals", {"sixty-four": []}),
    "a proposal of nulls": _set("fusion", "proposals", "64", [None]),
    "a worker's engine of two": _set("fusion", "compile_ahead", [{"engine": [1, 2]}]),
    "attribution a list": _set("attribution_before", []),
    "attribution keyed by a word": _set("attribution_before", {"one": {}}),
    "an attribution's summary a list": _set("attribution_before", "1", "summary", []),
    "an attribution's time unit an object": _set("attribution_before", "1", "summary", "time_unit", {}),
    "an attribution's table a number": _set("attribution_before", "1", "table", 3.0),
    "an attribution row without a label": _set("attribution_before", "1", "table", 0, "label", _REMOVED),
    "an attribution row's time a list": _set("attribution_before", "64", "table", 0, "gpu_ms_per_step", [1]),
    "an attribution row a string": _set("attribution_after", "64", "table", ["gemm"]),
    "status a number": _set("status", 3),
    "status unknown": _set("status", "exploded"),
}


@pytest.mark.parametrize("kind", WRONG_SHAPES)
def test_a_record_of_the_wrong_shape_is_one_line_and_exit_1(tmp_path, kind):
    doc = WRONG_SHAPES[kind](h200_report())
    run = run_dir_with(tmp_path, doc)
    for args in ([run], [run, run], [run, "--json"]):
        result = CliRunner().invoke(cli, ["report", *map(str, args)])
        assert result.exit_code == 1, (result.output, result.exception)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"optiq: error: {run / 'report.json'}"), result.stderr
        assert "unexpected" not in lines[0] and "Traceback" not in result.output


@pytest.mark.parametrize(("content", "message"), [
    ("[" * 100_000 + "]" * 100_000, "is not a run record"),  # nesting: json's RecursionError
    ('{"schema": 1, "model": ' + "9" * 5000 + "}", "is not a run record"),  # digits past int's limit
    ("\ufeff{}", "not valid JSON"),
    (b"\xff\xfe{}", "cannot read"),
])
def test_a_record_file_json_cannot_hold_is_one_line(tmp_path, content, message):
    run = tmp_path / "run"
    run.mkdir()
    path = run / "report.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    result = CliRunner().invoke(cli, ["report", str(run)])
    assert result.exit_code == 1 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_record_larger_than_any_run_is_refused_unread(tmp_path):
    from optiq.record import MAX_RECORD_BYTES

    run = tmp_path / "run"
    run.mkdir()
    with open(run / "report.json", "wb") as f:
        f.truncate(MAX_RECORD_BYTES + 1)  # sparse: nothing is written
    result = CliRunner().invoke(cli, ["report", str(run)])
    assert result.exit_code == 1 and "more than any run record" in result.stderr


def test_a_fifo_named_report_json_does_not_hang(tmp_path):
    import os

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "report.json")
    result = CliRunner().invoke(cli, ["report", str(run)])
    assert result.exit_code == 1 and "has no report.json" in result.stderr


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.sampled_from([10 ** 400, -(10 ** 400)])
    | st.floats() | st.text(max_size=10) | st.sampled_from(["ok", "oom", "1", "64", "", "[/x]", "\x1b[31m"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.text(max_size=6) | st.sampled_from(["1", "64", "label", "gpu_ms_per_step", "summary", "table"]),
        children, max_size=4),
    max_leaves=30)


def _paths(value, prefix=()):
    """Every place in a JSON document, deepest last."""
    yield prefix
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, (*prefix, key))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_fuzzed_records_read_render_and_compare_or_fail_as_one_optiq_error(data):
    """Up to three places of the H200 report replaced by any JSON (nested, huge, NaN, markup-like) or removed:
    checking it, its report document, its Markdown, its terminal tables and the comparison with itself either work or
    raise OptiqError, never anything else."""
    from optiq.commands.views import rich_table
    from optiq.report import compare_document, render_markdown

    doc = h200_report()
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(list(_paths(doc))[1:]))
        parent = doc
        for key in where[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and data.draw(st.booleans()):
            del parent[where[-1]]
        else:
            parent[where[-1]] = data.draw(JSON_VALUES)
    try:
        run = from_json(json.loads(json.dumps(doc)))
    except OptiqError:
        return
    document = report_document(run)
    render_markdown(document)
    for table in document.tables:
        rich_table(table)
    render_markdown(compare_document(run, run, "a", "b"))
