"""A pre-norm decoder layer whose residual add and post-attention norm run as one fused kernel."""

from __future__ import annotations

import torch

from optiq.patching.replacements import plus_residual
from optiq.patching.structure import pre_norm_decoder_layer


def add_rmsnorm_forward(layer: torch.nn.Module, fusion):
    """HF's llama-family decoder layer with ``residual + attn`` and ``post_attention_layernorm`` fused, and the residual
    add after the MLP handed to the MLP when its forward takes it (gate_up_swiglu, with decode_linear's down_proj);
    Granite's ``residual_multiplier`` scales each branch first, as its layer does.

    Keyword arguments pass through to the attention untouched, so ``cache=`` (5.24) and ``past_key_values=`` (5.17)
    both reach it."""
    site = pre_norm_decoder_layer(layer)
    if site is None:
        raise ValueError(f"{type(layer).__name__} is not a pre-norm decoder layer with RMSNorms")
    norm = layer.post_attention_layernorm
    multiplier = getattr(layer, "residual_multiplier", 1.0)  # Granite scales both branches before their adds

    def forward(hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        attn_out, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
        if multiplier != 1.0:
            attn_out = attn_out * multiplier
        normed, residual = fusion(attn_out, hidden_states, norm.weight, getattr(norm, site.eps_attribute), site.offset)
        if multiplier != 1.0:
            return residual + layer.mlp(normed) * multiplier
        return plus_residual(layer.mlp, normed, residual)

    return forward
