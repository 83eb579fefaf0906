"""A pre-norm decoder layer whose residual add and post-attention norm run as one fused kernel."""

from __future__ import annotations

import torch

from optiq.patching.replacements import plus_residual


def add_rmsnorm_forward(layer: torch.nn.Module, fusion):
    """HF's llama-family decoder layer with ``residual + attn`` and ``post_attention_layernorm`` fused, and the residual
    add after the MLP handed to the MLP when its forward takes it (gate_up_swiglu, with decode_linear's down_proj).

    Keyword arguments pass through to the attention untouched, so ``cache=`` (5.24) and ``past_key_values=`` (5.17)
    both reach it."""
    norm = layer.post_attention_layernorm
    if not hasattr(norm, "variance_epsilon"):
        raise ValueError(f"{type(norm).__name__} is not an RMSNorm with variance_epsilon")

    def forward(hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        attn_out, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
        normed, residual = fusion(attn_out, hidden_states, norm.weight, norm.variance_epsilon)
        return plus_residual(layer.mlp, normed, residual)

    return forward
