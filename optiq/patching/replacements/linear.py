"""nn.Linear modules, and block-diagonal (grouped) projections, through a decode GEMM kernel."""

from __future__ import annotations

import inspect

import torch

from optiq.patching.structure import grouped_linear


def linear_forward(module: torch.nn.Module, fusion):
    """nn.Linear's forward (weight and bias read at call time, so a reloaded weight is seen), and with ``residual=``
    the add after it, when the fusion takes one (optiq.patching.replacements.plus_residual)."""

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is None:
            return fusion(x, module.weight, module.bias)
        return fusion(x, module.weight, module.bias, residual=residual)

    forward.takes_residual = "residual" in inspect.signature(fusion).parameters
    return forward


def grouped_linear_forward(module: torch.nn.Module, fusion):
    """A grouped projection (``structure.grouped_linear``) with its group count, its weight read at call time."""
    site = grouped_linear(module)
    if site is None:
        raise ValueError(f"{type(module).__name__} does not compute a block-diagonal projection")

    def forward(x: torch.Tensor) -> torch.Tensor:
        return fusion(x, module.weight, site.groups)

    return forward
