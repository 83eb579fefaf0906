"""MLA decode attention (DeepSeek-V2/V3) in the latent space: the key and value up-projections absorbed.

An MLA layer caches one compressed latent c [L, R] (R = kv_lora_rank, 512) and one shared rope key k_pe [L, P]
(P = 64) per sequence. HF's attention expands the whole cached latent into per-head keys and values at every decode
step (kv_b_proj over all L positions), then runs SDPA over them. With the up-projections absorbed, the key
projection moves onto the query (q_lat = q_nope @ W_UK, [H, R]) and the value projection onto the output (done by
the caller), so every head attends over the same latent:

    scores[h, n] = (q_lat[h] . c[n] + q_pe[h] . k_pe[n]) * scale,    out_lat[h] = softmax_n(scores[h]) @ c

One program owns one sequence's split of the filled positions and all its heads, so each latent and rope-key byte is
read once per step; splits are merged by decode_attention's log-sum-exp combine. Split counts come from shapes only
(no host sync: the op captures into a CUDA graph).
"""

import os

import torch
import triton
import triton.language as tl

from optiq.fusions.decode_attention import (LOG2E, _decode_attention_combine_kernel, online_softmax_step,
                                            split_bounds, split_layout, split_result, tile_config)
from optiq.fusions.launch import launch_options, wait_for_predecessor


@triton.jit
def _mla_split_kernel(
    q_lat_ptr, q_pe_ptr, c_ptr, pe_ptr, lengths_ptr, partial_out_ptr, partial_lse_ptr,
    scale_log2e,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_cb, stride_cn, stride_pb, stride_pn,
    num_heads, latent, rope, split_len, num_splits,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One (sequence, split): online softmax of every head over the split's filled positions.

    Writes each head's normalised latent output and log2-sum-exp2 (-inf for a split past the sequence's length)."""
    wait_for_predecessor(USE_PDL)
    batch = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start, end = split_bounds(lengths_ptr, lengths_ptr, batch, split, split_len, HAS_STARTS=False)

    heads = tl.arange(0, BLOCK_H)
    cols_r = tl.arange(0, BLOCK_R)
    cols_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = heads < num_heads
    r_mask = cols_r < latent
    p_mask = cols_p < rope

    q_lat = tl.load(q_lat_ptr + batch * stride_qlb + heads[:, None] * stride_qlh + cols_r[None, :],
                    mask=head_mask[:, None] & r_mask[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + batch * stride_qpb + heads[:, None] * stride_qph + cols_p[None, :],
                   mask=head_mask[:, None] & p_mask[None, :], other=0.0)
    if UPCAST_DOT:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    c_base = c_ptr + batch * stride_cb
    pe_base = pe_ptr + batch * stride_pb

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for block_start in range(start, end, BLOCK_N):
        positions = block_start + offs_n
        pos_mask = positions < end
        c = tl.load(c_base + positions[:, None] * stride_cn + cols_r[None, :],
                    mask=pos_mask[:, None] & r_mask[None, :], other=0.0)
        k_pe = tl.load(pe_base + positions[:, None] * stride_pn + cols_p[None, :],
                       mask=pos_mask[:, None] & p_mask[None, :], other=0.0)
        if UPCAST_DOT:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        scores = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION)
        scores = tl.where(pos_mask[None, :], (scores * scale_log2e).to(tl.float32), float("-inf"))
        running_max, running_sum, acc = online_softmax_step(scores, c, running_max, running_sum, acc, DOT_PRECISION)

    out, lse = split_result(running_max, running_sum, acc)
    partial_rows = (batch * num_heads + heads) * num_splits + split
    tl.store(partial_lse_ptr + partial_rows, lse, mask=head_mask)
    tl.store(partial_out_ptr + partial_rows[:, None] * latent + cols_r[None, :], out,
             mask=head_mask[:, None] & r_mask[None, :])


@torch.library.triton_op("optiq::mla_decode", mutates_args=())
def _mla_decode_op(q_lat: torch.Tensor, q_pe: torch.Tensor, c_cache: torch.Tensor, pe_cache: torch.Tensor,
                   lengths: torch.Tensor, scale: float) -> torch.Tensor:
    batch, num_heads, latent = q_lat.shape
    rope = q_pe.shape[-1]
    max_len = c_cache.shape[1]
    torch._check(all(t.stride(-1) == 1 for t in (q_lat, q_pe, c_cache, pe_cache)),
                 lambda: "the feature axis must be the innermost, unit-stride axis")
    # decode_attention's tiling with the latent as the one KV head: [32, 512] latent tiles, about one program per SM
    config = tile_config(batch, 1, max_len, latent, q_lat.device)
    block_n = config["BLOCK_N"]
    split_len, splits = split_layout(max_len, block_n, config["SPLITS"])
    block_r = triton.next_power_of_2(latent)
    partial_out = torch.empty((batch, num_heads, splits, latent), device=q_lat.device, dtype=torch.float32)
    partial_lse = torch.empty((batch, num_heads, splits), device=q_lat.device, dtype=torch.float32)
    out = torch.empty((batch, num_heads, latent), device=q_lat.device, dtype=q_lat.dtype)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    torch.library.wrap_triton(_mla_split_kernel)[(batch, splits)](
        q_lat, q_pe, c_cache, pe_cache, lengths, partial_out, partial_lse,
        scale * LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        c_cache.stride(0), c_cache.stride(1), pe_cache.stride(0), pe_cache.stride(1),
        num_heads, latent, rope, split_len, splits,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_N=block_n, BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(rope)),
        UPCAST_DOT=interpreted, DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        num_warps=8, num_stages=2, **launch_options(q_lat),
    )
    torch.library.wrap_triton(_decode_attention_combine_kernel)[(batch * num_heads,)](
        partial_out, partial_lse, partial_lse, out, latent, splits, num_heads,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_r, HAS_SINKS=False, num_warps=4,
        **launch_options(q_lat),
    )
    return out


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, c_cache: torch.Tensor, pe_cache: torch.Tensor,
               lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """q_lat [B, H, R] (queries with the key up-projection absorbed), q_pe [B, H, P] (rotated), c_cache [B, L, R]
    and pe_cache [B, L, P] (the first lengths[b] positions filled), lengths [B] int -> out_lat [B, H, R] in
    q_lat's dtype: each head's softmax-weighted sum of the latent."""
    batch, num_heads, latent = q_lat.shape
    if (q_pe.shape[:2] != (batch, num_heads) or c_cache.shape[0] != batch or c_cache.shape[2] != latent
            or tuple(pe_cache.shape) != (batch, c_cache.shape[1], q_pe.shape[2])):
        raise ValueError(f"shapes do not fit: q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)}, "
                         f"c_cache {tuple(c_cache.shape)}, pe_cache {tuple(pe_cache.shape)}")
    return torch.ops.optiq.mla_decode(q_lat, q_pe, c_cache, pe_cache, lengths, scale)


def mla_decode_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, c_cache: torch.Tensor, pe_cache: torch.Tensor,
                         lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention in plain torch, per sequence, in q_lat's dtype."""
    out = torch.zeros_like(q_lat)
    for b, length in enumerate(lengths.tolist()):
        c, k_pe = c_cache[b, :length], pe_cache[b, :length]
        scores = (q_lat[b] @ c.T + q_pe[b] @ k_pe.T) * scale
        out[b] = torch.softmax(scores, dim=-1) @ c if length else 0
    return out


