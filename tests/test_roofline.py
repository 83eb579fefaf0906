"""The floor counts the bytes a decode step must read, and the bandwidth is measured once per device."""

import json

import pytest
import torch

from optiq.measure import roofline
from optiq.models import load_model


def _bytes(tensor):
    return tensor.numel() * tensor.element_size()


def test_dense_weight_bytes_skip_the_embedding_gather():
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    total = sum(_bytes(p) for p in model.parameters())
    embed = model.get_input_embeddings().weight
    batch = 3
    expected = total - _bytes(embed) + batch * embed.shape[1] * embed.element_size()
    assert roofline.weight_bytes_per_step(model, batch) == pytest.approx(expected)


def test_moe_weight_bytes_count_only_experts_touched():
    model = load_model("tiny-qwen3-moe", torch.float32, torch.device("cpu"))
    experts = sum(_bytes(p) for n, p in model.named_parameters() if ".experts." in n)
    assert experts > 0
    embed = model.get_input_embeddings().weight
    at_one = roofline.weight_bytes_per_step(model, 1)
    at_many = roofline.weight_bytes_per_step(model, 4096)
    # One token touches top-k of E experts per layer; thousands touch them all (and gather every embedding row).
    extra_embedding_rows = (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    assert at_many - at_one - extra_embedding_rows == pytest.approx(experts * (1 - 2 / 8), rel=1e-3)


def test_kv_bytes():
    model = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    # 2 (K and V) x 2 layers x batch 4 x 2 KV heads x head dim 16 x 100 positions x 4 bytes
    assert roofline.kv_bytes_per_step(model, 4, 100) == 2 * 2 * 4 * 2 * 16 * 100 * 4


def test_bandwidth_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIQ_CACHE_DIR", str(tmp_path))
    device = torch.device("cpu")
    first = roofline.copy_bandwidth(device)
    assert first > 1e8  # any machine copies more than 100 MB/s
    cached = json.loads((tmp_path / "bandwidth.json").read_text())
    assert cached[roofline.device_name(device)] == first
    assert roofline.copy_bandwidth(device) == first


def test_deepseek_v4_kv_bytes_count_the_window_and_the_compressed_entries_attended():
    """tiny-deepseek-v4 at 41 positions: every layer its one shared key-value head over the 8-position window; the
    heavily compressed layer (one entry per 4 positions) all 10 entries; the compressed-sparse one (per 2) the 4 its
    indexer keeps, and all 20 entries' 16-wide indexer keys."""
    model = load_model("tiny-deepseek-v4", torch.float32, torch.device("cpu"))
    window = 8 * 32
    elements = (window + 10 * 32) + (window + 4 * 32 + 20 * 16) + window
    assert roofline.kv_bytes_per_step(model, 3, 41) == 3 * elements * 4
