"""GQA decode attention over a static KV cache (split-KV / flash-decoding).

One new query token per sequence attends to the first `lengths[b]` positions of a preallocated cache laid
out as HF transformers' StaticCache keeps it. Each program reads one block of ONE kv head once and scores
all of that head's query heads together, so no repeat_kv copy exists and each KV byte is read once per step.
The KV axis is cut into splits (count chosen from shapes only, so the op never syncs with the host and can be
captured in a CUDA graph); each split writes a partial output and its log-sum-exp, and a second kernel merges
the splits with those weights. Where the batch alone fills the GPU (one split) the split kernel writes the output
itself, and there is no second kernel.

Layouts:
  q        [B, Hq, 1, D]      (HF's query_states after transpose(1, 2); any strides with a unit last stride)
  k_cache  [B, Hkv, L_max, D] (unit last stride); v_cache likewise
  lengths  [B] int32/int64    valid positions per sequence (the new token's K/V already at lengths-1);
                              a length of 0 (an idle batch slot) gives zeros
  starts   [B] or None        first attended position per sequence (a sliding window's start); 0 when None
  sinks    [Hq] or None       per-head attention-sink logits (GPT-OSS): a column every row's softmax counts in
                              its denominator, with no value
  visible  [B, L_max] or None which positions each sequence sees, as a boolean mask (True = attend) on top of the
                              span: keys gathered from several places (DeepSeek-V4's sliding window and selected
                              compressed entries), padding
  returns  [B, 1, Hq, D]      in q's dtype: what HF's attention interface returns (attn_output before
                              the reshape to [B, 1, Hq*D])

The variants the transformers zoo asks of decode attention are parameters of the one kernel: a sliding window
(positions from `starts` on only: Mistral, Gemma 2/3, GPT-OSS), logit softcapping (scores become
softcap * tanh(scores / softcap), Gemma 2), attention sinks, and a visibility mask. A query group too wide for one
tile (DeepSeek-V4's 64 heads of 512 over one shared KV head) is cut into blocks of heads, each reading the KV once;
keys that are their own values (k_cache is v_cache) are loaded once.
"""

import os

import torch
import triton
import triton.language as tl

from optiq.fusions.launch import (launch_options, multiprocessor_count, prefetch_options, prefetch_rows,
                                 wait_for_predecessor)

LOG2E = 1.4426950408889634


@triton.jit
def split_bounds(lengths_ptr, starts_ptr, batch, split, split_len, HAS_STARTS: tl.constexpr):
    """[start, end) of the attended positions a split owns: the filled ones from the sequence's start on (0
    without starts); empty (end <= start) for a split wholly outside them."""
    start = split * split_len
    if HAS_STARTS:
        start = tl.maximum(start, tl.load(starts_ptr + batch).to(tl.int32))
    return start, tl.minimum(split * split_len + split_len, tl.load(lengths_ptr + batch).to(tl.int32))


@triton.jit
def accurate_tanh(x):
    """tanh to fp32's precision at every magnitude: an odd Taylor polynomial below 1/4 (where (1 - e^-2x) /
    (1 + e^-2x) loses digits to cancellation: softcap 50 bends scores of a few units, x ~ 0.02), that quotient
    above. The Triton interpreter has no libdevice tanh, so the kernel computes its own."""
    magnitude = tl.abs(x)
    x2 = x * x
    polynomial = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    t = tl.exp2(-2.8853900817779268 * magnitude)  # e^(-2|x|); a module-level float is no constant to the JIT
    quotient = tl.where(x < 0, -1.0, 1.0) * (1.0 - t) / (1.0 + t)
    return tl.where(magnitude < 0.25, polynomial, quotient)


