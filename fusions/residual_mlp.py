"""A pre-norm gated MLP block, h + down(silu(gate(norm(h))) * up(norm(h))), in two GEMM launches.

Eager HF runs the post-attention RMSNorm (a kernel, or with add_rmsnorm the residual add too), the gate/up GEMMs,
the activation, the down GEMM and the residual add. Here the norm's weight is folded into the gate/up weight once and
1/rms(h) comes out of the gate/up GEMM's own K loop, SwiGLU runs in its epilogue, and the residual add is the down
GEMM's (cuBLAS's addmm adds h before it rounds; at one row its split-K reduction does it): no norm kernel, no add.
"""

import torch
import torch.nn.functional as F

from fusions.gate_up_swiglu import fold_norm_weight, gate_up_swiglu, interleave_gate_up
from fusions.rmsnorm import rmsnorm_reference


def residual_mlp(h: torch.Tensor, rms_eps: float, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """h [..., H] + down(SwiGLU(RMSNorm(h))) in h's dtype. w_gate_up [2I, H]: gate and up interleaved
    (interleave_gate_up) with the norm's weight folded in (fold_norm_weight); w_down [H, I]."""
    hidden, intermediate = h.shape[-1], w_gate_up.shape[0] // 2
    if w_down.shape != (hidden, intermediate):
        raise ValueError(f"w_down {tuple(w_down.shape)} is not [{hidden}, {intermediate}]")
    act = gate_up_swiglu(h, w_gate_up, rms_eps)
    return torch.addmm(h.reshape(-1, hidden), act.reshape(-1, intermediate), w_down.t()).view(h.shape)


def residual_mlp_reference(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, w_gate: torch.Tensor,
                           w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """HF's decoder layer from its post-attention norm on, in h's dtype."""
    x = rmsnorm_reference(h, norm_weight, eps)
    return h + F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def benchmark_case(rows: int, dtype: torch.dtype, device, *, hidden: int = 4096, intermediate: int = 14336) -> dict:
    """llama-3.1-8b's MLP block at ``rows`` decode tokens (other presets through hidden and intermediate)."""
    gen = torch.Generator(device=device).manual_seed(rows + 1)
    h = torch.randn(rows, hidden, generator=gen, device=device, dtype=dtype)
    norm_weight = 1 + 0.1 * torch.randn(hidden, generator=gen, device=device, dtype=dtype)
    w_gate, w_up = (torch.randn(intermediate, hidden, generator=gen, device=device, dtype=dtype) / hidden**0.5
                    for _ in range(2))
    w_gate_up = fold_norm_weight(interleave_gate_up(w_gate, w_up), norm_weight)
    w_down = torch.randn(hidden, intermediate, generator=gen, device=device, dtype=dtype) / intermediate**0.5
    return {
        "fused": lambda: residual_mlp(h, 1e-6, w_gate_up, w_down),
        "eager": lambda: residual_mlp_reference(h, norm_weight, 1e-6, w_gate, w_up, w_down),
        # the three weights once; h in twice (norm, residual), the activation out and in, the block's output
        "bytes": (3 * intermediate * hidden + 3 * rows * hidden + 2 * rows * intermediate) * dtype.itemsize,
        "flops": 6 * rows * hidden * intermediate,
    }
