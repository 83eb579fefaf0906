"""RMSNorm over the last dim in one pass: one program per row, the whole row held in registers.

Semantics follow Hugging Face exactly, including where it rounds:
- Llama/Qwen (offset=False): normalise in fp32, round to the input dtype, then multiply by the weight
  (LlamaRMSNorm: ``weight * x_normed.to(input_dtype)``).
- Gemma (offset=True): normalise in fp32, multiply by (1 + weight) in fp32, round once
  (Gemma3RMSNorm: ``(x_normed * (1.0 + weight.float())).type_as(x)``).
- OLMo 2 (weight_first=True): normalise in fp32, multiply by the weight in fp32, round once
  (Olmo2RMSNorm: ``(weight * x_normed).to(input_dtype)``); a rounding fewer than Llama's, which in bf16 is an error
  the validation gate sees.
The output is in x's dtype. The kernel also serves add_rmsnorm (HAS_RESIDUAL) and norm_add_rmsnorm (BRANCH_NORM), so
they cannot drift apart.
"""

import torch
import triton
import triton.language as tl

from optiq.fusions.launch import launch_options, wait_for_predecessor
from torch.library import triton_op, wrap_triton

LARGEST_HIDDEN = 65536  # a row must fit in one program's registers


@triton.jit
def scaled(normed, weight, OFFSET: tl.constexpr, WEIGHT_FIRST: tl.constexpr, dtype: tl.constexpr):
    """The fp32 normalised values scaled by their fp32 weight in ``dtype``, rounded where the norm's kind rounds
    (module docstring): every norm kernel's one rule, rope's q/k norms too."""
    if OFFSET:
        return (normed * (1.0 + weight)).to(dtype)
    if WEIGHT_FIRST:
        return (normed * weight).to(dtype)
    return (normed.to(dtype).to(tl.float32) * weight).to(dtype)


@triton.jit
def _normalised(x, weight_ptr, cols, mask, hidden, eps, OFFSET: tl.constexpr, WEIGHT_FIRST: tl.constexpr,
                dtype: tl.constexpr):
    """One row RMS-normalised in fp32 and scaled by its weight, rounded to ``dtype`` where HF rounds."""
    x = x.to(tl.float32)
    normed = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return scaled(normed, weight, OFFSET, WEIGHT_FIRST, dtype)


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    x_row_stride,
    residual_ptr,
    residual_row_stride,
    branch_weight_ptr,
    weight_ptr,
    out_ptr,
    out_row_stride,
    new_residual_ptr,
    new_residual_row_stride,
    hidden,
    eps,
    BRANCH_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    NORM_SUM: tl.constexpr,
    OFFSET: tl.constexpr,
    WEIGHT_FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """x, normalised first by its branch's own norm when BRANCH_NORM (Gemma's post-attention norm), plus the residual
    when HAS_RESIDUAL (stored as the new residual), normalised when NORM_SUM (into out)."""
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if BRANCH_NORM:
        x = _normalised(x, branch_weight_ptr, cols, mask, hidden, eps, OFFSET, WEIGHT_FIRST, x_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # Round the sum to the model dtype, as the eager `residual + hidden_states` does, and normalise that.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * new_residual_row_stride + cols, x, mask=mask)
    if NORM_SUM:
        y = _normalised(x, weight_ptr, cols, mask, hidden, eps, OFFSET, WEIGHT_FIRST, out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * out_row_stride + cols, y, mask=mask)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View t as [rows, last dim] with unit column stride (copies only if t's layout does not allow a view)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def launch_rmsnorm(x, residual, weight, eps, offset, out, new_residual, branch_weight=None, weight_first=False):
    """Launch the row kernel; residual/new_residual are None for plain RMSNorm, branch_weight is the norm x takes
    before the residual add (None: none), weight None (and out None) leaves the sum unnormalised; weight_first
    scales by the weight before the rounding (module docstring). Called from inside a triton_op."""
    hidden = x.shape[-1]
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")
    for name, w in (("weight", weight), ("branch norm weight", branch_weight)):
        if w is not None and w.shape != (hidden,):
            raise ValueError(f"{name} shape {tuple(w.shape)} does not match hidden size {hidden}")
    if hidden > LARGEST_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds {LARGEST_HIDDEN}, the largest row one program holds")
    x_rows = as_rows(x)
    # views, never copies: the kernel must write into `out` and `new_residual` themselves
    out_rows = out.view(-1, hidden) if out is not None else None
    residual_rows = as_rows(residual) if residual is not None else None
    new_residual_rows = new_residual.view(-1, hidden) if new_residual is not None else None
    block = triton.next_power_of_2(hidden)
    # 16 to 32 bytes per thread: wide vector loads, no register pressure at hidden 4096.
    num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    # No fused multiply-adds: HF rounds after every op, and a branch norm's w * x_normed (two bf16 values) and the
    # residual add became one bf16 FMA on the H200, a rounding short of the eager sum in a quarter of the elements.
    wrap_triton(_rmsnorm_kernel)[(x_rows.shape[0],)](
        x_rows,
        x_rows.stride(0),
        residual_rows,
        residual_rows.stride(0) if residual is not None else 0,
        branch_weight,
        weight,
        out_rows,
        out_rows.stride(0) if out is not None else 0,
        new_residual_rows,
        new_residual_rows.stride(0) if new_residual is not None else 0,
        hidden,
        eps,
        BRANCH_NORM=branch_weight is not None,
        HAS_RESIDUAL=residual is not None,
        NORM_SUM=weight is not None,
        OFFSET=offset,
        WEIGHT_FIRST=weight_first,
        BLOCK=block,
        num_warps=num_warps, enable_fp_fusion=False, **launch_options(x),
    )


@triton_op("optiq::rmsnorm", mutates_args=("out",))
def _rmsnorm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool, out: torch.Tensor,
                weight_first: bool = False) -> None:
    launch_rmsnorm(x, None, weight, eps, offset, out, None, weight_first=weight_first)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False, out: torch.Tensor | None = None,
    weight_first: bool = False,
) -> torch.Tensor:
    """RMSNorm of x [..., H] by weight [H] (by 1 + weight when offset, Gemma style; the weight applied before the
    rounding when weight_first, OLMo 2 style); returns out (new if None)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.ops.optiq.rmsnorm(x, weight, eps, offset, out, weight_first)
    return out


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
                      weight_first: bool = False) -> torch.Tensor:
    """HF's op sequence: accumulate in fp32 (or float64 when x is float64), round where HF rounds."""
    acc = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (1.0 + weight.to(acc.dtype))).to(x.dtype)
    if weight_first:
        return (weight.to(acc.dtype) * normed).to(x.dtype)
    return weight * normed.to(x.dtype)


def benchmark_case(rows: int, dtype: torch.dtype, device) -> dict:
    """llama-3.1-8b: hidden 4096, weight in the model dtype as HF loads it."""
    hidden, eps = 4096, 1e-5
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    weight = 1.0 + 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    element = x.element_size()
    return {
        "fused": lambda: rmsnorm(x, weight, eps),
        "eager": lambda: rmsnorm_reference(x, weight, eps),
        "bytes": 2 * rows * hidden * element + hidden * weight.element_size(),
        "flops": 4 * rows * hidden,  # square, sum, scale by 1/rms, scale by weight
    }
