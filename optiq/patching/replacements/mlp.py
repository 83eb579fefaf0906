"""Gated MLPs (down(silu(gate(x)) * up(x))) through one GEMM for gate and up plus a fused SwiGLU; both forwards take
``residual=`` (optiq.patching.replacements.plus_residual) and hand it to down_proj."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optiq.patching.replacements import plus_residual


def _check(mlp: torch.nn.Module) -> None:
    activation = getattr(getattr(mlp, "config", None), "hidden_act", "silu")
    if activation not in ("silu", "swish"):
        raise ValueError(f"{type(mlp).__name__} uses {activation}, not SwiGLU")


def swiglu_forward(mlp: torch.nn.Module, fusion):
    """One GEMM over ``[gate; up]`` (concatenated here, once), the fused ``silu(gate) * up``, then down_proj."""
    _check(mlp)
    weight = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)).detach()
    bias = None if mlp.gate_proj.bias is None else torch.cat((mlp.gate_proj.bias, mlp.up_proj.bias)).detach()

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return plus_residual(mlp.down_proj, fusion(F.linear(x, weight, bias)), residual)

    forward.takes_residual = True
    return forward


def gate_up_swiglu_forward(mlp: torch.nn.Module, fusion):
    """The fused gate/up GEMM with SwiGLU in its epilogue, then down_proj.

    The fusion's weight layout is row-interleaved: row 2j is gate row j, row 2j + 1 is up row j (built here, once)."""
    _check(mlp)
    if mlp.gate_proj.bias is not None:
        raise ValueError(f"{type(mlp).__name__} has biases; the gate/up GEMM fusion has none")
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    weight = torch.stack((gate, up), dim=1).reshape(2 * gate.shape[0], gate.shape[1]).detach().contiguous()

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return plus_residual(mlp.down_proj, fusion(x, weight), residual)

    forward.takes_residual = True
    return forward
