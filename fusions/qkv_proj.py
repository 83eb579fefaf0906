"""Q, K and V projections as one GEMM over weights concatenated once at patch time.

Eager HF launches three GEMMs per layer on the same input; at decode each is a weight-streaming GEMV that pays its
own launch, its own ramp-up and tail. One GEMM over [Dq + Dk + Dv, H] streams the same bytes with one launch and
a wider N that fills the GPU better (llama-3.1-8b: the K and V GEMMs are only N = 1024 each). At decode's few rows
the GEMM is optiq.fusions.linear's streaming kernel (faster than cuBLAS at one row; BENCHMARKS.md), past them
cuBLAS's.
q, k and v come back as views split along the last dim of the one output, as three nn.Linear outputs would be used.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from optiq.fusions.linear import arrival_counters, launch_linear


def concat_qkv_weights(w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    """[Dq, H], [Dk, H], [Dv, H] (nn.Linear layout) -> [Dq + Dk + Dv, H]; the biases concatenate the same way."""
    return torch.cat((w_q, w_k, w_v), dim=0).contiguous()


@torch.library.triton_op("optiq::qkv_proj", mutates_args={"arrivals"})
def _qkv_proj_op(x: torch.Tensor, w_qkv: torch.Tensor, arrivals: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    return launch_linear(x, w_qkv, bias, arrivals)


def qkv_proj(x: torch.Tensor, w_qkv: torch.Tensor, split_sizes: Sequence[int],
             bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """x [..., H] -> (q [..., Dq], k [..., Dk], v [..., Dv]), views of one [..., Dq + Dk + Dv] output.

    split_sizes (Dq, Dk, Dv) says where to cut: the concatenated weight alone cannot tell.
    """
    if sum(split_sizes) != w_qkv.shape[0]:
        raise ValueError(f"split sizes {tuple(split_sizes)} do not add up to the {w_qkv.shape[0]} rows of w_qkv")
    return torch.ops.optiq.qkv_proj(x, w_qkv, arrival_counters(x.device), bias).split(list(split_sizes), dim=-1)


def qkv_proj_reference(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                       b_q: torch.Tensor | None = None, b_k: torch.Tensor | None = None,
                       b_v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's q_proj, k_proj, v_proj: three nn.Linear calls."""
    return F.linear(x, w_q, b_q), F.linear(x, w_k, b_k), F.linear(x, w_v, b_v)


def benchmark_case(rows: int, dtype: torch.dtype, device, *, hidden: int = 4096, heads_q: int = 32,
                   heads_kv: int = 8, head_dim: int = 128) -> dict:
    """llama-3.1-8b attention projections (no bias) at `rows` decode tokens."""
    gen = torch.Generator(device=device).manual_seed(rows)
    sizes = (heads_q * head_dim, heads_kv * head_dim, heads_kv * head_dim)
    x = torch.randn(rows, hidden, generator=gen, device=device, dtype=dtype)
    w_q, w_k, w_v = (torch.randn(n, hidden, generator=gen, device=device, dtype=dtype) / hidden**0.5 for n in sizes)
    w_qkv = concat_qkv_weights(w_q, w_k, w_v)
    out_features = sum(sizes)
    return {
        "fused": lambda: qkv_proj(x, w_qkv, sizes),
        "eager": lambda: qkv_proj_reference(x, w_q, w_k, w_v),
        "bytes": (rows * hidden + out_features * hidden + rows * out_features) * dtype.itemsize,
        "flops": 2 * rows * hidden * out_features,
    }
