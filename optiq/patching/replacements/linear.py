"""nn.Linear modules through a decode GEMM kernel."""

from __future__ import annotations

import inspect

import torch


def linear_forward(module: torch.nn.Module, fusion):
    """nn.Linear's forward (weight and bias read at call time, so a reloaded weight is seen), and with ``residual=``
    the add after it, when the fusion takes one (optiq.patching.replacements.plus_residual)."""

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is None:
            return fusion(x, module.weight, module.bias)
        return fusion(x, module.weight, module.bias, residual=residual)

    forward.takes_residual = "residual" in inspect.signature(fusion).parameters
    return forward
