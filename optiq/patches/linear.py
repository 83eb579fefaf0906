"""nn.Linear modules through a decode GEMM kernel."""

from __future__ import annotations

import torch


def linear_forward(module: torch.nn.Module, fusion):
    """nn.Linear's forward (weight and bias read at call time, so a reloaded weight is seen)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return fusion(x, module.weight, module.bias)

    return forward
