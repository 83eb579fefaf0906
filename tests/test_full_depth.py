"""A truncated preset's whole model: the floor of its published config, the step extrapolated from the preset's
profiled layers, in the record, the terminal (80 columns), the report and --json; other models show nothing new."""

import copy
import io
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rich.cells import cell_len
from rich.console import Console

from optiq import record
from optiq.cli import cli
from optiq.commands import bench, views
from optiq.measure import depth
from optiq.measure.roofline import floor_ms_per_step
from optiq.models import PUBLISHED, load_config, load_model, random_model
from optiq.profiling.capture import profile_step
from optiq.record import DepthPoint, FullDepth, Row, Workload
from optiq.report import depth_tables, render_html, render_markdown, report_document
from optiq.traces.attribution import NO_LAYER, attribute

TINY = "tiny-deepseek-v4-flash"
FAST = ["--prompt-len", "8", "--new-tokens", "4", "--max-len", "32", "--repeats", "2", "--concurrency", "1,2"]
WORKLOAD = Workload(prompt_len=8, new_tokens=4, max_len=32, repeats=2)
BANDWIDTH = 1e11
HCA, CSA = "heavily_compressed_attention", "compressed_sparse_attention"


def test_deepseek_v4_flash_stands_for_the_43_layers_in_the_models_own_mix():
    config = PUBLISHED["deepseek-v4-flash"].config()
    assert Counter(config.layer_types) == {HCA: 23, CSA: 20}
    assert Counter(config.mlp_layer_types) == {"hash_moe": 3, "moe": 40}
    assert Counter(depth.layer_kinds(config)) == {f"{HCA} / hash_moe": 3, f"{CSA} / moe": 20, f"{HCA} / moe": 20}
    preset = load_config("deepseek-v4-flash")
    assert (preset.hidden_size, preset.n_routed_experts) == (config.hidden_size, config.n_routed_experts)


def test_the_full_depth_floor_is_the_floor_of_the_deeper_model_built():
    """Counted on the meta device, the published config's floor is the one its model, built with weights on the CPU,
    has: the same roofline, the same bytes."""
    model = load_model(TINY, torch.float32, torch.device("cpu"))
    found = depth.full_depth(PUBLISHED[TINY], model, [1, 2, 64], WORKLOAD, BANDWIDTH)
    built = random_model(PUBLISHED[TINY].config(), torch.float32, torch.device("cpu"))
    assert found.layers == 7 and found.measured_layers == 2
    for c in (1, 2, 64):
        assert found.floor_ms_per_step[str(c)] == pytest.approx(
            floor_ms_per_step(built, c, WORKLOAD.mean_length, BANDWIDTH), rel=1e-12)
        assert found.floor_ms_per_step[str(c)] > floor_ms_per_step(model, c, WORKLOAD.mean_length, BANDWIDTH)
    assert [(k.kind, k.layers, k.measured, k.stand_in) for k in found.kinds] == [
        (f"{HCA} / hash_moe", 3, 1, ""), (f"{CSA} / moe", 2, 1, ""), (f"{HCA} / moe", 2, 0, f"{HCA} / hash_moe")]


def test_a_config_without_per_layer_kinds_has_layers_of_one_kind():
    assert depth.layer_kinds(load_config("tiny-llama")) == [depth.ALIKE] * 2


def test_a_kind_the_preset_lacks_stands_in_by_attention_type_first():
    measured = Counter({f"{CSA} / hash_moe": 2, f"{HCA} / hash_moe": 1})
    assert depth.stand_in(f"{HCA} / moe", measured) == f"{HCA} / hash_moe"
    assert depth.stand_in("sliding_attention / moe", measured) == f"{CSA} / hash_moe"  # the most layers profiled


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """tiny-deepseek-v4-flash profiled at C = 2 as bench profiles it, by layer, and its full depth."""
    model = load_model(TINY, torch.float32, torch.device("cpu"))
    trace = profile_step(model, 2, WORKLOAD.prompt_len, WORKLOAD.max_len, "eager", tmp_path_factory.mktemp("p"), 2)
    return model, attribute([trace], "layer"), depth.full_depth(PUBLISHED[TINY], model, [2], WORKLOAD, BANDWIDTH)


