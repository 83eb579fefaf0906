"""Gated MLPs (down(silu(gate(x)) * up(x))) through one GEMM for gate and up plus a fused SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(mlp: torch.nn.Module) -> None:
    activation = getattr(getattr(mlp, "config", None), "hidden_act", "silu")
    if activation not in ("silu", "swish"):
        raise ValueError(f"{type(mlp).__name__} uses {activation}, not SwiGLU")


def swiglu_forward(mlp: torch.nn.Module, fusion):
    """One GEMM over ``[gate; up]`` (concatenated here, once), the fused ``silu(gate) * up``, then down_proj."""
    _check(mlp)
    weight = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)).detach()
    bias = None if mlp.gate_proj.bias is None else torch.cat((mlp.gate_proj.bias, mlp.up_proj.bias)).detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(fusion(F.linear(x, weight, bias)))

    return forward


def gate_up_swiglu_forward(mlp: torch.nn.Module, fusion):
    """The fused gate/up GEMM with SwiGLU in its epilogue, then down_proj.

    The fusion's weight layout is row-interleaved (interleaved_gate_up)."""
    weight = interleaved_gate_up(mlp)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(fusion(x, weight))

    return forward


def interleaved_gate_up(mlp: torch.nn.Module, norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The gate and up weights of a bias-free SwiGLU MLP as one [2I, H] matrix, row 2j gate row j and row 2j + 1 up
    row j (built once, at patch time), for fused gate/up GEMMs; with the weight [H] of the RMSNorm in front folded
    into its columns (rounded once), so that the GEMM need only divide by the rms."""
    _check(mlp)
    if mlp.gate_proj.bias is not None or mlp.down_proj.bias is not None:
        raise ValueError(f"{type(mlp).__name__} has biases; the fused gate/up GEMM has none")
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    weight = torch.stack((gate, up), dim=1).reshape(2 * gate.shape[0], gate.shape[1]).detach()
    if norm_weight is not None:
        weight = (weight.float() * norm_weight.detach().float()).to(gate.dtype)
    return weight.contiguous()