@triton.jit
def online_softmax_step(scores, values, running_max, running_sum, acc, DOT_PRECISION: tl.constexpr):
    """Fold one block of log2-scaled scores [rows, N] and its values [N, D] into the running max, sum and output.

    A row that has seen no valid position yet (a block wholly masked by a visibility mask) keeps a max of -inf;
    its exponentials are pivoted at 0 instead, so no -inf - -inf arises and its sum stays 0."""
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    pivot = tl.where(new_max > float("-inf"), new_max, 0.0)
    correction = tl.exp2(running_max - pivot)
    p = tl.exp2(scores - pivot[:, None])
    running_sum = running_sum * correction + tl.sum(p, axis=1)
    acc = acc * correction[:, None] + tl.dot(p.to(values.dtype), values, input_precision=DOT_PRECISION)
    return new_max, running_sum, acc


@triton.jit
def split_result(running_max, running_sum, acc):
    """(normalised output, log2-sum-exp2) of a split; -inf for a split that held no position."""
    has_positions = running_sum > 0.0
    safe_sum = tl.where(has_positions, running_sum, 1.0)
    return acc / safe_sum[:, None], tl.where(has_positions, running_max + tl.log2(safe_sum), float("-inf"))


@triton.jit
def _decode_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, lengths_ptr, starts_ptr, visible_ptr, sinks_ptr, partial_out_ptr, partial_lse_ptr,
    scale_log2e, softcap_log2e,
    q_stride_b, q_stride_h,
    k_stride_b, k_stride_h, k_stride_n,
    v_stride_b, v_stride_h, v_stride_n, visible_stride_b,
    num_kv_heads, group_size, head_blocks, head_dim, split_len, num_splits,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_STARTS: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_VISIBLE: tl.constexpr, SHARED_KV: tl.constexpr, HAS_SINKS: tl.constexpr, ONE_SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr,
):
    """One (sequence, kv head, block of its query heads, split): online softmax over the split's valid positions.

    Writes the split's normalised output and its log2-sum-exp2 (-inf when the split holds no position the
    sequence sees: the combine then gives it zero weight). With ONE_SPLIT the split is the whole softmax: the
    output itself is written (into ``partial_out_ptr``, in the output's dtype, the sinks' share taken out here), and
    no combine runs.

    Before waiting for its predecessor (which writes the step's new position, and perhaps the lengths), a program
    asks L2 for its first tile of cached keys and values, as far as the lengths it reads then say: a prefetch only,
    so a stale length costs a wasted line, never a wrong value.
    """
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    batch = (pid_bh // (num_kv_heads * head_blocks)).to(tl.int64)
    kv_head = pid_bh // head_blocks % num_kv_heads
    head_block = pid_bh % head_blocks
    k_base = k_ptr + batch * k_stride_b + kv_head * k_stride_h
    v_base = v_ptr + batch * v_stride_b + kv_head * v_stride_h
    offs_n = tl.arange(0, BLOCK_N)
    if PREFETCH_LINES > 0:
        early_start, early_end = split_bounds(lengths_ptr, starts_ptr, batch, split, split_len, HAS_STARTS)
        prefetch_rows(k_base, early_start + offs_n, early_end, head_dim, k_stride_n, 1, PREFETCH_LINES, LINE)
        if not SHARED_KV:
            prefetch_rows(v_base, early_start + offs_n, early_end, head_dim, v_stride_n, 1, PREFETCH_LINES, LINE)
    wait_for_predecessor(USE_PDL)

    start, end = split_bounds(lengths_ptr, starts_ptr, batch, split, split_len, HAS_STARTS)

    rows = head_block * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < group_size
    col_mask = cols < head_dim
    q_heads = kv_head * group_size + rows

    q = tl.load(
        q_ptr + batch * q_stride_b + q_heads[:, None] * q_stride_h + cols[None, :],
        mask=row_mask[:, None] & col_mask[None, :], other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)

    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for block_start in range(start, end, BLOCK_N):
        positions = block_start + offs_n
        pos_mask = positions < end
        if HAS_VISIBLE:
            pos_mask &= tl.load(visible_ptr + batch * visible_stride_b + positions, mask=pos_mask, other=0) != 0
        kv_mask = pos_mask[:, None] & col_mask[None, :]
        k = tl.load(k_base + positions[:, None] * k_stride_n + cols[None, :], mask=kv_mask, other=0.0)
        if SHARED_KV:
            v = k
        else:
            v = tl.load(v_base + positions[:, None] * v_stride_n + cols[None, :], mask=kv_mask, other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # the cast keeps scores fp32 when torch.compile hands the scale over as a float64 constant
        scores = (tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e).to(tl.float32)
        if SOFTCAP:  # cap * tanh(s / cap) holds in log2 units too
            scores = softcap_log2e * accurate_tanh(scores / softcap_log2e)
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        running_max, running_sum, acc = online_softmax_step(scores, v, running_max, running_sum, acc, DOT_PRECISION)

    out, lse = split_result(running_max, running_sum, acc)
    partial_rows = (batch * num_kv_heads * group_size + q_heads) * num_splits + split
    if ONE_SPLIT:
        if HAS_SINKS:  # a sink's exp2 joins the denominator: out * sum / (sum + sink) (0 for a sequence seeing nothing)
            sink = tl.load(sinks_ptr + q_heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            out = out / (1.0 + tl.exp2(sink - lse))[:, None]
        out = out.to(partial_out_ptr.dtype.element_ty)
    else:
        tl.store(partial_lse_ptr + partial_rows, lse, mask=row_mask)
    tl.store(
        partial_out_ptr + partial_rows[:, None] * head_dim + cols[None, :], out,
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _decode_attention_combine_kernel(
    partial_out_ptr, partial_lse_ptr, sinks_ptr, out_ptr, head_dim, num_splits, num_q_heads,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One (sequence, query head): weight each split's output by exp2(lse - max lse); empty splits weigh zero.

    A sink adds its exp2 to the denominator only (it has no value), pivoted with the splits' max."""
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    col_mask = cols < head_dim

    lse = tl.load(partial_lse_ptr + row * num_splits + splits, mask=split_mask, other=float("-inf"))
    max_lse = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + row % num_q_heads).to(tl.float32) * 1.4426950408889634
        max_lse = tl.maximum(max_lse, sink)
    # a finite pivot even when every split is empty (length 0): exp2(-inf - pivot) is then a clean 0
    pivot = tl.where(max_lse > float("-inf"), max_lse, 0.0)
    weights = tl.exp2(lse - pivot)
    partial = tl.load(
        partial_out_ptr + (row * num_splits + splits)[:, None] * head_dim + cols[None, :],
        mask=split_mask[:, None] & col_mask[None, :], other=0.0,
    )
    total = tl.sum(weights, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - pivot)
    total = tl.maximum(total, 1e-30)
    out = tl.sum(partial * weights[:, None], axis=0) / total
    tl.store(out_ptr + row * head_dim + cols, out, mask=col_mask)


TILE_GRID = [dict(BLOCK_N=n, SPLITS=splits, num_warps=w, num_stages=st)  # what scripts/tiles.py times
             for n in (32, 64, 128) for splits in (1, 2, 4) for w in (4, 8) for st in (2, 3, 4)]


def tile_config(batch: int, num_kv_heads: int, max_len: int, head_dim: int, device: torch.device,
                group_size: int = 1) -> dict:
    """BLOCK_G (query heads a program), BLOCK_N (positions a tile), SPLITS (programs a sequence's KV head and head
    block is split over), num_warps and num_stages, from shapes alone, never from `lengths`' values.

    A program takes its KV head's whole query group up to 8K output elements (16 heads of 512, 64 of 128): the fp32
    accumulator then stays in registers, and a wider group reads its KV once a head block. A K or V tile of ~16 KB
    (64 positions at D=128) keeps loads 16-byte wide. Splits are added until there is about one program per SM, so
    B=1 still spreads the cache over the chip while large batches pay no combine traffic; with fewer than two
    programs per SM each keeps three stages of loads in flight, with more, two stages leave room for three programs
    per SM. A tile of 8K outputs takes eight warps and two stages (its K tile alone is 32 KB at D=512). Measured on
    an H200 (bf16, llama-3.1-8b heads, context 1024, CUDA-graph replay): B=64 reads the KV cache at 4.0 TB/s, B=16
    at ~3.0 TB/s.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_g = min(max(16, triton.next_power_of_2(group_size)), max(16, 8192 // block_d))
    block_n = min(max(8192 // block_d, 32), 128, max(16, triton.next_power_of_2(max_len)))
    num_sms = multiprocessor_count(device)
    programs = batch * num_kv_heads * triton.cdiv(group_size, block_g)
    splits = triton.cdiv(num_sms, programs)
    if block_g * block_d >= 8192:
        return dict(BLOCK_G=block_g, BLOCK_N=block_n, SPLITS=splits, num_warps=8, num_stages=2)
    num_stages = 3 if programs * splits < 2 * num_sms else 2
    return dict(BLOCK_G=block_g, BLOCK_N=block_n, SPLITS=splits, num_warps=4, num_stages=num_stages)


def split_layout(max_len: int, block_n: int, splits: int) -> tuple[int, int]:
    """(split_len, splits): whole tiles a split, as many splits as that leaves (at most one a tile)."""
    num_blocks = triton.cdiv(max_len, block_n)
    blocks_per_split = triton.cdiv(num_blocks, max(1, min(splits, num_blocks)))
    return blocks_per_split * block_n, triton.cdiv(num_blocks, blocks_per_split)


@torch.library.triton_op("optiq::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, lengths: torch.Tensor,
                         scale: float, num_splits: int | None = None, starts: torch.Tensor | None = None,
                         softcap: float = 0.0, sinks: torch.Tensor | None = None,
                         visible: torch.Tensor | None = None) -> torch.Tensor:
    batch, num_q_heads, q_len, head_dim = q.shape
    _, num_kv_heads, max_len, _ = k_cache.shape
    shared_kv = v_cache is None  # keys that are their own values, loaded once
    v_cache = k_cache if shared_kv else v_cache
    torch._check(q_len == 1, lambda: "decode_attention takes one query token per sequence")
    torch._check(num_q_heads % num_kv_heads == 0, lambda: "query heads must be a multiple of kv heads")
    torch._check(v_cache.shape == k_cache.shape, lambda: "k_cache and v_cache shapes differ")
    torch._check(q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1,
                 lambda: "head_dim must be the innermost, unit-stride axis")
    torch._check(visible is None or (visible.shape == (batch, max_len) and visible.stride(-1) == 1),
                 lambda: "visible must be [batch, cache positions] with a unit last stride")
    group_size = num_q_heads // num_kv_heads
    config = tile_config(batch, num_kv_heads, max_len, head_dim, q.device, group_size)
    block_g, block_n = config["BLOCK_G"], config["BLOCK_N"]
    head_blocks = triton.cdiv(group_size, block_g)
    split_len, splits = split_layout(max_len, block_n, num_splits or config["SPLITS"])
    block_d = max(16, triton.next_power_of_2(head_dim))

    out = torch.empty((batch, 1, num_q_heads, head_dim), device=q.device, dtype=q.dtype)
    one_split = splits == 1  # the split kernel writes the output itself: no partials, no combine
    partial_out = out if one_split else torch.empty((batch, num_q_heads, splits, head_dim), device=q.device,
                                                    dtype=torch.float32)
    partial_lse = lengths if one_split else torch.empty((batch, num_q_heads, splits), device=q.device,
                                                        dtype=torch.float32)

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    launch = launch_options(q)
    torch.library.wrap_triton(_decode_attention_split_kernel)[(batch * num_kv_heads * head_blocks, splits)](
        q, k_cache, v_cache, lengths, lengths if starts is None else starts, lengths if visible is None else visible,
        lengths if sinks is None else sinks, partial_out, partial_lse,
        scale * LOG2E, softcap * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), 0 if visible is None else visible.stride(0),
        num_kv_heads, group_size, head_blocks, head_dim, split_len, splits,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST_DOT=interpreted, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_STARTS=starts is not None, SOFTCAP=softcap > 0, HAS_VISIBLE=visible is not None, SHARED_KV=shared_kv,
        HAS_SINKS=sinks is not None, ONE_SPLIT=one_split,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **launch,
        **prefetch_options(launch, block_n, head_dim, k_cache.element_size()),
    )
    if one_split:
        return out
    torch.library.wrap_triton(_decode_attention_combine_kernel)[(batch * num_q_heads,)](
        partial_out, partial_lse, partial_lse if sinks is None else sinks, out, head_dim, splits, num_q_heads,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, HAS_SINKS=sinks is not None,
        num_warps=4, **launch_options(q),
    )
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     scale: float, num_splits: int | None = None, starts: torch.Tensor | None = None,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None,
                     visible: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over cache positions [starts[b], lengths[b]) of each sequence that `visible[b]`
    lets in (all of them without it); returns [B, 1, Hq, D].

    softcap > 0 caps the scores, sinks add a per-head logit to each softmax's denominator. num_splits overrides
    the shape-based choice of KV splits (for tests and tuning). Values that are the keys' tensor (DeepSeek-V4) are
    read once.
    """
    return torch.ops.optiq.decode_attention(q, k_cache, None if v_cache is k_cache else v_cache, lengths, scale,
                                            num_splits, starts, softcap, sinks, visible)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               lengths: torch.Tensor, scale: float, starts: torch.Tensor | None = None,
                               softcap: float = 0.0, sinks: torch.Tensor | None = None,
                               visible: torch.Tensor | None = None) -> torch.Tensor:
    """Masked softmax in float64, grouping query heads by kv head instead of copying K/V; the sinks as an extra
    score column whose probability is dropped, as transformers' eager GPT-OSS attention computes them.

    Returns [B, 1, Hq, D] in q's dtype; zeros for a sequence of length 0."""
    batch, num_q_heads, _, head_dim = q.shape
    num_kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    grouped_q = q.double().reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    positions = torch.arange(max_len, device=q.device)[None, :]
    valid = positions < lengths.to(q.device)[:, None]
    if starts is not None:
        valid &= positions >= starts.to(q.device)[:, None]
    if visible is not None:
        valid &= visible.to(q.device)
    keys = torch.where(valid[:, None, :, None], k_cache.double(), 0.0)
    values = torch.where(valid[:, None, :, None], v_cache.double(), 0.0)
    scores = torch.einsum("bhgd,bhnd->bhgn", grouped_q, keys) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink_column = sinks.double().reshape(1, num_kv_heads, -1, 1).expand(batch, -1, -1, 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probs = scores.softmax(dim=-1)[..., :max_len]
    probs = torch.where(valid.any(dim=-1)[:, None, None, None], probs, 0.0)
    out = torch.einsum("bhgn,bhnd->bhgd", probs, values)
    return out.reshape(batch, 1, num_q_heads, head_dim).to(q.dtype)


def _repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF's repeat_kv: expand each kv head to its query heads and copy."""
    batch, num_kv_heads, seq_len, head_dim = hidden.shape
    expanded = hidden[:, :, None].expand(batch, num_kv_heads, n_rep, seq_len, head_dim)
    return expanded.reshape(batch, num_kv_heads * n_rep, seq_len, head_dim)


ATTENTION_SHAPES = {  # (query heads, kv heads, head_dim) of the presets' decode attention
    "llama-3.1-8b": (32, 8, 128), "phi-3-mini": (32, 32, 96), "gemma-3-1b": (4, 1, 256),
}


def benchmark_case(rows: int, dtype: torch.dtype, device, context: int = 1024) -> dict:
    """The presets' decode attention at ``context`` filled positions of a 1024-long static cache, and
    DeepSeek-V4-Flash's over the keys its static cache gathers."""
    cases = {f"decode_attention {label}": _attention_case(rows, *shape, dtype, device, context)
             for label, shape in ATTENTION_SHAPES.items()}
    return {**cases, "decode_attention deepseek-v4-flash": _gathered_case(rows, dtype, device)}


def _attention_case(rows: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device, context: int) -> dict:
    max_len = 1024
    generator = torch.Generator(device=device).manual_seed(rows)
    q = torch.randn(rows, num_q_heads, 1, head_dim, device=device, dtype=dtype, generator=generator)
    k_cache = torch.randn(rows, num_kv_heads, max_len, head_dim, device=device, dtype=dtype, generator=generator)
    v_cache = torch.randn(rows, num_kv_heads, max_len, head_dim, device=device, dtype=dtype, generator=generator)
    lengths = torch.full((rows,), context, device=device, dtype=torch.int64)
    scale = head_dim ** -0.5
    # HF builds the mask once per step for all layers, so it stays out of the timed region
    mask = (torch.arange(max_len, device=device)[None, :] < lengths[:, None])[:, None, None, :]
    n_rep = num_q_heads // num_kv_heads

    def eager():
        out = torch.nn.functional.scaled_dot_product_attention(
            q, _repeat_kv(k_cache, n_rep), _repeat_kv(v_cache, n_rep), attn_mask=mask, scale=scale)
        return out.transpose(1, 2).contiguous()

    element = q.element_size()
    kv_bytes = 2 * rows * num_kv_heads * context * head_dim * element
    return {
        "fused": lambda: decode_attention(q, k_cache, v_cache, lengths, scale),
        "eager": eager,
        "bytes": kv_bytes + 2 * q.numel() * element + lengths.numel() * lengths.element_size(),
        "flops": 4 * rows * num_q_heads * context * head_dim,
    }


def _gathered_case(rows: int, dtype: torch.dtype, device, heads: int = 64, head_dim: int = 512,
                   window: int = 128, entries: int = 160) -> dict:
    """A DeepSeek-V4-Flash CSA layer's decode at position 640 (W1's prompt and new tokens): 64 query heads over one
    key-value head (keys are their values) of 512, gathered as its static cache does (the 128-position window, then
    the indexer's picks of the 160 closed entries), with its per-head sinks; "eager" is HF's eager attention over
    them (the KV head repeated to every query head, the sinks a softmax column)."""
    generator = torch.Generator(device=device).manual_seed(rows)
    keys_len = window + entries
    q = torch.randn(rows, heads, 1, head_dim, device=device, dtype=dtype, generator=generator)
    keys = torch.randn(rows, 1, keys_len, head_dim, device=device, dtype=dtype, generator=generator)
    sinks = torch.randn(heads, device=device, dtype=torch.float32, generator=generator)
    visible = torch.ones(rows, keys_len, device=device, dtype=torch.bool)
    lengths = torch.full((rows,), keys_len, device=device, dtype=torch.int64)
    scale = head_dim ** -0.5

    def eager():
        repeated = _repeat_kv(keys, heads)
        scores = torch.matmul(q, repeated.transpose(2, 3)) * scale
        scores = torch.cat([scores, sinks.to(dtype).reshape(1, -1, 1, 1).expand(rows, -1, 1, 1)], dim=-1)
        probs = torch.softmax(scores.float(), dim=-1).to(dtype)[..., :keys_len]
        return torch.matmul(probs, repeated).transpose(1, 2).contiguous()

    element = q.element_size()
    return {
        "fused": lambda: decode_attention(q, keys, keys, lengths, scale, sinks=sinks, visible=visible),
        "eager": eager,
        "bytes": rows * keys_len * head_dim * element + 2 * q.numel() * element + visible.numel(),
        "flops": 4 * rows * heads * keys_len * head_dim,
    }
