"""The bandwidth floor of a decode step: the bytes it must read over the bytes per second the device can copy.

A decode step reads every weight it uses once and the filled part of the KV cache once; at decode batch sizes that
dwarfs the arithmetic, so no implementation beats ``bytes / bandwidth``. The bandwidth is measured, not taken from a
datasheet: a large device-to-device copy, counting bytes read plus bytes written, cached per device.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch

from optiq.rundir import write_json
from optiq.zoo import ATTENTION_LAYER_TYPES, config_value
from optiq.measure.timing import Timer


def _cache_file() -> Path:
    root = Path(os.environ.get("OPTIQ_CACHE_DIR", Path.home() / ".cache" / "optiq"))
    root.mkdir(parents=True, exist_ok=True)
    return root / "bandwidth.json"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{os.cpu_count()}"


def measure_copy_bandwidth(device: torch.device, megabytes: int | None = None, repeats: int = 20) -> float:
    """Bytes per second of a large tensor copy on ``device`` (read + write), median of ``repeats`` after warm-up."""
    megabytes = megabytes or (2048 if device.type == "cuda" else 256)
    src = torch.rand(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        with Timer(device) as t:
            dst.copy_(src)
        times.append(t.seconds)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """The measured copy bandwidth, from the per-device cache or measured once and cached."""
    path, name = _cache_file(), device_name(device)
    known = json.loads(path.read_text()) if path.exists() else {}
    if name not in known:
        known[name] = measure_copy_bandwidth(device)
        write_json(path, known)
    return known[name]


def _experts(config) -> tuple[int, int]:
    """(routed experts, experts per token) of a MoE config, (0, 0) for a dense one."""
    total = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or 0
    return total, getattr(config, "num_experts_per_tok", 0) if total else 0


def weight_bytes_per_step(model: torch.nn.Module, batch: int) -> float:
    """Weight bytes one decode step must read.

    The input embedding is a gather of ``batch`` rows (unless tied to the LM head, which reads all of it); of a MoE
    layer's routed experts a step reads only those its tokens pick: with uniform routing, ``E * (1 - (1 - k/E)^batch)``
    distinct experts in expectation.
    """
    config = model.config.get_text_config(decoder=True)
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:
        total -= embed.numel() * embed.element_size() * (1 - min(batch, embed.shape[0]) / embed.shape[0])
    n_experts, top_k = _experts(config)
    if n_experts:
        expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
        touched = n_experts * (1 - (1 - top_k / n_experts) ** batch)
        total -= expert_bytes * (1 - touched / n_experts)
    return total


def cache_layout(config) -> tuple[int, int, int] | None:
    """(heads, key width, value width) of one attention layer's cache, or None where the config does not say (widths
    that vary by layer, a model without attention). MLA models (DeepSeek-V2/V3) cache their compressed latent as one
    head: the kv_lora_rank-wide latent where keys go and the shared rope key where values go."""
    if config_value(config, "kv_lora_rank"):
        return 1, config.kv_lora_rank, config.qk_rope_head_dim
    heads, hidden = config_value(config, "num_attention_heads"), config_value(config, "hidden_size")
    head_dim = config_value(config, "head_dim") or (hidden // heads if heads and hidden else None)
    if not heads or not head_dim:
        return None
    return config_value(config, "num_key_value_heads") or heads, head_dim, head_dim


def _compressed_layer_elements(config, kind: str, length: float, rates: dict) -> float:
    """Cache elements one sequence's layer of DeepSeek-V4 reads at ``length`` positions: its one key-and-value head
    over the sliding window; a heavily compressed layer every compressed entry (one per ``rate`` positions) too; a
    compressed-sparse one the ``index_topk`` entries its indexer picks, and every entry's indexer key to pick them."""
    elements = min(length, config.sliding_window) * config.head_dim
    rate = rates.get(kind)
    if not rate:
        return elements
    entries = length // rate
    if kind == "compressed_sparse_attention":
        return elements + min(entries, config.index_topk) * config.head_dim + entries * config.index_head_dim
    return elements + entries * config.head_dim


def kv_bytes_per_step(model: torch.nn.Module, batch: int, length: float) -> float:
    """KV-cache bytes attention must read when each of ``batch`` sequences holds ``length`` positions: a sliding
    layer reads its window only, a layer that is not attention nothing, a compressed layer (DeepSeek-V4) its window
    and the compressed entries it attends to (``_compressed_layer_elements``). Where the widths are unknown, 0 (the
    floor is then the weights', still a bound no step beats)."""
    config = model.config.get_text_config(decoder=True)
    element = next(model.parameters()).element_size()
    rates = config_value(config, "compress_rates")
    if rates:
        return batch * element * sum(_compressed_layer_elements(config, kind, length, rates)
                                     for kind in config.layer_types)
    layout = cache_layout(config)
    if layout is None:
        return 0.0
    heads, key_width, value_width = layout
    types = config_value(config, "layer_types") or ["full_attention"] * config.num_hidden_layers
    window = config_value(config, "sliding_window") or length
    positions = sum(min(length, window) if kind == "sliding_attention" else length
                    for kind in types if kind in ATTENTION_LAYER_TYPES)
    return batch * heads * (key_width + value_width) * positions * element


def floor_ms_per_step(model: torch.nn.Module, batch: int, mean_length: float, bandwidth: float) -> float:
    """The fastest a decode step can run: its bytes over the copy bandwidth, in milliseconds."""
    step_bytes = weight_bytes_per_step(model, batch) + kv_bytes_per_step(model, batch, mean_length)
    return step_bytes / bandwidth * 1e3
