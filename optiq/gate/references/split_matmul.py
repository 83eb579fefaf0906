"""fp32 products of fp32 activations with bf16 weights, on tensor cores.

An fp32 significand has 24 bits and a bf16 one 8, so an fp32 ``x`` is exactly the sum of three bf16 parts
(``bf16_parts``). With a bf16 weight ``W``, each part's products with ``W`` are exact in fp32 and the tensor cores
accumulate them in fp32, so three bf16 GEMMs give ``x @ W.T`` at bf16 tensor-core speed. Not quite to fp32 accuracy
(the tensor cores' accumulation truncates: a few millionths, relative, from the exact product, against about a
thousandth for a bf16 product), which is what the validation gate's fp32 reference needs: it tells bf16 errors apart,
in a fraction of the time fp32 GEMMs on the SIMT cores take in a large prefill (BENCHMARKS.md has the figures).
"""

import torch
import torch.nn.functional as F

# Where the split pays (measured on the gate's fp32 reference decode; BENCHMARKS.md): always in the prefill (tensor
# cores against SIMT cores); in decode steps only for large weights, where casting the weight to fp32 on every call
# costs more than the split's extra launches (llama-3.1-8b's, not qwen3-0.6b's, whose weights are 1-3M elements but
# for the lm_head).
SPLIT_ROWS = 256
SPLIT_WEIGHT = 1 << 24  # elements


def bf16_parts(x: torch.Tensor) -> torch.Tensor:
    """[3, *x.shape] bf16 whose sum is the fp32 ``x`` exactly: each part is the rounding of what the ones before it
    left, and every remainder is exact in fp32 (it is a multiple of x's last bit, below the rounded part's half-ulp).
    Values under bf16's normal range (|x| < 1e-33) may lose their last bits, far below anything a logit can show."""
    hi = x.to(torch.bfloat16)
    rest = x - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo])


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` in fp32 for an fp32 ``x`` and a bf16 ``weight`` on a CUDA device (torch.mm's and torch.bmm's
    ``out_dtype``): ``x`` [M, K] and ``weight`` [N, K]; or a stack of weights [E, N, K], with ``x`` [M, K] shared by
    all or [E, M, K] one per weight, giving [E, M, N]. The three parts go through one GEMM stacked as rows, so each
    weight is read once."""
    parts = bf16_parts(x)  # [3, *x.shape]
    if weight.dim() == 2:
        products = torch.mm(parts.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        products = products.view(3, *x.shape[:-1], weight.shape[0])
    else:
        stacked = parts.movedim(0, 1) if x.dim() == 3 else parts  # [E, 3, M, K] or [3, M, K]
        stacked = stacked.reshape(*stacked.shape[:-3], -1, x.shape[-1]).expand(weight.shape[0], -1, -1)
        products = torch.bmm(stacked, weight.transpose(1, 2), out_dtype=torch.float32)
        products = products.view(weight.shape[0], 3, -1, weight.shape[1]).movedim(1, 0)  # [3, E, M, N]
    return products[2] + products[1] + products[0]  # the smallest first


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of an fp32 ``x`` and a bf16 ``weight`` in fp32, on a CUDA device (``matmul``)."""
    out = matmul(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out += bias.float()
    return out.view(*x.shape[:-1], weight.shape[0])


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of an fp32 ``x`` and a bf16 CUDA ``weight`` in fp32 by the faster path for the shape: the split
    product for many rows or a large weight (SPLIT_ROWS, SPLIT_WEIGHT), else the weight cast to fp32."""
    if x.numel() // x.shape[-1] >= SPLIT_ROWS or weight.numel() >= SPLIT_WEIGHT:
        return linear(x, weight, bias)
    return F.linear(x, weight.float(), None if bias is None else bias.float())