def benchmark_case(rows: int, dtype: torch.dtype, device, *, heads: int = 16, latent: int = 512, rope: int = 64,
                   max_len: int = 1024) -> dict:
    """One DeepSeek-V2-Lite attention layer's decode at ``rows`` sequences, context max_len / 2; "eager" is HF's path
    for it: expand the cached latent to per-head keys and values, then SDPA."""
    gen = torch.Generator(device=device).manual_seed(rows)
    nope = value = 128

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * scale

    q_nope, q_pe = randn(rows, heads, nope), randn(rows, heads, rope)
    c_cache, pe_cache = randn(rows, max_len, latent), randn(rows, max_len, rope)
    w_kv_b = randn(heads * (nope + value), latent, scale=latent**-0.5)
    w_uk, w_uv = w_kv_b.view(heads, nope + value, latent).split([nope, value], dim=1)
    lengths = torch.full((rows,), max_len // 2, device=device, dtype=torch.int64)
    scale = (nope + rope) ** -0.5

    def fused():
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        out_lat = mla_decode(q_lat, q_pe, c_cache, pe_cache, lengths, scale)
        return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def eager():
        filled = max_len // 2
        kv = torch.nn.functional.linear(c_cache[:, :filled], w_kv_b).view(rows, filled, heads, nope + value)
        k_nope, v = kv.transpose(1, 2).split([nope, value], dim=-1)
        k = torch.cat((k_nope, pe_cache[:, None, :filled].expand(-1, heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)[:, :, None]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)[:, :, 0]

    return {"fused": fused, "eager": eager,
            "bytes": rows * (max_len // 2) * (latent + rope) * dtype.itemsize + w_kv_b.numel() * dtype.itemsize,
            "flops": 4 * rows * heads * (max_len // 2) * (latent + rope)}
