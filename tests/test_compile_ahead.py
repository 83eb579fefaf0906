"""Kernels compiled ahead in child processes: the one-layer copy of a config, the engines each child steps through,
and children that really run (on the CPU under the interpreter; on a GPU they must leave the kernels in Triton's
on-disk cache)."""

from pathlib import Path

import pytest
import torch

from optiq import compile_ahead
from optiq.models import load_config

GATE = {"concurrencies": (1, 16, 64), "steps": 64, "prompt_len": 512, "mode": "graph"}


@pytest.mark.parametrize("preset, layers", [("qwen3-0.6b", 1), ("llama-3.1-8b", 1), ("qwen3-30b-a3b", 1),
                                            ("deepseek-v2-lite", 2)])
def test_one_layer_of_each_kind_keeps_the_shapes_and_cuts_per_layer_lists(preset, layers):
    config = load_config(preset)
    cut = compile_ahead.one_layer_of_each_kind(config)
    assert cut.num_hidden_layers == layers and config.num_hidden_layers > layers
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(cut, name) == getattr(config, name)
    if getattr(config, "layer_types", None) is not None:
        assert len(cut.layer_types) == layers and len(config.layer_types) == config.num_hidden_layers


def test_each_concurrency_gets_a_child_with_the_gate_and_workload_engines_and_the_largest_the_capture():
    plan = compile_ahead.engines(GATE, prompt_len=512, max_len=1024)
    assert plan == [[(64, 514, 512), (64, 577, 512), (64, 1024, 512)],
                    [(16, 577, 512), (16, 1024, 512)],
                    [(1, 577, 512), (1, 1024, 512)]]


def test_source_is_none_off_cuda_and_when_turned_off(monkeypatch):
    assert compile_ahead.source(torch.device("cpu"), "tiny-llama", "fp32", (), 16, 40) is None
    monkeypatch.setenv("OPTIQ_COMPILE_AHEAD", "0")
    assert compile_ahead.source(torch.device("cuda"), "tiny-llama", "fp32", (), 16, 40) is None


def _run_children(names, dtype):
    source = compile_ahead.Source("tiny-llama", dtype, (), prompt_len=8, max_len=24)
    gate = {"concurrencies": (1, 2), "steps": 4, "prompt_len": 8, "mode": "eager"}
    with compile_ahead.running(source, names, gate) as children:
        pass  # the block ends at once: every child is waited for (or stopped) on the way out
    return children


def test_children_run_the_patched_one_layer_model_or_say_why_they_failed(monkeypatch):
    monkeypatch.setattr(compile_ahead.subprocess.Popen, "poll", lambda self: self.wait())  # let them finish
    dtype = "bf16" if torch.cuda.is_available() else "fp32"
    done = _run_children(["rmsnorm", "decode_attention"], dtype)
    assert [c.status for c in done] == ["done", "done"] and all(c.seconds > 0 for c in done)
    assert [len(c.engines) for c in done] == [3, 2]
    failed = _run_children(["no_such_recipe"], dtype)
    assert all(c.status.startswith("failed: KeyError") and "no_such_recipe" in c.status for c in failed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the interpreter compiles nothing")
def test_children_leave_the_kernels_in_tritons_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_ahead.subprocess.Popen, "poll", lambda self: self.wait())
    assert [c.status for c in _run_children(["rmsnorm"], "bf16")] == ["done", "done"]
    assert any(p.name == "_rmsnorm_kernel.json" for p in Path(tmp_path).rglob("*.json"))


def test_children_still_compiling_when_the_gate_ends_are_stopped():
    stopped = _run_children(["rmsnorm"], "fp32")
    assert [c.status for c in stopped] == ["stopped", "stopped"] and all(c.seconds is None for c in stopped)