def test_the_whole_model_is_outside_plus_each_kinds_layers_at_their_mean_scaled_to_the_timed_step(profiled):
    model, layers, full = profiled
    by_layer = dict(zip(layers.table["label"], layers.table["gpu_ms_per_step"]))
    outside, hca, csa = by_layer[NO_LAYER], by_layer[0], by_layer[1]  # the preset's layers: HCA / hash, CSA / moe
    assert min(outside, hca, csa) > 0
    timed = 2.5 * (outside + hca + csa)
    point = depth.depth_point(full, layers, depth.layer_kinds(model.config), Row("eager", "eager", 2, "ok",
                                                                                   ms_per_step=timed))
    assert point.profiled_ms == pytest.approx(outside + hca + csa) and point.scale == pytest.approx(2.5)
    assert point.ms_per_layer == pytest.approx({f"{HCA} / hash_moe": hca, f"{CSA} / moe": csa})
    # 3 heavily compressed hash-routed layers, 2 compressed-sparse, 2 heavily compressed learned-routed (at the
    # hash-routed ones' time: the preset has none)
    assert point.ms_per_step == pytest.approx(2.5 * (outside + 3 * hca + 2 * csa + 2 * hca))
    assert point.tok_per_s == pytest.approx(2e3 / point.ms_per_step)
    assert point.pct_of_floor == pytest.approx(100 * full.floor_ms_per_step["2"] / point.ms_per_step)


def test_a_preset_extrapolated_to_its_own_depth_is_its_timed_step(profiled):
    model, layers, full = profiled
    kinds = depth.layer_kinds(model.config)
    own = FullDepth(TINY, 2, 2, [record.LayerKind(kind, 1, 1) for kind in kinds], full.floor_ms_per_step)
    point = depth.depth_point(own, layers, kinds, Row("eager", "eager", 2, "ok", ms_per_step=7.0))
    assert point.ms_per_step == pytest.approx(7.0)


