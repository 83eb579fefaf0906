"""Rotary embedding of q and k in one launch, in place, in the layouts transformers' models use.

Eager HF runs `q * cos + rotate_half(q) * sin` (and the same for k) as about ten small kernels per layer, each
re-reading its input; at decode these are pure launch overhead. This fusion does it in one launch, with two options
folded into the same kernel:

- Qwen3's per-head RMSNorm (`q_norm`, `k_norm` over head_dim) applied before the rotation, or Gemma 3's, whose
  weight is an offset from one (`offset`: the fp32 statistics times 1 + w, rounded once, as Gemma's norm rounds), or
  Ergo's, which scale the fp32 statistics by w and round once (`weight_first`, rmsnorm's orders); or OLMo 2's, one
  norm over all the heads of q (and one over k's), whose weight is as wide as they are;
- writing the rotated k and the v straight into a static KV cache at per-sequence positions (what HF's
  `StaticCache.update` does with two `index_copy_` calls).

The layout is four switches, each a variant some model's `apply_rotary_pos_emb` computes: which channels pair up
(channel i with i + D/2, Llama's `rotate_half`, or 2i with 2i + 1, Cohere's and GLM's), which column of cos and sin
turns a channel (its own, or one per pair, the pair's index: GPT-OSS's half-width cos, Helium's repeat-interleaved
first half), the sense of the turn (NanoChat's rotate_half turns the other way), and whether the products are rounded
to the model dtype as eager bf16 ops round them or kept in fp32 and rounded once (Cohere, ERNIE cast q to float).

Every intermediate is rounded to the model dtype where HF's eager code rounds it, except that on the GPU the compiler
folds the first product's rounding into an FMA with the difference (measured on the H200: ~23% of elements differ from
HF by a rounding); the result is then at least as close to float64 as HF's. Under the interpreter it matches HF bit
for bit.
"""

import torch
import triton
import triton.language as tl

from optiq.fusions.launch import launch_options, wait_for_predecessor
from optiq.fusions.rmsnorm import rmsnorm_reference, scaled


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round an fp32 value to the model dtype and back: where HF's eager ops store a model-dtype tensor."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _pair_channels(offs, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The two channels of each pair offs: (i, i + D/2), or (2i, 2i + 1) when INTERLEAVED."""
    if INTERLEAVED:
        first = 2 * offs
        second = first + 1
    else:
        first = offs
        second = offs + HEAD_DIM // 2
    return first, second


@triton.jit
def _rounded_product(a, b, dtype: tl.constexpr, FP32: tl.constexpr):
    """a * b as the model's eager code leaves it: rounded to the model dtype, or in fp32 (FP32)."""
    product = a * b
    if not FP32:
        product = _round(product, dtype)
    return product


