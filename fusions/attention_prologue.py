"""The attention prologue of a decode step in two launches: the Q, K and V projections as one GEMM (qkv_proj), then
Qwen3's per-head q/k norms, the rotary embedding and the K/V cache write in one kernel (rope's cached form).

What it replaces, per layer, in HF's eager code: three GEMMs, two per-head RMSNorms of about eight launches each, the
rotation's ten or so, and the static cache's update (arange, two adds, two index_copy_). At one token these are
launch overhead, not bytes: qwen3-0.6b's C=1 step spends a third of its GPU time in launches of 1-3 us.
"""

import torch

from optiq.fusions.qkv_proj import qkv_proj, qkv_proj_reference
from optiq.fusions.rope import rope, rope_reference


def attention_prologue(x: torch.Tensor, w_qkv: torch.Tensor, split_sizes: tuple[int, int, int],
                       bias: torch.Tensor | None, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                       q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                       eps: float = 1e-6, offset: bool = False, weight_first: bool = False,
                       **layout: bool) -> torch.Tensor:
    """x [B, S, H] -> q [B, Hq, S, D], normed (with the norm weights, 1 + w with ``offset``, rounded as rope's
    ``weight_first`` says) and rotated (in the layout rope's keywords in ``layout`` name); the rotated k and the v of
    token s of sequence b land in k_cache, v_cache [B, Hkv, L, D] at slot positions[b] + s (positions [B], any
    stride)."""
    q, k, v = (t.view(*x.shape[:-1], -1, head_dim).transpose(1, 2) for t in qkv_proj(x, w_qkv, split_sizes, bias))
    rope(q, k, cos, sin, q_norm_weight, k_norm_weight, eps, v=v, k_cache=k_cache, v_cache=v_cache,
         positions=positions, offset=offset, weight_first=weight_first, **layout)
    return q


def attention_prologue_reference(x, w_qkv, split_sizes, bias, head_dim, cos, sin, k_cache, v_cache, positions,
                                 q_norm_weight=None, k_norm_weight=None, eps=1e-6, offset=False, weight_first=False,
                                 **layout):
    """HF's path out of place: (q, k_cache, v_cache) as new tensors."""
    weights = w_qkv.split(list(split_sizes))
    biases = bias.split(list(split_sizes)) if bias is not None else (None, None, None)
    q, k, v = (t.view(*x.shape[:-1], -1, head_dim).transpose(1, 2)
               for t in qkv_proj_reference(x, *weights, *biases))
    q, _, k_cache, v_cache = rope_reference(q, k, cos, sin, q_norm_weight, k_norm_weight, eps, v=v, k_cache=k_cache,
                                            v_cache=v_cache, positions=positions, offset=offset,
                                            weight_first=weight_first, **layout)
    return q, k_cache, v_cache


def benchmark_case(rows: int, dtype: torch.dtype, device, *, hidden: int = 1024, heads_q: int = 16, heads_kv: int = 8,
                   head_dim: int = 128, cache_len: int = 1024) -> dict:
    """qwen3-0.6b's attention prologue at ``rows`` decode tokens, writing slot cache_len // 2 of a static cache.
    "eager" is HF's: three projections, q/k norms, RoPE, then StaticLayer.update's arange, add and two index_copy_
    (the fill counter's own add_ is left out of both sides)."""
    gen = torch.Generator(device=device).manual_seed(rows)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device=device)).to(dtype)

    sizes = (heads_q * head_dim, heads_kv * head_dim, heads_kv * head_dim)
    x = randn(rows, 1, hidden)
    w_qkv = randn(sum(sizes), hidden, scale=hidden**-0.5)
    w_q, w_k, w_v = w_qkv.split(sizes)
    angles = torch.rand(rows, 1, head_dim // 2, generator=gen, device=device) * 50
    cos, sin = (f(torch.cat((angles, angles), dim=-1)).to(dtype) for f in (torch.cos, torch.sin))
    norms = (1 + randn(head_dim, scale=0.1), 1 + randn(head_dim, scale=0.1), 1e-6)
    caches = [randn(rows, heads_kv, cache_len, head_dim) for _ in range(2)]
    counter = torch.tensor(cache_len // 2, device=device)

    def eager():
        q, k, v = (t.view(rows, 1, -1, head_dim).transpose(1, 2) for t in qkv_proj_reference(x, w_q, w_k, w_v))
        q, k = rope_reference(q, k, cos, sin, *norms)
        slots = torch.arange(1, device=device) + counter
        caches[0].index_copy_(2, slots, k)
        caches[1].index_copy_(2, slots, v)
        return q

    def fused():
        return attention_prologue(x, w_qkv, sizes, None, head_dim, cos, sin, *caches, counter.expand(rows), *norms)

    weights = sum(sizes) * hidden
    return {"fused": fused, "eager": eager, "flops": 2 * rows * weights,
            "bytes": (weights + rows * (hidden + 2 * sum(sizes) + 2 * heads_kv * head_dim)) * dtype.itemsize}
