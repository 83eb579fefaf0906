"""Pre-norm decoder layers with their second half fused: the residual add and the post-attention norm as one
kernel, or the whole MLP block (norm, gate/up, SwiGLU, down, residual add) as two."""

from __future__ import annotations

import torch

from optiq.patches.mlp import interleaved_gate_up


def _post_attention_rmsnorm(layer: torch.nn.Module) -> torch.nn.Module:
    norm = layer.post_attention_layernorm
    if not hasattr(norm, "variance_epsilon"):
        raise ValueError(f"{type(norm).__name__} is not an RMSNorm with variance_epsilon")
    return norm


def _attention_half(layer: torch.nn.Module, hidden_states: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The layer's own input norm and attention (their patches apply). Keyword arguments pass through untouched, so
    ``cache=`` (transformers 5.24) and ``past_key_values=`` (5.17) both reach the attention."""
    attn_out, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
    return attn_out


def add_rmsnorm_forward(layer: torch.nn.Module, fusion):
    """HF's llama-family decoder layer with ``residual + attn`` and ``post_attention_layernorm`` fused."""
    norm = _post_attention_rmsnorm(layer)

    def forward(hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        attn_out = _attention_half(layer, hidden_states, kwargs)
        normed, residual = fusion(attn_out, hidden_states, norm.weight, norm.variance_epsilon)
        return residual + layer.mlp(normed)

    return forward


def residual_mlp_forward(layer: torch.nn.Module, fusion):
    """HF's llama-family decoder layer whose MLP block, from the residual add after attention on, is ``fusion``:
    ``fusion(h, eps, gate/up weight, down weight)`` = h + MLP(RMSNorm(h)), the gate and up weights interleaved with
    the post-attention norm's weight folded in, once, here (so that norm's module is not called either)."""
    norm, mlp = _post_attention_rmsnorm(layer), layer.mlp
    w_gate_up = interleaved_gate_up(mlp, norm.weight)

    def forward(hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        h = hidden_states + _attention_half(layer, hidden_states, kwargs)
        return fusion(h, norm.variance_epsilon, w_gate_up, mlp.down_proj.weight)

    return forward
