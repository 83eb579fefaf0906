"""vLLM's and SGLang's traces as they write them today and before (tests/data/engine_traces.py): decode steps, ms per
step, ranks, collectives and what a step is, through ``optiq analyze`` as a person runs it on a profile folder."""

import json

import pytest
from click.testing import CliRunner

from cli_lines import error_line
from data import engine_traces as et
from optiq.cli import cli
from optiq.traces.op_classes import class_of_kernel
from optiq.traces.reader import read_trace, read_traces


def analyze(*args):
    return CliRunner().invoke(cli, ["analyze", *map(str, args)])


def one_error_line(result) -> str:
    """The failed run's one error line, and nothing on stdout."""
    assert result.exit_code != 0 and not result.stdout, result.output
    return error_line(result.stderr)


def results(*args) -> dict:
    """The JSON document's scopes by their first word pair ("rank 0", "all 2")."""
    result = analyze(*args, "--json")
    assert result.exit_code == 0, result.output
    return {" ".join(s["scope"].split()[:2]): s for s in json.loads(result.stdout)["results"]}


# (writer, decode layer, sampling us per step, drafting us per step, step source)
FORMATS = {
    "vllm": (lambda out: et.vllm_traces(out), et.VLLM_LAYER, 18, 0, "vllm"),
    "vllm detailed": (lambda out: et.vllm_traces(out, style="detailed"), et.VLLM_LAYER, 18, 0, "vllm"),
    "vllm before Dec 2025": (lambda out: et.vllm_traces(out, style="old"), et.VLLM_LAYER, 18, 0, "vllm"),
    "vllm moe": (lambda out: et.vllm_traces(out, layer=et.VLLM_MOE_LAYER), et.VLLM_MOE_LAYER, 18, 0, "vllm"),
    # vLLM drafts in sample_tokens, outside any range: its drafting counts with sampling, after the step
    "vllm speculative": (lambda out: et.vllm_traces(out, speculative=True), et.VLLM_LAYER, 38, 0, "vllm"),
    "sglang": (lambda out: et.sglang_traces(out, mixed=True), et.SGL_LAYER, 18, 0, "sglang"),
    "sglang speculative": (lambda out: et.sglang_traces(out, speculative="new"), et.SGL_LAYER, 18, 60, "sglang"),
    # the draft's first two passes follow the prefill step (nothing marks them), so they stay outside: 140 / 3
    "sglang speculative, older": (lambda out: et.sglang_traces(out, speculative="old"), et.SGL_LAYER, 18, 140 / 3,
                                  "sglang"),
    "sglang by stage": (lambda out: et.sglang_by_stage(out), et.SGL_LAYER, 18, 0, "sglang"),
    "sglang merged": (lambda out: [et.sglang_merged(out)], et.SGL_LAYER, 18, 0, "sglang"),
}


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_gives_decode_steps_ms_ranks_and_collectives(tmp_path, name):
    write, layer, sampling_us, draft_us, source = FORMATS[name]
    scopes = results(*write(tmp_path))
    assert list(scopes) == ["rank 0", "rank 1", "all 2"]
    for rank in (0, 1):
        scope = scopes[f"rank {rank}"]
        summary = scope["summary"]
        assert summary["steps"] == 3 and summary["ranks"] == 1 and scope["step_source"] == [source]
        assert summary["gpu_ms_per_step"] == pytest.approx(et.forward_us(layer, rank) / 1000)
        assert summary["collectives"]["share"] == pytest.approx(et.collective_us(layer, rank) /
                                                                et.forward_us(layer, rank))
        assert summary["outside_step_ms_per_step"]["sampling"] == pytest.approx(sampling_us / 1000)
        assert summary["outside_step_ms_per_step"]["draft"] == pytest.approx(draft_us / 1000)
        assert "forward" in summary["step_definition"] and "shown apart" in summary["step_definition"]
    together = scopes["all 2"]["summary"]
    assert together["ranks"] == 2
    assert together["collectives"]["skew_ms"] == pytest.approx(
        (et.collective_us(layer, 1) - et.collective_us(layer, 0)) / 1000)
    assert together["collectives"]["ms_per_step"] == {str(r): pytest.approx(et.collective_us(layer, r) / 1000)
                                                      for r in (0, 1)}


