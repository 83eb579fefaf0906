"""A newcomer's first run on the CPU (issue 24): numbers that repeat, and a report that says what they mean.

The timing tests use a fake step whose stalls are scheduled, so what the estimator keeps is known; the report tests
render a CPU record shaped like the README's first command's (tiny-llama, C=1,2, interpreted kernels) and read the
figures plotly would draw.
"""

import json
import math
import re
import time

import pytest
import torch

from optiq.measure import timing
from optiq.measure.timing import CPU_THREADS, fixed_threads, time_repeats
from optiq.record import SCHEMA_VERSION, from_json
from optiq.report import (OP_CLASS_COLOURS, REST, compare_document, load_report, op_class_colour, render_markdown,
                          report_document, write_document, write_report)
from optiq.rundir import write_json
from optiq.traces.op_classes import CLASSES, UNATTRIBUTED
from test_report import h200_report

CPU = torch.device("cpu")


def scheduled_step(durations):
    """A step that sleeps the next of ``durations`` (seconds) at each call."""
    pending = iter(durations)
    return lambda: time.sleep(next(pending))


def test_a_cpu_repeat_is_its_median_step_and_the_point_its_median_repeat():
    base, stall, steps = 0.001, 0.05, 16
    stalled_steps = [stall if i in (3, 7, 11) else base for i in range(steps)]  # the scheduler took the core 3 times
    slow_repeat = [10 * base] * steps  # another process ran through a whole repeat
    durations = stalled_steps + slow_repeat + stalled_steps
    resets = []
    repeats = time_repeats(scheduled_step(durations), lambda: resets.append(1), steps, 3, CPU)
    assert len(repeats) == 3 and len(resets) == 3
    # The mean of a stalled repeat is over 10 ms and the slow repeat's 10 ms: neither may be what a repeat or the
    # point reports. time.sleep overshoots on a loaded machine, hence the margin above base.
    assert repeats[0] < 4 * base and repeats[2] < 4 * base and repeats[1] >= 10 * base
    assert sorted(repeats)[1] < 4 * base


def test_cpu_measurements_run_on_fixed_threads_and_give_them_back():
    torch.set_num_threads(2)
    try:
        with fixed_threads(CPU) as threads:
            assert threads == CPU_THREADS == torch.get_num_threads()
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), fixed_threads(CPU):
            raise RuntimeError("a step that raised")
        assert torch.get_num_threads() == 2
        with fixed_threads(torch.device("cuda")) as threads:  # nothing to fix: no CUDA call is made
            assert threads is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize(("value", "interpreted"), [("1", True), ("ON", True), (" yes", True), ("0", False),
                                                    ("", False), ("2", False)])
def test_the_interpreter_is_read_as_triton_reads_it(monkeypatch, value, interpreted):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert timing.triton_interpreted() is interpreted
    assert timing.smoke(torch.device("cuda")) is interpreted and timing.smoke(CPU)


