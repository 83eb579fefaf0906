"""MLA attention (DeepSeek-V2/V3 and the models written after them) decoding in the latent space through a fused
kernel."""

from __future__ import annotations

import sys

import torch

from optiq.patching.structure import mla_attention


def mla_attention_forward(attn: torch.nn.Module, fusion):
    """An MLA attention (``structure.mla_attention``) with the key and value up-projections absorbed for decode steps.

    kv_b_proj's weight [H * (nope + v), R] is viewed per head as W_UK [H, nope, R] and W_UV [H, v, R] (views, no
    copy): the query's non-rope part goes through W_UK into the latent space, the fusion attends over the cached
    latent and rope key (all heads read them once), and W_UV maps the result back per head. A decode step reads its
    filled length from the static cache's counter on the device. Prefill, a non-static cache, or more than one new
    token per sequence run HF's own forward. The rope parts turn through the modeling module's own function, so the
    cached rope keys are laid out as its prefill lays them. Like the engine, it assumes no padding inside the cache."""
    site = mla_attention(attn)
    if site is None:
        raise ValueError(f"{type(attn).__name__} is not an MLA attention the absorbed path computes")
    heads, nope, value = site.heads, attn.qk_nope_head_dim, attn.v_head_dim
    w_uk, w_uv = attn.kv_b_proj.weight.view(heads, nope + value, attn.kv_lora_rank).split([nope, value], dim=1)
    rotate = getattr(sys.modules[type(attn).__module__], site.rotation) if site.rotation else None
    original = type(attn).forward.__get__(attn)

    def forward(hidden_states: torch.Tensor, attention_mask=None, position_embeddings=None, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layer = cache.layers[attn.layer_idx] if cache is not None else None
        if hidden_states.shape[1] != 1 or not hasattr(layer, "max_cache_len"):
            return original(hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings,
                            **kwargs)
        batch = hidden_states.shape[0]
        if getattr(attn, "q_a_proj", None) is None:
            q = attn.q_proj(hidden_states)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
        q_nope, q_pe = q.view(batch, 1, heads, nope + attn.qk_rope_head_dim).transpose(1, 2).split(
            [nope, attn.qk_rope_head_dim], dim=-1)
        kv_nope, k_pe = attn.kv_a_proj_with_mqa(hidden_states).split([attn.kv_lora_rank, attn.qk_rope_head_dim], -1)
        latent = attn.kv_a_layernorm(kv_nope).view(batch, 1, 1, attn.kv_lora_rank)
        k_pe = k_pe.view(batch, 1, 1, attn.qk_rope_head_dim)
        if site.rotation == "apply_rotary_emb":  # V2: complex frequencies
            q_pe, k_pe = rotate(q_pe, k_pe, position_embeddings.to(q_pe.device))
        elif rotate is not None:
            q_pe, k_pe = rotate(q_pe, k_pe, *position_embeddings)
        latents, rope_keys = cache.update(latent, k_pe, attn.layer_idx)
        q_lat = torch.bmm(q_nope[:, :, 0].transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, R]
        lengths = layer.cumulative_length.reshape(1).repeat(batch)
        out_lat = fusion(q_lat, q_pe[:, :, 0], latents[:, 0], rope_keys[:, 0], lengths, attn.scaling)
        out = torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v]
        return attn.o_proj(out.reshape(batch, 1, heads * value)), None

    return forward
