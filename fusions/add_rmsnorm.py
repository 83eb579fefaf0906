"""Residual add then RMSNorm in one pass: reads x and residual once, writes the new residual and the normed rows.

Replaces HF's `hidden_states = residual + hidden_states` (rounded to the model dtype) followed by the next
RMSNorm of that sum. norm_add_rmsnorm also normalises x first, as sandwich-norm layers (Gemma 2 and 3, GLM-4) do
with a branch's output before its residual add: three kernels and two round trips of the row become one. The row
kernel is rmsnorm's, so all of them share one set of rounding rules.
"""

import torch
from torch.library import triton_op

from optiq.fusions.rmsnorm import launch_rmsnorm, rmsnorm_reference


@triton_op("optiq::add_rmsnorm", mutates_args=("normed", "new_residual"))
def _add_rmsnorm_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: bool,
    normed: torch.Tensor,
    new_residual: torch.Tensor,
    weight_first: bool = False,
) -> None:
    launch_rmsnorm(x, residual, weight, eps, offset, normed, new_residual, weight_first=weight_first)


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: bool = False,
    normed: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
    weight_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rmsnorm(x + residual), x + residual), both in x's dtype (the norm rounded as rmsnorm's
    ``weight_first`` says); outputs are new tensors unless given."""
    if normed is None:
        normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if new_residual is None:
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.optiq.add_rmsnorm(x, residual, weight, eps, offset, normed, new_residual, weight_first)
    return normed, new_residual


@triton_op("optiq::norm_add_rmsnorm", mutates_args=("normed", "new_residual"))
def _norm_add_rmsnorm_op(x: torch.Tensor, residual: torch.Tensor, branch_norm_weight: torch.Tensor,
                         weight: torch.Tensor, eps: float, offset: bool, normed: torch.Tensor,
                         new_residual: torch.Tensor, weight_first: bool = False) -> None:
    launch_rmsnorm(x, residual, weight, eps, offset, normed, new_residual, branch_weight=branch_norm_weight,
                   weight_first=weight_first)


@triton_op("optiq::norm_add", mutates_args=("new_residual",))
def _norm_add_op(x: torch.Tensor, residual: torch.Tensor, branch_norm_weight: torch.Tensor, eps: float,
                 offset: bool, new_residual: torch.Tensor, weight_first: bool = False) -> None:
    launch_rmsnorm(x, residual, None, eps, offset, None, new_residual, branch_weight=branch_norm_weight,
                   weight_first=weight_first)


def norm_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    branch_norm_weight: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: bool = False,
    weight_first: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """With s = residual + rmsnorm(x, branch_norm_weight): (rmsnorm(s, weight), s), both in x's dtype; the first is
    None when weight is None (the layer's last add, whose sum the next layer normalises, or a post-norm layer's
    add). Both norms take eps, offset and weight_first (rmsnorm's rounding orders)."""
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if weight is None:
        torch.ops.optiq.norm_add(x, residual, branch_norm_weight, eps, offset, new_residual, weight_first)
        return None, new_residual
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.optiq.norm_add_rmsnorm(x, residual, branch_norm_weight, weight, eps, offset, normed, new_residual,
                                     weight_first)
    return normed, new_residual


def norm_add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor, branch_norm_weight: torch.Tensor, weight: torch.Tensor | None,
    eps: float, offset: bool = False, weight_first: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The eager sequence: HF's norm of x, the add in the model dtype, HF's norm of the sum."""
    new_residual = residual + rmsnorm_reference(x, branch_norm_weight, eps, offset, weight_first)
    normed = None if weight is None else rmsnorm_reference(new_residual, weight, eps, offset, weight_first)
    return normed, new_residual


def add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
    weight_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager sequence: add in the model dtype, then HF's RMSNorm of the sum."""
    new_residual = residual + x
    return rmsnorm_reference(new_residual, weight, eps, offset, weight_first), new_residual


def benchmark_case(rows: int, dtype: torch.dtype, device) -> dict:
    """llama-3.1-8b: hidden 4096, weight in the model dtype as HF loads it."""
    hidden, eps = 4096, 1e-5
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    residual = torch.randn(rows, hidden, dtype=dtype, device=device)
    weight = 1.0 + 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    element = x.element_size()
    return {
        "fused": lambda: add_rmsnorm(x, residual, weight, eps),
        "eager": lambda: add_rmsnorm_reference(x, residual, weight, eps),
        "bytes": 4 * rows * hidden * element + hidden * weight.element_size(),  # read x, residual; write both
        "flops": 5 * rows * hidden,  # add, square, sum, scale by 1/rms, scale by weight
    }
