"""Kernels compiled ahead in worker processes: the one-layer copy of a config, the engine each worker steps
through, and workers that really run (on the CPU under the interpreter; on a GPU they must leave the kernels in Triton's
on-disk cache)."""

from pathlib import Path

import pytest
import torch

from optiq import compile_ahead
from optiq.gate import GatePlan
from optiq.models import load_config

GATE = GatePlan.for_workload((1, 16, 64), steps=64, prompt_len=512, max_len=1024, mode="graph")


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


def test_each_engine_the_fused_model_meets_gets_a_worker_in_the_order_it_meets_them():
    # The capture steps at the workload's longest context first (the measured workload's engines, listed once),
    # then the teacher-forced decodes.
    assert compile_ahead.engines(GATE, prompt_len=512, max_len=1024) == [
        (1, 1024, 512), (16, 1024, 512), (64, 1024, 512), (1, 577, 512), (16, 577, 512), (64, 577, 512)]


def test_no_workers_off_cuda_or_when_turned_off(monkeypatch):
    source = compile_ahead.Source("tiny-llama", "fp32", (), 16, 40)
    with compile_ahead.workers(torch.device("cpu"), source, GATE) as ahead:
        assert ahead is None
    monkeypatch.setenv("OPTIQ_COMPILE_AHEAD", "0")
    with compile_ahead.workers(torch.device("cuda"), source, GATE) as ahead:
        assert ahead is None


@pytest.mark.parametrize("preset, low, high", [("deepseek-v4-flash", 15.0, 16.0), ("llama-3.1-8b", 2.4, 2.6)])
def test_a_copy_is_counted_without_building_it(preset, low, high):
    # V4-Flash's one layer is its 256 experts (12.9 GB) beside the embeddings and head: five copies are 76 GB, more
    # than the GPU has free beside its 81 GB model; Llama-3.1-8B's is its embeddings and head (1 GB each) and a layer.
    assert low < compile_ahead.copy_bytes(compile_ahead.Source(preset, "bf16", (), 512, 1024)) / 1e9 < high


DTYPE = "bf16" if torch.cuda.is_available() else "fp32"
SMALL_GATE = GatePlan((2,), steps=4, prompt_len=8)  # the gate's one engine and the workload's: two workers


def _workers():
    return compile_ahead.Workers(compile_ahead.Source("tiny-llama", DTYPE, (), prompt_len=8, max_len=24), SMALL_GATE)


def _compile(workers, names):
    with workers.compiling(names) as children:
        pass  # the block ends at once: every worker is waited for (or stopped) on the way out
    return children


@pytest.fixture
def waited_for(monkeypatch):
    """Workers' ends wait for them to finish instead of stopping them."""
    monkeypatch.setattr(compile_ahead.subprocess.Popen, "poll", lambda self: self.wait())


def test_workers_run_the_patched_one_layer_model_or_say_why_they_failed(waited_for):
    workers = _workers()
    done = _compile(workers, ["rmsnorm", "decode_attention"])
    assert [c.status for c in done] == ["done"] * 2 and [c.engine for c in done] == [[2, 13, 8], [2, 24, 8]]
    assert all(c.ready_s > 0 and c.seconds > 0 for c in done)
    failed = _compile(workers, ["no_such_recipe"])  # a second round: new workers
    assert all(c.status.startswith("failed: KeyError") and "no_such_recipe" in c.status for c in failed)
    assert all(c.ready_s > 0 and c.seconds is None for c in failed)  # they got as far as waiting for the names


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the interpreter compiles nothing")
def test_workers_leave_the_kernels_in_tritons_disk_cache(tmp_path, monkeypatch, waited_for):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert [c.status for c in _compile(_workers(), ["rmsnorm"])] == ["done"] * 2
    assert any(p.name == "_rmsnorm_kernel.json" for p in Path(tmp_path).rglob("*.json"))


def test_workers_still_compiling_when_the_gate_ends_are_stopped_and_unused_ones_on_close():
    workers = _workers()
    processes = [w.process for w in workers.waiting]
    stopped = _compile(workers, ["rmsnorm"])
    assert [c.status for c in stopped] == ["stopped"] * 2 and all(c.seconds is None for c in stopped)
    assert all(p.returncode is not None for p in processes)
    unused = _workers()
    processes = [w.process for w in unused.waiting]
    unused.close()
    assert all(p.returncode is not None for p in processes) and not unused.waiting
