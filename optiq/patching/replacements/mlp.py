"""Gated MLPs (``structure.gated_mlp``: down(act(gate(x)) * up(x)), gate and up apart or fused) through one GEMM
for gate and up plus a fused SwiGLU; both forwards take ``residual=`` (optiq.patching.replacements.plus_residual)
and hand it to the down projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optiq.patching.replacements import plus_residual
from optiq.patching.structure import GatedMlpSite, gated_mlp


def _site(mlp: torch.nn.Module) -> GatedMlpSite:
    site = gated_mlp(mlp)
    if site is None:
        raise ValueError(f"{type(mlp).__name__} does not compute down(act(gate(x)) * up(x)) with a known act")
    return site


def swiglu_forward(mlp: torch.nn.Module, fusion):
    """One GEMM over ``[gate; up]`` (concatenated here, once), the fused ``act(gate) * up``, then down_proj."""
    site = _site(mlp)
    weight = torch.cat(site.gate_up_weights(mlp)).detach()
    biases = site.gate_up_biases(mlp)
    bias = None if biases is None else torch.cat(biases).detach()
    down = getattr(mlp, site.down)

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return plus_residual(down, fusion(F.linear(x, weight, bias), activation=site.activation), residual)

    forward.takes_residual = True
    return forward


def gate_up_swiglu_forward(mlp: torch.nn.Module, fusion):
    """The fused gate/up GEMM with SwiGLU in its epilogue, then down_proj.

    The fusion's weight layout is row-interleaved: row 2j is gate row j, row 2j + 1 is up row j (built here, once)."""
    site = _site(mlp)
    if site.gate_up_biases(mlp) is not None:
        raise ValueError(f"{type(mlp).__name__} has biases; the gate/up GEMM fusion has none")
    gate, up = site.gate_up_weights(mlp)
    weight = torch.stack((gate, up), dim=1).reshape(2 * gate.shape[0], gate.shape[1]).detach().contiguous()
    down = getattr(mlp, site.down)

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return plus_residual(down, fusion(x, weight, activation=site.activation), residual)

    forward.takes_residual = True
    return forward