def test_triton_attention_of_sglang_is_attention(tmp_path):
    (path,) = et.sglang_traces(tmp_path, ranks=1, layer=et.SGL_TRITON_LAYER)
    table = {row["class"]: row["gpu_ms_per_step"] for row in results(path)["rank 0"]["table"]}
    assert table["attention"] == pytest.approx(2 * (14 + 4) / 1000) and "collective" not in table


@pytest.mark.parametrize("name, expected", [
    (et.FI_RMS_NORM, "norm"), (et.FI_ADD_RMS_NORM, "norm"), (et.FI_SILU_AND_MUL, "activation"),
    (et.FI_ROTARY, "rope"), (et.FI_DECODE, "attention"), (et.FI_SAMPLING, "sampling"), (et.VLLM_RMS_NORM, "norm"),
    (et.VLLM_ADD_RMS_NORM, "norm"), (et.VLLM_SILU_AND_MUL, "activation"), (et.VLLM_ROTARY, "rope"),
    (et.VLLM_CACHE_WRITE, "copy_"), (et.FLASH_DECODE, "attention"), (et.FLASH_PREFILL, "attention"),
    (et.FUSED_MOE, "grouped_gemm"), (et.MOE_ALIGN, "scatter_gather"), (et.VLLM_SCALED_MM, "gemm"),
    (et.CUBLAS_GEMM, "gemm"), (et.VLLM_CUSTOM_ALL_REDUCE, "collective"), (et.NCCL_ALL_REDUCE, "collective"),
    ("void marlin::Marlin<(vllm::ScalarType::Id)5, 256, 1, 8, 8, 4, false>(int4 const*, int4 const*)", "gemm"),
])
def test_engine_kernels_have_their_class(name, expected):
    assert class_of_kernel(name) == expected


def test_step_markers_decode_or_not(tmp_path):
    """Which markers are decode steps: no context request and some generating ones (vLLM), DECODE or the target's
    verify (SGLang); prefill, mixed and draft steps are not."""
    (path, *_) = et.vllm_traces(tmp_path / "detailed", ranks=1, style="detailed", frontend=False)
    trace = read_trace(path)
    assert list(trace.steps["name"]) == [et.vllm_marker(0, 0, 4, "detailed")] * 3
    assert "2 non-decode vllm step(s) (prefill/mixed) left out" in trace.notes
    (path,) = et.sglang_traces(tmp_path / "spec", ranks=1, speculative="new")
    trace = read_trace(path)
    assert list(trace.steps["name"]) == ["step[VERIFY bs=4]"] * 3
    assert set(trace.kernels["phase"]) == {"step", "sampling", "draft", "outside"}


def test_frontend_trace_is_left_out_with_a_note_and_alone_is_an_error(tmp_path):
    paths = et.vllm_traces(tmp_path)
    frontend = paths[-1]
    assert ".async_llm." in frontend.name
    result = analyze(*paths)
    assert result.exit_code == 0, result.output
    assert f"{frontend.name}: a CPU-only frontend trace: left out of the GPU table" in result.output
    alone = analyze(frontend)
    line = one_error_line(alone)
    assert alone.exit_code == 1 and "frontend trace" in line and "worker traces" in line


def test_cpu_only_trace_beside_gpu_ones_is_left_out(tmp_path):
    from data.make_traces import cpu_trace
    cpu = cpu_trace(tmp_path / "cpu.json")
    scopes = results(*et.vllm_traces(tmp_path, frontend=False), cpu)
    assert list(scopes) == ["rank 0", "rank 1", "all 2"]
    assert "cpu.json: a CPU-only trace: left out of the GPU table" in scopes["all 2"]["notes"]


def test_merged_file_splits_into_ranks_by_pid_label(tmp_path):
    traces = read_traces(et.sglang_merged(tmp_path))
    assert [(t.rank, t.label) for t in traces] == [(0, "TP00"), (1, "TP01")]
    # correlation and External ids repeat across ranks: each rank, linked on its own, reads as its own file does
    for merged, alone in zip(traces, et.sglang_traces(tmp_path / "alone")):
        own = read_trace(alone)
        columns = ["dur", "step", "phase", "op_class", "method"]
        assert merged.kernels[columns].equals(own.kernels[columns]) and merged.steps.equals(own.steps)
    with pytest.raises(Exception, match="holds 2 ranks"):
        read_trace(et.sglang_merged(tmp_path))


