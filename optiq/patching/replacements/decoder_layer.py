"""Decoder layers whose residual adds and the norms around them run as fused kernels."""

from __future__ import annotations

import torch

from optiq.patching.replacements import branch_output, plus_residual
from optiq.patching.structure import pre_norm_decoder_layer, sandwich_norm_decoder_layer


def add_rmsnorm_forward(layer: torch.nn.Module, fusion):
    """HF's llama-family decoder layer with ``residual + attn`` and ``post_attention_layernorm`` fused, and the residual
    add after the MLP handed to the MLP when its forward takes it (gate_up_swiglu, with decode_linear's down_proj);
    a branch the layer scales before its add (Granite's residual multiplier, MiniCPM's depth scale) is scaled first,
    by the scale the site was found with.

    Keyword arguments pass through to the attention untouched, so ``cache=`` (5.24) and ``past_key_values=`` (5.17)
    both reach it."""
    site = pre_norm_decoder_layer(layer)
    if site is None:
        raise ValueError(f"{type(layer).__name__} is not a pre-norm decoder layer with RMSNorms")
    norm, kind = layer.post_attention_layernorm, site.norm

    def forward(hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        attn_out = branch_output(layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs))
        if site.attention_scale != 1.0:
            attn_out = attn_out * site.attention_scale
        normed, residual = fusion(attn_out, hidden_states, norm.weight, getattr(norm, kind.eps_attribute), kind.offset,
                                  **kind.rounding())
        if site.mlp_scale != 1.0:
            return residual + branch_output(layer.mlp(normed)) * site.mlp_scale
        return plus_residual(layer.mlp, normed, residual)

    return forward


def sandwich_norm_forward(layer: torch.nn.Module, fusion):
    """A decoder layer that normalises its branches' outputs (Gemma 2 and 3, GLM-4, OLMo 2) with each branch's
    output norm, its residual add and the next norm in one kernel: after the attention, norm + add + the MLP's input
    norm (norm + add where the MLP has no input norm); after the MLP, norm + add (the next layer's input norm, if it
    has one, is its own). Six row kernels a sandwich layer become three with the input norm, a post-norm layer's
    four become two."""
    site = sandwich_norm_decoder_layer(layer)
    if site is None:
        raise ValueError(f"{type(layer).__name__} is not a decoder layer with RMSNorms on its branches' outputs")
    input_norm, post_attention, pre_mlp, post_mlp = (getattr(layer, name) if name else None for name in (
        site.input, site.post_attention, site.pre_mlp, site.post_mlp))
    rounding = site.norm.rounding()

    def forward(hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        attn_in = input_norm(hidden_states) if input_norm is not None else hidden_states
        attn_out = branch_output(layer.self_attn(hidden_states=attn_in, **kwargs))
        eps = getattr(post_attention, site.norm.eps_attribute)
        normed, residual = fusion(attn_out, hidden_states, post_attention.weight,
                                  pre_mlp.weight if pre_mlp is not None else None, eps, site.norm.offset, **rounding)
        mlp_out = branch_output(layer.mlp(residual if normed is None else normed))
        return fusion(mlp_out, residual, post_mlp.weight, None, eps, site.norm.offset, **rounding)[1]

    return forward
