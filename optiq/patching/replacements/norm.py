"""RMSNorm modules through a fused norm kernel."""

from __future__ import annotations

import torch


def rmsnorm_forward(module: torch.nn.Module, fusion):
    """HF's RMSNorm (weight and ``variance_epsilon`` read at call time, so a reloaded weight is seen)."""

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return fusion(hidden_states, module.weight, module.variance_epsilon)

    return forward