@triton.jit
def _rotate_heads(x_ptr, stride_h, stride_d, heads, num_heads, head_mask, w_ptr, cos1, cos2, sin1, sin2, eps,
                  channel1, channel2, mask, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr, ACROSS_HEADS: tl.constexpr,
                  OFFSET: tl.constexpr, WEIGHT_FIRST: tl.constexpr, CLOCKWISE: tl.constexpr, FP32: tl.constexpr):
    """Norm (optionally: each head, or the whole row of heads when ACROSS_HEADS, its weight as wide, the block then
    being all of them) and rotate a block of head vectors in place, pair p being channels channel1[p] and
    channel2[p]; return the rotated channels of each pair [heads, pairs] (fp32, model-dtype values)."""
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    tile_mask = head_mask[:, None] & mask[None, :]
    first = x_ptr + heads[:, None] * stride_h + channel1[None, :] * stride_d
    second = x_ptr + heads[:, None] * stride_h + channel2[None, :] * stride_d
    x1 = tl.load(first, mask=tile_mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=tile_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        if ACROSS_HEADS:
            squares = tl.sum(tl.sum(x1 * x1 + x2 * x2, axis=1), axis=0)
            rstd = tl.rsqrt(squares / (num_heads * HEAD_DIM) + eps)
            w_row = w_ptr + heads[:, None] * HEAD_DIM
            w1 = tl.load(w_row + channel1[None, :], mask=tile_mask, other=0.0).to(tl.float32)
            w2 = tl.load(w_row + channel2[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        else:
            rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
            w1 = tl.load(w_ptr + channel1, mask=mask, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + channel2, mask=mask, other=0.0).to(tl.float32)[None, :]
        x1 = scaled(x1 * rstd, w1, OFFSET, WEIGHT_FIRST, dtype).to(tl.float32)
        x2 = scaled(x2 * rstd, w2, OFFSET, WEIGHT_FIRST, dtype).to(tl.float32)
    sense = 1.0 - 2.0 * CLOCKWISE  # -1 turns the other way; a sign leaves the product's rounding as it is
    out1 = _rounded_product(x1, cos1, dtype, FP32) - sense * _rounded_product(x2, sin1, dtype, FP32)
    out2 = _rounded_product(x2, cos2, dtype, FP32) + sense * _rounded_product(x1, sin2, dtype, FP32)
    out1, out2 = _round(out1, dtype), _round(out2, dtype)
    tl.store(first, out1.to(dtype), mask=tile_mask)
    tl.store(second, out2.to(dtype), mask=tile_mask)
    return out1, out2


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr, positions_ptr,
    seq_len, num_q_heads, num_kv_heads, cache_len, eps, stride_pb,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_cb, stride_cs, stride_cd,
    stride_sb, stride_ss, stride_sd,
    stride_kcb, stride_kch, stride_kcl, stride_kcd,
    stride_vcb, stride_vch, stride_vcl, stride_vcd,
    HEAD_DIM: tl.constexpr, HALF_BLOCK: tl.constexpr, HEADS: tl.constexpr, QK_NORM: tl.constexpr,
    ACROSS_HEADS: tl.constexpr, OFFSET: tl.constexpr, WEIGHT_FIRST: tl.constexpr, WRITE_CACHE: tl.constexpr,
    INTERLEAVED: tl.constexpr, PAIR_ANGLES: tl.constexpr,
    CLOCKWISE: tl.constexpr, FP32: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per (token, block of HEADS heads): the first cdiv(num_q_heads, HEADS) blocks are q's, the rest
    k's (a block never mixes the two)."""
    wait_for_predecessor(USE_PDL)
    token = tl.program_id(0)
    block = tl.program_id(1)
    b = (token // seq_len).to(tl.int64)
    s = token % seq_len
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    q_blocks = tl.cdiv(num_q_heads, HEADS)

    cos_row = cos_ptr + b * stride_cb + s * stride_cs
    sin_row = sin_ptr + b * stride_sb + s * stride_ss
    channel1, channel2 = _pair_channels(offs, HEAD_DIM, INTERLEAVED)
    if PAIR_ANGLES:
        column1 = offs
        column2 = offs
    else:
        column1 = channel1
        column2 = channel2
    cos1 = tl.load(cos_row + column1 * stride_cd, mask=mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + column2 * stride_cd, mask=mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + column1 * stride_sd, mask=mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + column2 * stride_sd, mask=mask, other=0.0).to(tl.float32)[None, :]

    if block < q_blocks:
        heads = block * HEADS + tl.arange(0, HEADS)
        _rotate_heads(q_ptr + b * stride_qb + s * stride_qs, stride_qh, stride_qd, heads, num_q_heads,
                      heads < num_q_heads, q_norm_ptr, cos1, cos2, sin1, sin2, eps, channel1, channel2, mask,
                      HEAD_DIM, QK_NORM, ACROSS_HEADS, OFFSET, WEIGHT_FIRST, CLOCKWISE, FP32)
    else:
        heads = (block - q_blocks) * HEADS + tl.arange(0, HEADS)
        head_mask = heads < num_kv_heads
        k1, k2 = _rotate_heads(k_ptr + b * stride_kb + s * stride_ks, stride_kh, stride_kd, heads, num_kv_heads,
                               head_mask, k_norm_ptr, cos1, cos2, sin1, sin2, eps, channel1, channel2, mask,
                               HEAD_DIM, QK_NORM, ACROSS_HEADS, OFFSET, WEIGHT_FIRST, CLOCKWISE, FP32)
        if WRITE_CACHE:
            pos = tl.load(positions_ptr + b * stride_pb) + s
            # Memory safety only: a position past the cache is dropped (checking it would need a host sync).
            in_cache = tl.full((HEADS, HALF_BLOCK), pos, tl.int64) < cache_len
            cache_mask = head_mask[:, None] & mask[None, :] & in_cache
            kc = k_cache_ptr + b * stride_kcb + pos * stride_kcl + heads[:, None] * stride_kch
            tl.store(kc + channel1[None, :] * stride_kcd, k1.to(k_cache_ptr.dtype.element_ty), mask=cache_mask)
            tl.store(kc + channel2[None, :] * stride_kcd, k2.to(k_cache_ptr.dtype.element_ty), mask=cache_mask)
            v_head = v_ptr + b * stride_vb + s * stride_vs + heads[:, None] * stride_vh
            vc = v_cache_ptr + b * stride_vcb + pos * stride_vcl + heads[:, None] * stride_vch
            tile_mask = head_mask[:, None] & mask[None, :]
            v1 = tl.load(v_head + channel1[None, :] * stride_vd, mask=tile_mask)
            v2 = tl.load(v_head + channel2[None, :] * stride_vd, mask=tile_mask)
            tl.store(vc + channel1[None, :] * stride_vcd, v1.to(v_cache_ptr.dtype.element_ty), mask=cache_mask)
            tl.store(vc + channel2[None, :] * stride_vcd, v2.to(v_cache_ptr.dtype.element_ty), mask=cache_mask)


def heads_per_program(num_q_heads: int, num_kv_heads: int, half_block: int, across_heads: bool = False) -> int:
    """Heads a program rotates: up to 512 elements of each half (8 heads of 128 or 96), so that a batch of 64 tokens is
    a few hundred programs rather than one per head (4,096 one-warp programs for Phi-3's 64 heads took several times
    their bytes' worth: BENCHMARKS.md, session 21), but no more heads than q or k has. A norm across heads takes all
    of them in one program: the row's statistics need every head, which programs writing their heads in place
    would change under each other (OLMo-2-1B's q at 8 heads a program read its other half already rotated)."""
    every_head = triton.next_power_of_2(max(num_q_heads, num_kv_heads))
    return every_head if across_heads else min(every_head, max(1, 512 // half_block))


def _launch(q, k, cos, sin, q_norm_weight, k_norm_weight, eps, v, k_cache, v_cache, positions, offset,
            weight_first, interleaved, pair_angles, clockwise, fp32) -> None:
    batch, num_q_heads, seq_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qk_norm = q_norm_weight is not None
    across_heads = qk_norm and q_norm_weight.numel() != head_dim  # OLMo 2's: one norm over all of q's heads
    write_cache = k_cache is not None
    # Absent optional tensors are replaced by q: the kernel never touches them (the constexpr flags are off).
    q_norm_weight = q_norm_weight.contiguous() if qk_norm else q
    k_norm_weight = k_norm_weight.contiguous() if qk_norm else q
    v, k_cache, v_cache, positions = (v, k_cache, v_cache, positions) if write_cache else (q, q, q, q)
    cos = cos.expand(batch, seq_len, cos.shape[-1])  # HF may hand one row of cos/sin for the whole batch
    sin = sin.expand(batch, seq_len, sin.shape[-1])
    half_block = triton.next_power_of_2(head_dim // 2)
    heads = heads_per_program(num_q_heads, num_kv_heads, half_block, across_heads)
    grid = (batch * seq_len, triton.cdiv(num_q_heads, heads) + triton.cdiv(num_kv_heads, heads))
    torch.library.wrap_triton(_rope_kernel)[grid](
        q, k, v, cos, sin, q_norm_weight, k_norm_weight, k_cache, v_cache, positions,
        seq_len, num_q_heads, num_kv_heads, k_cache.shape[2], eps, positions.stride(0) if write_cache else 0,
        *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(), *k_cache.stride(), *v_cache.stride(),
        HEAD_DIM=head_dim, HALF_BLOCK=half_block, HEADS=heads, QK_NORM=qk_norm, ACROSS_HEADS=across_heads,
        OFFSET=offset, WEIGHT_FIRST=weight_first, WRITE_CACHE=write_cache,
        num_warps=max(1, min(8, heads * half_block // 128)), INTERLEAVED=interleaved, PAIR_ANGLES=pair_angles,
        CLOCKWISE=clockwise, FP32=fp32, **launch_options(q),
    )


# Two ops rather than one with optional caches: an op whose mutated arguments may be None fails torch 2.11's
# version-counter bump outside inference mode (trailing None arguments are dropped before it indexes them).
@torch.library.triton_op("optiq::rope", mutates_args={"q", "k"})
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
             eps: float = 1e-6, offset: bool = False, weight_first: bool = False, interleaved: bool = False,
             pair_angles: bool = False, clockwise: bool = False, fp32: bool = False) -> None:
    _launch(q, k, cos, sin, q_norm_weight, k_norm_weight, eps, None, None, None, None, offset, weight_first,
            interleaved, pair_angles, clockwise, fp32)


@torch.library.triton_op("optiq::rope_cached", mutates_args={"q", "k", "k_cache", "v_cache"})
def _rope_cached_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                    eps: float = 1e-6, offset: bool = False, weight_first: bool = False, interleaved: bool = False,
                    pair_angles: bool = False, clockwise: bool = False, fp32: bool = False) -> None:
    _launch(q, k, cos, sin, q_norm_weight, k_norm_weight, eps, v, k_cache, v_cache, positions, offset, weight_first,
            interleaved, pair_angles, clockwise, fp32)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    offset: bool = False,
    weight_first: bool = False,
    *,
    interleaved: bool = False,
    pair_angles: bool = False,
    clockwise: bool = False,
    fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, Hq, S, D] and k [B, Hkv, S, D] in place (any strides) and return them.

    cos, sin: [B or 1, S, D] as HF's rotary module makes them ([B or 1, S, D/2] or wider with ``pair_angles``, whose
    pair i turns by column i). By default Llama's layout: channel i pairs with i + D/2, x1 cos - x2 sin and
    x2 cos + x1 sin, each product rounded to the model dtype; ``interleaved`` pairs 2i with 2i + 1, ``clockwise``
    turns the other way, ``fp32`` keeps the products in fp32 and rounds once. With q_norm_weight and k_norm_weight
    ([D]), Qwen3's per-head RMSNorm with `eps` runs first (Gemma 3's, scaling by 1 + w, with `offset`; scaling by w
    before its rounding with `weight_first`, as rmsnorm's); weights as wide as all the heads ([Hq D] and [Hkv D])
    norm each token's q and k over all their heads at once, as OLMo 2 does. With k_cache,
    v_cache [B, Hkv, L, D], positions [B] (int64, the cache slot of each sequence's first token; any stride, so a
    static cache's one fill counter expanded to [B] serves) and v [B, Hkv, S, D], token s of sequence b also lands in
    the cache at slot positions[b] + s.
    """
    head_dim = q.shape[-1]
    if head_dim % 2 or cos.shape[-1] < (head_dim // 2 if pair_angles else head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} do not turn heads of {head_dim}"
                         f"{' by pairs' if pair_angles else ''}")
    layout = (interleaved, pair_angles, clockwise, fp32)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    if q_norm_weight is not None and (q_norm_weight.shape, k_norm_weight.shape) not in (
            ((head_dim,), (head_dim,)), ((q.shape[1] * head_dim,), (k.shape[1] * head_dim,))):
        raise ValueError(f"q and k norm weights {tuple(q_norm_weight.shape)}, {tuple(k_norm_weight.shape)} are "
                         f"neither a head wide ({head_dim}) nor as wide as all of q's and k's heads")
    if len({x is None for x in (v, k_cache, v_cache, positions)}) != 1:
        raise ValueError("give all of v, k_cache, v_cache and positions, or none")
    if k_cache is None:
        torch.ops.optiq.rope(q, k, cos, sin, q_norm_weight, k_norm_weight, eps, offset, weight_first, *layout)
    else:
        torch.ops.optiq.rope_cached(q, k, cos, sin, v, k_cache, v_cache, positions, q_norm_weight, k_norm_weight, eps,
                                    offset, weight_first, *layout)
    return q, k



@triton.jit
def _trailing_rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, heads, seq_len, head_dim, nope,
    stride_xb, stride_xh, stride_xs, stride_cb, stride_cs, stride_sb, stride_ss,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per (sequence, head, token) row: the first ``nope`` channels copied, the pairs (2i, 2i + 1) of
    the rest rotated by angle i in fp32, rounded once."""
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0)
    s = row % seq_len
    h = row // seq_len % heads
    b = (row // (seq_len * heads)).to(tl.int64)
    x_row = x_ptr + b * stride_xb + h * stride_xh + s * stride_xs
    out_row = out_ptr + row.to(tl.int64) * head_dim
    cols = tl.arange(0, BLOCK_D)
    kept = cols < nope
    tl.store(out_row + cols, tl.load(x_row + cols, mask=kept), mask=kept)
    pairs = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + b * stride_cb + s * stride_cs + pairs).to(tl.float32)
    sin = tl.load(sin_ptr + b * stride_sb + s * stride_ss + pairs).to(tl.float32)
    even = tl.load(x_row + nope + 2 * pairs).to(tl.float32)
    odd = tl.load(x_row + nope + 2 * pairs + 1).to(tl.float32)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_row + nope + 2 * pairs, (even * cos - odd * sin).to(dtype))
    tl.store(out_row + nope + 2 * pairs + 1, (odd * cos + even * sin).to(dtype))


@torch.library.triton_op("optiq::trailing_rope", mutates_args=())
def _trailing_rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    batch, heads, seq_len, head_dim = x.shape
    half = cos.shape[-1]
    torch._check(x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1,
                 lambda: "the channel axis must be the innermost, unit-stride axis")
    cos, sin = cos.expand(batch, seq_len, half), sin.expand(batch, seq_len, half)  # one row may serve the batch
    out = torch.empty((batch, heads, seq_len, head_dim), device=x.device, dtype=x.dtype)
    torch.library.wrap_triton(_trailing_rope_kernel)[(batch * heads * seq_len,)](
        x, cos, sin, out, heads, seq_len, head_dim, head_dim - 2 * half,
        x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        HALF=half, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1, **launch_options(x),
    )
    return out


def trailing_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's rotary embedding of one tensor, out of place: x [B, H, S, D] (any strides but a unit last one)
    keeps its first D - 2R channels and has its last 2R rotated as interleaved pairs, pair i by the angle whose cos
    and sin are cos[b, s, i] and sin[b, s, i] ([B or 1, S, R]: one entry per pair, as V4's rotary module makes
    them), the products in fp32 and the result rounded once to x's dtype. R must be a power of two."""
    half = cos.shape[-1]
    if x.ndim != 4 or cos.shape != sin.shape or cos.ndim != 3 or 2 * half > x.shape[-1] or half & (half - 1):
        raise ValueError(f"shapes do not fit: x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    return torch.ops.optiq.trailing_rope(x, cos, sin)


def trailing_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same rotation in plain torch: pair i of the rotated channels as a complex number times e^(i angle)."""
    rotated = 2 * cos.shape[-1]
    pairs = x[..., -rotated:].double().unflatten(-1, (-1, 2))
    turn = torch.complex(cos.double(), sin.double()).unsqueeze(1)
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turn).flatten(-2)
    return torch.cat([x[..., :-rotated], turned.to(x.dtype)], dim=-1)

def _pairs(x: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second channels of every pair along the last dim."""
    return (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)


def _turn(x, cos, sin, interleaved=False, pair_angles=False, clockwise=False, fp32=False):
    """One tensor [B, H, S, D] turned as an eager model's apply_rotary_pos_emb does it in the given layout
    (``rope``'s keywords), cos and sin already unsqueezed to [B, 1, S, ...]."""
    x1, x2 = _pairs(x.float() if fp32 and x.dtype != torch.float64 else x, interleaved)
    if pair_angles:
        (cos1, cos2), (sin1, sin2) = (cos[..., :x1.shape[-1]],) * 2, (sin[..., :x1.shape[-1]],) * 2
    else:
        (cos1, cos2), (sin1, sin2) = _pairs(cos[..., :x.shape[-1]], interleaved), _pairs(sin[..., :x.shape[-1]],
                                                                                           interleaved)
    sense = -1 if clockwise else 1
    out1, out2 = x1 * cos1 - sense * (x2 * sin1), x2 * cos2 + sense * (x1 * sin2)
    out = torch.stack((out1, out2), dim=-1).flatten(-2) if interleaved else torch.cat((out1, out2), dim=-1)
    return out.to(x.dtype)


def _qk_norm_reference(x, weight, eps, offset, weight_first):
    """x [B, H, S, D] normed per head, or over all of its heads at once where the weight is as wide as they are."""
    if weight.numel() == x.shape[-1]:
        return rmsnorm_reference(x, weight, eps, offset, weight_first)
    row = x.transpose(1, 2).flatten(2)  # [B, S, H D], as the projection wrote it
    return rmsnorm_reference(row, weight, eps, offset, weight_first).unflatten(2, x.shape[1::2]).transpose(1, 2)


def _rope_eager(q, k, cos, sin, q_norm_weight, k_norm_weight, eps, offset=False, weight_first=False, **layout):
    """HF's attention forward from the projections to the rotated q, k (apply_rotary_pos_emb, unsqueeze_dim=1)."""
    if q_norm_weight is not None:
        q, k = (_qk_norm_reference(x, w, eps, offset, weight_first) for x, w in ((q, q_norm_weight),
                                                                                 (k, k_norm_weight)))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _turn(q, cos, sin, **layout), _turn(k, cos, sin, **layout)


def rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    offset: bool = False,
    weight_first: bool = False,
    **layout: bool,
) -> tuple[torch.Tensor, ...]:
    """Out of place: (q, k) or, with a cache, (q, k, k_cache, v_cache) as new tensors; ``layout`` as rope's."""
    q_out, k_out = _rope_eager(q, k, cos, sin, q_norm_weight, k_norm_weight, eps, offset, weight_first, **layout)
    if k_cache is None:
        return q_out, k_out
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for b in range(q.shape[0]):
        slots = positions[b] + torch.arange(q.shape[2], device=positions.device)
        kept = slots < k_cache.shape[2]  # as the kernel: tokens past the end of the cache are dropped
        k_cache[b].index_copy_(1, slots[kept], k_out[b][:, kept])
        v_cache[b].index_copy_(1, slots[kept], v[b][:, kept])
    return q_out, k_out, k_cache, v_cache


def benchmark_case(rows: int, dtype: torch.dtype, device, *, qk_norm: bool = False, static_cache: bool = True,
                   cache_len: int = 1024) -> dict:
    """Decode step (S = 1) of one llama-3.1-8b attention layer: rows sequences, 32 q / 8 kv heads of 128.

    By default includes the static-cache write, as the CUDA-graph decode path runs it; qk_norm=True adds Qwen3's norm.
    """
    heads_q, heads_kv, head_dim, eps = 32, 8, 128, 1e-6
    gen = torch.Generator(device=device).manual_seed(rows)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    def per_head(projection, heads):  # as HF lays q, k, v out: the [B, S, H*D] projection viewed per head, transposed
        return projection.view(rows, 1, heads, head_dim).transpose(1, 2)

    projections = [randn(rows, 1, heads * head_dim) for heads in (heads_q, heads_kv, heads_kv)]
    q, k, v = (per_head(p, heads) for p, heads in zip(projections, (heads_q, heads_kv, heads_kv)))
    # The fused op works in place, so it gets its own q, k and caches: its first call sees the eager one's inputs.
    q_fused, k_fused = (per_head(p.clone(), heads) for p, heads in zip(projections, (heads_q, heads_kv)))
    angles = torch.rand(rows, 1, head_dim // 2, generator=gen, device=device) * 100
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    norms = (1 + 0.1 * randn(head_dim), 1 + 0.1 * randn(head_dim)) if qk_norm else (None, None)
    caches = [randn(rows, heads_kv, cache_len, head_dim) for _ in range(2)]
    fused_cache = {}
    if static_cache:
        fused_cache = dict(v=v, k_cache=caches[0].clone(), v_cache=caches[1].clone(),
                           positions=torch.full((rows,), cache_len // 2, dtype=torch.int64, device=device))
    cache_position = torch.tensor([cache_len // 2], device=device)

    def eager():
        q_embed, k_embed = _rope_eager(q, k, cos, sin, *norms, eps)
        if static_cache:  # HF's StaticCache.update
            caches[0].index_copy_(2, cache_position, k_embed)
            caches[1].index_copy_(2, cache_position, v)
        return q_embed, k_embed

    def fused():
        return rope(q_fused, k_fused, cos, sin, *norms, eps, **fused_cache)

    qk_elems = rows * (heads_q + heads_kv) * head_dim
    kv_elems = rows * heads_kv * head_dim
    elems = 2 * qk_elems + 2 * rows * head_dim  # q, k read and written; cos, sin read
    elems += 2 * head_dim if qk_norm else 0
    elems += 3 * kv_elems if static_cache else 0  # v read; one k and one v cache row written
    moved = elems * dtype.itemsize + (rows * 8 if static_cache else 0)
    flops = 3 * qk_elems + (5 * qk_elems if qk_norm else 0)  # rope: 2 mul + 1 add; norm: square, sum, scale, weight
    return {"fused": fused, "eager": eager, "bytes": moved, "flops": flops}