def run_cli(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    result = run_cli("bench", "--model", TINY, *FAST, "--json", "--runs-dir", str(runs))
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_bench_records_the_whole_model_as_it_goes_and_it_round_trips(bench_json):
    doc, stderr = bench_json
    full = doc["full_depth"]
    assert full["published"] == PUBLISHED[TINY].name and (full["layers"], full["measured_layers"]) == (7, 2)
    assert [(p["variant"], p["concurrency"]) for p in full["points"]] == [("eager", 1), ("eager", 2)]
    rows = {r["concurrency"]: r for r in doc["before"]}
    for p in full["points"]:
        assert p["measured_ms"] == rows[p["concurrency"]]["ms_per_step"]
        assert p["scale"] == pytest.approx(p["measured_ms"] / p["profiled_ms"])
    assert set(doc["attribution_before"]) == {"1", "2"}  # the profile the estimate was made from
    assert stderr.count("(7 layers, extrapolated from 2): eager C=") == 2  # a progress line per point
    saved = json.loads((Path(doc["run_dir"]) / "results.json").read_text())
    assert saved["full_depth"] == full
    assert record.from_json(saved).to_json() == saved


def saved_record(doc: dict) -> dict:
    """``--json``'s document less what it adds to the run record, a copy of its own."""
    return copy.deepcopy({k: v for k, v in doc.items() if k not in ("run_dir", "device_kind", "timing_note")})


def test_the_record_refuses_a_floor_keyed_by_no_concurrency(bench_json):
    doc = saved_record(bench_json[0])
    doc["full_depth"]["floor_ms_per_step"] = {"C1": 1.0}
    with pytest.raises(record.OptiqError, match=r"full_depth.floor_ms_per_step: key 'C1' is not a concurrency"):
        record.from_json(doc)


def test_the_report_holds_the_per_layer_and_whole_model_tables(bench_json):
    run = record.from_json(saved_record(bench_json[0]))
    doc = report_document(run)
    text = render_markdown(doc)
    assert "<h2>Whole model: a tiny DeepSeek-V4, 7 layers, extrapolated from 2</h2>" in render_html(doc)
    assert "## Per layer (eager): CPU self time, ms per layer" in text
    assert "## Whole model: a tiny DeepSeek-V4, 7 layers, extrapolated from 2" in text
    assert f"| {HCA} / moe | 0 of 2 | — | — |" in text and f"its 2 counted at {HCA} / hash_moe's time" in text
    assert "an extrapolation from 2 of 7 layers" in text


def h200_like() -> record.RunRecord:
    """A bench record of deepseek-v4-flash as an H200 would write it: the model and optiq's fused model at C = 1,
    16 and 64, with GPU-sized numbers, for the table widths."""
    kinds = depth.layer_kinds(PUBLISHED["deepseek-v4-flash"].config())
    full = FullDepth("DeepSeek-V4-Flash", 43, 6, [record.LayerKind(k, n, 2) for k, n in Counter(kinds).items()],
                     {"1": 8.123, "16": 31.456, "64": 57.789},
                     [DepthPoint(v, c, 1.234, {k: 12.345 for k in kinds}, 80.0, 99.999, 1.25, 1234.567, 51.8, 12.3)
                      for v in ("eager", "optiq+eager") for c in (1, 16, 64)], "GPU time", ["compile+eager"])
    env = record.Environment("NVIDIA H200", "2.13.0", "5.25.0", "13.0", "3.12", "0.1.0", "cuda")
    return record.RunRecord("bench", "deepseek-v4-flash", "bfloat16", "eager", env, Workload(), [1, 16, 64],
                            full_depth=full)


def test_the_whole_model_tables_fit_80_columns():
    console = Console(file=io.StringIO(), width=80, markup=False, emoji=False, color_system=None)
    for table in depth_tables(h200_like()):
        console.print(views.rich_table(table))
    text = console.file.getvalue()
    assert all(cell_len(line) <= 80 for line in text.splitlines())
    assert f"{HCA} / hash_moe" in text and "12.345" in text and "1234.567" in text  # kinds and numbers whole
    assert "Whole model: DeepSeek-V4-Flash, 43 layers, extrapolated from 6" in text
    assert text.count("Per layer (") == 2 and "scale" in text and "1.25×" in text  # no column left out


def test_bench_prints_the_whole_model_in_80_columns(tmp_path, monkeypatch):
    console = Console(file=io.StringIO(), width=80, markup=False, emoji=False, color_system=None)
    monkeypatch.setattr(bench, "out", console)
    assert run_cli("bench", "--model", TINY, *FAST, "--runs-dir", str(tmp_path)).exit_code == 0
    text = console.file.getvalue()
    assert all(cell_len(line) <= 80 for line in text.splitlines())
    assert "Whole model: a tiny DeepSeek-V4, 7 layers, extrapolated from 2" in text and "(outside the layers)" in text


def test_a_model_that_is_no_truncated_preset_shows_nothing_new(tmp_path, monkeypatch):
    console = Console(file=io.StringIO(), width=80, markup=False, emoji=False, color_system=None)
    monkeypatch.setattr(bench, "out", console)
    assert run_cli("bench", "--model", "tiny-llama", *FAST, "--runs-dir", str(tmp_path / "runs")).exit_code == 0
    text = console.file.getvalue()
    assert "Whole model" not in text and "Per layer" not in text
    [run_dir] = (tmp_path / "runs").iterdir()
    saved = json.loads((run_dir / "results.json").read_text())
    assert saved["full_depth"] is None and saved["attribution_before"] == {}  # not profiled, as before
    assert not list(run_dir.glob("trace_*"))


def test_the_fused_model_is_profiled_and_extrapolated_beside_the_model(tmp_path):
    """bench --recipes: the whole model of optiq's fused preset too, from its own profile after the gate."""
    result = run_cli("bench", "--model", TINY, *FAST, "--recipes", "rmsnorm", "--gate-steps", "4", "--json",
                     "--runs-dir", str(tmp_path / "runs"))
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["fusion"]["applied"] == ["rmsnorm"]
    assert [(p["variant"], p["concurrency"]) for p in doc["full_depth"]["points"]] == [
        ("eager", 1), ("eager", 2), ("optiq+eager", 1), ("optiq+eager", 2)]
    assert set(doc["attribution_after"]) == {"1", "2"} and doc["full_depth"]["not_profiled"] == []
    fused = {r["concurrency"]: r["ms_per_step"] for r in doc["after"]}
    assert all(p["measured_ms"] == fused[p["concurrency"]] for p in doc["full_depth"]["points"][2:])