def test_prefill_only_files_alone_are_an_error(tmp_path):
    extend = [p for p in et.sglang_by_stage(tmp_path) if "-EXTEND" in p.name]
    result = analyze(*extend)
    assert result.exit_code == 1 and "no decode step" in result.output


def test_every_table_says_what_a_step_is(tmp_path):
    output = analyze(*et.vllm_traces(tmp_path)).output
    assert output.count("step: one decode forward (vLLM's execute_..._generation_N range)") == 3
    assert "collectives: " in output and "skew across ranks 0.020 ms/step" in output


def test_compare_two_builds_shows_what_moved_in_80_columns(tmp_path):
    before = et.vllm_traces(tmp_path / "dense", ranks=1, frontend=False)
    after = et.vllm_traces(tmp_path / "moe", ranks=1, layer=et.VLLM_MOE_LAYER, frontend=False)
    result = analyze("--compare", *before, *after)
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    assert "what moved · by class" in result.output and "what moved · by role" in result.output
    doc = json.loads(analyze("--compare", *before, *after, "--json").stdout)["compare"]
    rows = {row["class"]: row for row in doc["class"]}
    assert doc["class"][0]["class"] == "grouped_gemm"  # the largest move first
    assert rows["grouped_gemm"]["before_ms_per_step"] == 0
    assert rows["grouped_gemm"]["after_ms_per_step"] == pytest.approx(2 * 70 / 1000)
    dense_gemm = sum(us for name, us in et.layer_kernels(et.VLLM_LAYER) if class_of_kernel(name) == "gemm")
    moe_gemm = sum(us for name, us in et.layer_kernels(et.VLLM_MOE_LAYER) if class_of_kernel(name) == "gemm")
    assert rows["gemm"]["delta_ms_per_step"] == pytest.approx((moe_gemm - dense_gemm) / 1000)
    assert doc["counted_phases"] == ["step"]


def test_compare_with_optiq_own_trace_counts_sampling_on_both_sides(tmp_path):
    from test_analyze_cli import EAGER
    engine = et.vllm_traces(tmp_path, ranks=1, frontend=False)
    doc = json.loads(analyze("--compare", EAGER, *engine, "--json").stdout)["compare"]
    assert doc["counted_phases"] == ["step", "sampling", "draft"]
    sampling = {row["class"]: row for row in doc["class"]}["sampling"]
    assert sampling["after_ms_per_step"] == pytest.approx((9 + 4) / 1000)  # FlashInfer's sampler and the argmax


def test_misspelt_model_type_is_a_one_line_error_with_close_matches(tmp_path):
    (path,) = et.sglang_traces(tmp_path, ranks=1)
    line = one_error_line(analyze(path, "--proposals", "lama"))
    assert "unknown model type 'lama'" in line and "llama" in line
    assert analyze(path, "--proposals", "llama").exit_code == 0


def test_a_prefill_stage_file_with_decode_steps_still_counts_with_its_rank(tmp_path):
    """profile_by_stage's -EXTEND file holds no decode step today; were one to slip in, the rank stays one rank."""
    for rank in (0, 1):
        et.write(tmp_path / et.sglang_name("7", rank, "EXTEND"), et.document(et.sglang_rank(rank, 1), rank, 2))
        et.write(tmp_path / et.sglang_name("7", rank, "DECODE"),
                 et.document(et.sglang_rank(rank, 3, stages=("DECODE",)), rank, 2))
    scopes = results(*sorted(tmp_path.iterdir()))
    assert list(scopes) == ["rank 0", "rank 1", "all 2"] and scopes["all 2"]["summary"]["steps"] == 6
    assert "7-TP-0-EXTEND.trace.json.gz: the prefill stage of a rank whose -DECODE file is given: left out" in \
        scopes["all 2"]["notes"]


def test_compare_refuses_options_it_would_ignore(tmp_path):
    (before,), (after,) = et.sglang_traces(tmp_path / "a", ranks=1), et.sglang_traces(tmp_path / "b", ranks=1)
    result = analyze("--compare", before, after, "--csv", tmp_path / "rows.csv")
    assert result.exit_code != 0 and "it takes no --csv" in result.output
