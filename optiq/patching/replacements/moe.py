"""MoE experts modules (transformers 5's 3-D parameters: gate_up [E, 2I, H], down [E, H, I]) through a grouped-GEMM
fusion."""

from __future__ import annotations

import torch


def swiglu_experts_problem(experts: torch.nn.Module) -> str | None:
    """Why ``experts`` is not a bias-free SwiGLU pair of 3-D parameters (gate_up_proj, down_proj); None if it is."""
    activation = type(getattr(experts, "act_fn", None)).__name__
    if activation not in ("SiLU", "SiLUActivation"):
        return f"{type(experts).__name__} uses {activation}, not SwiGLU"
    if getattr(experts, "has_bias", False) or {n for n, _ in experts.named_parameters()} != {"gate_up_proj",
                                                                                           "down_proj"}:
        return f"{type(experts).__name__} is not a bias-free gate_up_proj/down_proj pair"
    if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        return f"{type(experts).__name__} stores its weights transposed or with gate and up interleaved"
    return None


def experts_forward(experts: torch.nn.Module, fusion):
    """The experts module's call (tokens, top-k expert ids, top-k routing weights) -> the weighted sum of each token's
    experts; the parameters are read at call time, as they lie (no copy)."""
    if (problem := swiglu_experts_problem(experts)) is not None:
        raise ValueError(problem)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return fusion(hidden_states, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj)

    return forward
