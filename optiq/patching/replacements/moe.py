"""MoE experts modules (transformers 5's 3-D parameters: gate_up [E, 2I, H], down [E, H, I]) through a grouped-GEMM
fusion."""

from __future__ import annotations

import math

import torch

from optiq.patching.structure import swiglu_experts


def experts_forward(experts: torch.nn.Module, fusion):
    """The experts module's call (tokens, top-k expert ids, top-k routing weights) -> the weighted sum of each token's
    experts; the parameters are read at call time, as they lie (no copy). The kernel gets the clamp ``limit`` only
    where the experts clamp (DeepSeek-V4), so a kernel of the plain signature serves every other model; there the
    gate also replays the calls with inputs scaled past the limit (``input_scales``): activations of about one
    never reach it, and a kernel without the clamp would pass on them."""
    site = swiglu_experts(experts)
    if site is None:
        raise ValueError(f"{type(experts).__name__} is not SwiGLU experts stored as gate_up_proj / down_proj")
    clamp = {} if site.limit is None else {"limit": site.limit}

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return fusion(hidden_states, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj, **clamp)

    if site.limit is not None:
        forward.input_scales = (2.0 ** math.ceil(math.log2(4 * site.limit)),)

    return forward