def test_a_measured_cpu_point_is_marked_smoke_with_its_threads():
    from optiq.measure.sweep import measure_point
    from optiq.models import load_model
    from optiq.record import Workload

    model = load_model("tiny-llama", torch.float32, CPU)
    seen = []

    def forward(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return model.forward(*args, **kwargs)

    before = torch.get_num_threads()
    row = measure_point(model, 1, Workload(8, 4, 32, 2), "eager", 1e11, forward=forward)
    assert row.smoke and row.threads == CPU_THREADS and set(seen) == {CPU_THREADS}
    assert torch.get_num_threads() == before
    assert len(row.ms_per_step_repeats) == 2 and row.ms_per_step == pytest.approx(
        sorted(row.ms_per_step_repeats)[0] / 2 + sorted(row.ms_per_step_repeats)[1] / 2)
    assert row.tok_per_s == pytest.approx(1e3 / row.ms_per_step)


def test_the_record_carries_the_device_kind_and_the_interpreter(monkeypatch):
    from optiq.measure import environment

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    env = environment(CPU)
    assert (env.kind, env.triton_interpreter) == ("cpu", True)
    run = from_json(cpu_report())
    assert run.smoke and run.environment.kind == "cpu" and all(r.smoke and r.threads == 1 for r in run.after)
    gpu = h200_report()
    assert not from_json(gpu).smoke  # a record of before the fields were kept reads as it did, without a notice
    gpu["environment"].update(kind="cuda", triton_interpreter=True)
    assert from_json(gpu).smoke  # TRITON_INTERPRET on a GPU: interpreted kernels there too


# --- the report of a CPU run -----------------------------------------------------------------------------------------

CPU_BEFORE, CPU_AFTER = {1: 0.544, 2: 0.582}, {1: 649.2, 2: 709.8}  # ms/step of the README's first command
CPU_FLOOR = {1: 0.00979, 2: 0.0107}


def cpu_row(variant, concurrency, ms):
    return {"variant": variant, "mode": "eager", "concurrency": concurrency, "status": "ok",
            "tok_per_s": concurrency * 1e3 / ms, "ms_per_step": ms, "ms_per_step_repeats": [ms, 1.2 * ms, 0.9 * ms],
            "prefill_ms": 2.3, "warmup_s": 0.01, "floor_ms_per_step": CPU_FLOOR[concurrency],
            "floor_tok_per_s": concurrency * 1e3 / CPU_FLOOR[concurrency],
            "pct_of_floor": 100 * CPU_FLOOR[concurrency] / ms, "smoke": True, "threads": 1}


def cpu_attribution(classes: dict[str, float]) -> dict:
    """{op class: ms/step} as the profiler of a CPU run writes it: CPU self time."""
    table = [{"label": label, "gpu_ms_per_step": ms} for label, ms in classes.items()]
    return {"summary": {"gpu_ms_per_step": sum(classes.values()), "kernels_per_step": 551.0,
                        "time_unit": "CPU self time"}, "table": table}


def cpu_report() -> dict:
    """apply-fusion of tiny-llama on the CPU as the README runs it: every recipe kept, the after step interpreted."""
    applied = ["attention_prologue", "decode_attention", "rmsnorm"]
    verdicts = {r: {"recipe": r, "tolerance": "reassociation", "passed": True, "reason": "passed", "calls": 6,
                    "err_fused": 2e-7, "err_unfused": 2e-7, "bound": 5e-7} for r in applied}
    verdicts["rope"] = {"recipe": "rope", "tolerance": "exact_order", "passed": False,
                        "reason": "err 9.1e-02 > bound 6.2e-03 at call 3"}
    return {
        "schema": SCHEMA_VERSION, "command": "apply-fusion", "model": "tiny-llama", "dtype": "float32",
        "mode": "eager", "status": "complete",
        "environment": {"device": "cpu-2", "torch": "2.13.0+cpu", "transformers": "5.24.0", "cuda": None,
                        "python": "3.11.7", "optiq": "0.1.0", "kind": "cpu", "triton_interpreter": True},
        "workload": {"prompt_len": 64, "new_tokens": 16, "max_len": 128, "repeats": 3}, "concurrency": [1, 2],
        "fusion": {"requested": ["auto"], "applied": applied, "rolled_back": ["rope"],
                   "not_applicable": {"gate_up_swiglu": "no fused gate_up weight"},
                   "gate": {"recipes": verdicts, "end_to_end": [
                       {"concurrency": c, "steps": 64, "passed": True, "rel_err": 2e-7, "rel_err_unpatched": 0.0,
                        "bound": 7.6e-6, "top1": 1.0, "top1_unpatched": 1.0, "min_top1": 1.0, "recipes": applied}
                       for c in (1, 2)]},
                   "timings": {"patch_s": 0.01, "gate_s": 97.9, "capture_s": 3.9}},
        "before": [cpu_row("eager", c, ms) for c, ms in CPU_BEFORE.items()],
        "after": [cpu_row("optiq+eager", c, ms) for c, ms in CPU_AFTER.items()],
        "attribution_before": {str(c): cpu_attribution({"other": 0.16, "elementwise": 0.07, "gemm": 0.07,
                                                        "copy_": 0.06, "attention": 0.04}) for c in (1, 2)},
        "attribution_after": {str(c): cpu_attribution({"gemm": 160.9, "other": 80.8, "rope": 79.3, "attention": 47.4,
                                                       "norm": 13.7, "copy_": 0.14}) for c in (1, 2)},
    }


def figures(page: str) -> list[tuple[list[dict], dict]]:
    """(traces, layout) of every plot on a page, as plotly.js is handed them."""
    decoder, found = json.JSONDecoder(), []
    for call in re.finditer(r'Plotly\.newPlot\(\s*"[^"]+",\s*', page):
        data, end = decoder.raw_decode(page, call.end())
        layout, _ = decoder.raw_decode(page, end + len(re.match(r",\s*", page[end:]).group(0)))
        found.append((data, layout))
    return found


@pytest.fixture(scope="module")
def cpu_pages(tmp_path_factory):
    """report.md and report.html of the CPU run, and the compare.html of the H200 run (A) against it (B), rendered
    once for the tests that read them."""
    tmp_path = tmp_path_factory.mktemp("pages")
    cpu, gpu = (tmp_path / "cpu", cpu_report()), (tmp_path / "gpu", h200_report())
    for path, doc in (cpu, gpu):
        path.mkdir()
        write_json(path / "report.json", doc)
    write_report(cpu[0])
    write_document(tmp_path, "compare", compare_document(load_report(gpu[0]), load_report(cpu[0]), "gpu", "cpu"))
    return ((cpu[0] / "report.md").read_text(), (cpu[0] / "report.html").read_text(),
            (tmp_path / "compare.html").read_text())


def test_a_cpu_report_says_first_that_its_timings_are_smoke_and_what_the_run_proves(cpu_pages):
    md, page, _ = cpu_pages
    lines = md.splitlines()
    assert lines[0].startswith("# optiq apply-fusion: tiny-llama") and lines[2].startswith("> **Smoke run: timed on "
                                                                                           "the CPU")
    for text in ("under Triton's interpreter", "say nothing about GPU speed", "validation gate's verdict",
                 "greedy decode, end to end"):
        assert text in lines[2], text
    notice = page.index("<p class=notice>Smoke run: timed on the CPU")
    assert notice < page.index("<li><b>status</b>") < page.index("<h2>")


def test_a_cpu_report_leads_with_the_verdict_and_labels_its_ratios_not_meaningful(cpu_pages):
    md, page, _ = cpu_pages
    verdict = next(line for line in md.splitlines() if line.startswith("- **gate verdict**"))
    assert "kept attention_prologue, decode_attention, rmsnorm;" in verdict
    assert "rolled back rope (err 9.1e-02 > bound 6.2e-03 at call 3)" in verdict
    assert "not applicable gate_up_swiglu (no fused gate_up weight)" in verdict and "C=2 passed" in verdict
    order = [md.index(text) for text in ("- **gate verdict**", "## Validation gate: per recipe",
                                         "## Validation gate: end to end", "## Decode throughput: smoke numbers")]
    assert order == sorted(order)
    assert "| C | before tok/s | after tok/s | speed-up |" in md and "| n/m |" in md and "×" not in md.split(
        "## Decode throughput")[1].split("##")[0]
    assert "| measured: time saved (ms/step, before − after; not meaningful: smoke numbers) | -648.656 |" in md
    assert page.index("<h2>Validation gate: per recipe") < page.index("<h2>Decode throughput") < page.index(
        "Plotly.newPlot(") < page.index("<h2>Savings")


def test_a_gpu_report_has_no_smoke_notice():
    doc = report_document(from_json(h200_report()))
    assert doc.notice == "" and "not meaningful" not in render_markdown(doc)
    assert doc.tables[2].title == "Decode throughput" and doc.tables[2].columns[3] == "speed-up"


def log_span(values) -> tuple[float, float]:
    logs = [math.log10(v) for v in values]
    return min(logs), max(logs)


def test_the_throughput_axes_fit_the_measured_lines_and_name_the_floor_off_them(cpu_pages):
    _, page, _ = cpu_pages
    lines = [(data, layout) for data, layout in figures(page) if layout["yaxis"].get("type") == "log"]
    assert len(lines) == 2
    for (data, layout), floor in zip(lines, ("102,145 to 186,916 tok/s", "0.00979 to 0.0107 ms/step")):
        low, high = layout["yaxis"]["range"]
        measured_low, measured_high = log_span(y for trace in data for y in trace["y"])
        assert low < measured_low and measured_high < high  # every measured point is drawn...
        assert (high - low) < 1.2 * (measured_high - measured_low) + 0.2  # ...and the axis is theirs, not the floor's
        assert [t["name"] for t in data] == ["before (eager)", "after (eager)"]  # no floor line, no empty peer
        (annotation,) = layout["annotations"]
        assert annotation["text"].startswith(f"bandwidth floor: {floor}, off this axis (")


def test_a_floor_within_a_decade_of_the_measurements_is_drawn_on_the_axis(tmp_path):
    run = tmp_path / "gpu"
    run.mkdir()
    write_json(run / "report.json", h200_report())
    write_report(run)
    data, layout = figures((run / "report.html").read_text())[0]
    floor = next(t for t in data if t["name"] == "bandwidth floor")
    low, high = layout["yaxis"]["range"]
    floor_low, floor_high = log_span(floor["y"])
    assert floor["line"]["dash"] == "dot" and low < floor_low and floor_high < high and "annotations" not in layout


def test_an_op_class_has_one_colour_on_every_page(cpu_pages):
    _, report_page, compare_page = cpu_pages
    colours = [{t["name"]: t["marker"]["color"] for t in data if t["type"] == "bar"}
               for data, _ in (figures(report_page)[-1], figures(compare_page)[-1])]
    shared = colours[0].keys() & colours[1].keys()
    assert {"gemm", "attention", "copy_", "other"} <= shared  # ranked differently on the two pages
    assert all(colours[0][label] == colours[1][label] for label in shared)
    assert set(OP_CLASS_COLOURS) == {*CLASSES, UNATTRIBUTED, REST}
    assert len(set(OP_CLASS_COLOURS.values())) == len(OP_CLASS_COLOURS)
    # a label of a trace's own (no class of optiq's) keeps one colour, and never a listed class's
    assert op_class_colour("triton") == op_class_colour("triton") not in OP_CLASS_COLOURS.values()


def test_units_are_named_for_the_device(cpu_pages):
    cpu, gpu = from_json(cpu_report()), from_json(h200_report())
    titles = {table.title for table in compare_document(cpu, cpu, "a", "b").tables}
    assert "CPU self time: ms/step by op class" in titles and not any("GPU" in t for t in titles if "op class" in t)
    assert "GPU time: ms/step by op class" in {t.title for t in compare_document(gpu, gpu, "a", "b").tables}
    _, _, compare_page = cpu_pages  # the H200 run against the CPU run: both named
    assert "<h2>CPU self time / GPU time: ms/step by op class</h2>" in compare_page
    assert "GPU ms/step" not in compare_page


def test_the_stacked_bars_stand_beside_the_timed_step_of_the_throughput_table(cpu_pages):
    _, page, _ = cpu_pages
    data, layout = figures(page)[-1]
    timed = next(t for t in data if t["name"].startswith("timed step"))
    assert timed["x"] == [["C=1", "C=1", "C=2", "C=2"], ["before", "after", "before", "after"]]
    assert timed["y"] == pytest.approx([CPU_BEFORE[1], CPU_AFTER[1], CPU_BEFORE[2], CPU_AFTER[2]])
    profiled = sum(t["y"][1] for t in data if t["type"] == "bar")  # C=1 after: what the profiler summed
    assert profiled == pytest.approx(382.24) and layout["title"]["text"].startswith("CPU self time per decode step")
    assert "They measure different things: the profile counts the ops or kernels alone, not the time between them" \
        in page


def test_values_a_log_axis_cannot_show_are_left_out_of_its_range():
    from optiq.report import Lines

    assert Lines("t", "tok/s", [("a", {1: 0.0, 2: math.inf, 4: math.nan}, "solid")]).empty
    plot = Lines("t", "tok/s", [("a", {1: 10.0, 2: -1.0, 4: math.inf}, "solid")], ("floor", {1: 0.0, 2: 50.0}))
    (low, high), off = plot.y_range()
    assert low < 1 < math.log10(50) < high and off == ""
