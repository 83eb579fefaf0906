"""Decoder layers whose residual adds and the norms around them run as fused kernels."""

from __future__ import annotations

import torch

from optiq.patching.replacements import branch_output, plus_residual
from optiq.patching.structure import pre_norm_decoder_layer, sandwich_norm_decoder_layer


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
        attn_out = branch_output(layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs))
        if multiplier != 1.0:
            attn_out = attn_out * multiplier
        normed, residual = fusion(attn_out, hidden_states, norm.weight, getattr(norm, site.eps_attribute), site.offset,
                                  **site.rounding())
        if multiplier != 1.0:
            return residual + branch_output(layer.mlp(normed)) * multiplier
        return plus_residual(layer.mlp, normed, residual)

    return forward


def sandwich_norm_forward(layer: torch.nn.Module, fusion):
    """A sandwich-norm decoder layer (Gemma 2 and 3, GLM-4) with each branch's output norm, its residual add and the
    next norm in one kernel: after the attention, norm + add + the MLP's input norm; after the MLP, norm + add (the
    next layer's input norm is its own). Six row kernels a layer become three with the input norm."""
    site = sandwich_norm_decoder_layer(layer)
    if site is None:
        raise ValueError(f"{type(layer).__name__} is not a decoder layer with sandwich RMSNorms")
    post_attention, pre_mlp, post_mlp = (getattr(layer, name) for name in (site.post_attention, site.pre_mlp,
                                                                          site.post_mlp))

    def forward(hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        attn_out = branch_output(layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs))
        eps = getattr(pre_mlp, site.norm.eps_attribute)
        normed, residual = fusion(attn_out, hidden_states, post_attention.weight, pre_mlp.weight, eps,
                                  site.norm.offset)
        return fusion(branch_output(layer.mlp(normed)), residual, post_mlp.weight, None, eps, site.norm.offset)[1]

    return forward
