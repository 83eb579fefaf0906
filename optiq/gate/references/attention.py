"""The attention of the gate's fp32 reference decode: softmax attention with each kv head's query heads grouped,
in plain torch matmuls, instead of HF's sdpa path with its ``repeat_kv``.

transformers' sdpa path copies every kv head's keys and values once per query head before a masked sdpa call; in
the fp32 reference of a GQA model at a serving batch those copies and fp32 sdpa were half of its GPU time
(scripts/gate_profile.py, BENCHMARKS.md). Grouping the query heads instead reads each key and value once. It is the
same function (one softmax over the masked scores per query head), and it shares no code with the kernels the gate
checks. Prompts (several query tokens) keep HF's own path.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

NAME = "optiq_reference"


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF's attention-function interface: query [B, Hq, S, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv] (MLA's Dv
    differs), a boolean (True = attend) or additive mask broadcastable to [B, 1, S, L]; returns ([B, S, Hq, Dv],
    None). One query token per sequence runs here; more go to HF's sdpa function."""
    batch, num_q_heads, q_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if q_len != 1 or dropout:
        return AttentionInterface._global_mapping["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                                          dropout=dropout, **kwargs)
    scale = scaling if scaling is not None else head_dim ** -0.5
    grouped = query.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = grouped @ key.transpose(-1, -2) * scale  # [B, Hkv, G, L]
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[2]]  # [B or 1, 1, 1, L], as HF's sdpa function slices it
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = scores.softmax(dim=-1) @ value  # [B, Hkv, G, Dv]
    return out.reshape(batch, 1, num_q_heads, value.shape[-1]), None


AttentionInterface.register(NAME, grouped_attention)
AttentionMaskInterface.register(NAME, AttentionMaskInterface._global_mapping["sdpa"])


@contextmanager
def grouped_decode_attention(model: torch.nn.Module):
    """The model's decode steps attend through ``grouped_attention`` while inside, if it uses HF's sdpa path."""
    before = model.config._attn_implementation
    if before != "sdpa":
        yield
        return
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
