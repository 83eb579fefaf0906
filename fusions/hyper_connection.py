"""A hyper-connection's mixing weights (DeepSeek-V4's mHC) in two kernels instead of about 140.

A token carries N residual streams of width D. Before each attention or MLP block, HF normalises the flattened
streams (an RMSNorm without weight), projects them with a [(2 + N) N, N D] fp32 matrix, turns the projection into
collapse weights ``pre`` (a sigmoid), expansion weights ``post`` (twice a sigmoid) and an N x N mixing matrix ``comb``
(a softmax made doubly stochastic by Sinkhorn-Knopp iterations), and collapses the streams into the block's input
with ``pre``. Every step is a few tiny kernels, and the Sinkhorn loop alone is 114 a call at 20 iterations (a sum, an
add and a divide per normalisation): at decode the GPU waits on launches.

Here the first kernel takes the projection's partial dot products over slices of N D, and with them each slice's sum
of squares (the norm is unweighted, so its scale factors out of the dot products and is applied afterwards); every
slice and block of up to TOKENS_BLOCK tokens a program, so one token still spreads over the GPU and fn is read once a
block of tokens, not once a token. The second kernel has, per token, one program for post and comb (the activations
and Sinkhorn on the N x N matrix in registers) and one per slice of D for the collapse, each recomputing the few
scalars it needs from the partial sums: nothing in it walks D serially, so a token's time is a couple of memory round
trips, not one per block of D. All in fp32 as HF computes it; the partial sums are added in a fixed order, so a call's
results do not vary from run to run.
"""

import torch
import triton
import triton.language as tl

from optiq.fusions.launch import launch_options, wait_for_predecessor

BLOCK_K = 256  # elements of N D a program of the projection reads
CHUNK_K = 16  # of them it multiplies at a time (64 bytes of a row of fn, in vector loads): see _project_kernel
# Most tokens a projection program takes (with fewer, the least power of two that holds them). Each program reads
# its chunks of fn once for all its tokens, so fn's bytes from L2 shrink with the block; a block this size still
# leaves a program per SM at 16 tokens (V4's N D makes 64 slices) and its accumulators in registers.
TOKENS_BLOCK = 8
# Hidden elements of all N streams a collapse program reads and writes. Such a program is latency-bound: it issues
# two independent loads (the token's partial sums, its slice of the streams), waits one round trip, and does N
# multiply-adds an element. Its slice stays a single round trip (a few elements a thread) and its re-read of the
# partial sums (SPLITS rows, a sector or two each) no larger than the slice itself; narrower slices would spread one
# token over more SMs without shortening that round trip, and re-read the partial sums more often at many tokens.
BLOCK_D = 512


@triton.jit
def _project_kernel(x_ptr, fn_ptr, partial_ptr, tokens, K, OUTPUTS, stride_xt, stride_fo, stride_pt, stride_ps,
                    TOKENS_BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                    CHUNK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """partial[t, s, o] = sum over the s-th slice of K of x[t, k] * fn[o, k] for o < OUTPUTS, and
    partial[t, s, OUTPUTS] = the slice's sum of x[t, k] squared (the norm's share of it), for the program's
    TOKENS_BLOCK tokens of one slice: each chunk of fn it loads serves all of them.

    The slice is walked CHUNK_K elements at a time, every product added into an accumulator of its own
    ([tokens, outputs, CHUNK_K], so in the thread that computed it), and summed across threads once at the end. A
    sum across the whole slice per token, as a [outputs, slice] tile, spreads each output's 256 products over a warp
    and costs a tree of warp shuffles per output and token: those, not the multiply-adds, bound the kernel at many
    tokens. A broadcast multiply and sum rather than tl.dot: tl.dot needs 16 rows a side, so decode's 1 to 8 tokens
    would be padded to 16 (most of the work wasted where latency matters most), and in fp32 it must run in IEEE
    precision (tf32 would change the function), on the same FMA units, so it would buy nothing the accumulators do
    not. A chunk is wide enough for whole vector loads of fn's rows and narrow enough for the accumulators to stay
    in registers; the chunk loop is unrolled, so the loads of all chunks are independent and issued together."""
    wait_for_predecessor(USE_PDL)
    block_tokens = tl.program_id(0).to(tl.int64) * TOKENS_BLOCK + tl.arange(0, TOKENS_BLOCK)
    split = tl.program_id(1)
    outs = tl.arange(0, OUT_BLOCK)
    chunk = tl.arange(0, CHUNK_K)
    present = block_tokens[:, None] < tokens  # the last block's tokens past the end read and write nothing
    products = tl.zeros((TOKENS_BLOCK, OUT_BLOCK, CHUNK_K), dtype=tl.float32)
    squares = tl.zeros((TOKENS_BLOCK, CHUNK_K), dtype=tl.float32)
    for k0 in tl.static_range(0, BLOCK_K, CHUNK_K):
        ks = split * BLOCK_K + k0 + chunk
        x = tl.load(x_ptr + block_tokens[:, None] * stride_xt + ks[None, :], mask=present & (ks[None, :] < K),
                    other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + outs[:, None] * stride_fo + ks[None, :],
                    mask=(outs[:, None] < OUTPUTS) & (ks[None, :] < K), other=0.0).to(tl.float32)
        products += w[None, :, :] * x[:, None, :]
        squares += x * x
    sums = tl.where(outs[None, :] == OUTPUTS, tl.sum(squares, axis=1)[:, None], tl.sum(products, axis=2))
    tl.store(partial_ptr + block_tokens[:, None] * stride_pt + split * stride_ps + outs[None, :], sums,
             mask=present & (outs[None, :] <= OUTPUTS))


@triton.jit
def _rstd(split_rows, split_mask, D, norm_eps, N: tl.constexpr):
    """The unweighted norm's 1 / rms over the token's N D elements, from the slices' sums of squares."""
    squares = tl.sum(tl.load(split_rows + (2 + N) * N, mask=split_mask, other=0.0), axis=0)
    return tl.rsqrt(squares / (N * D) + norm_eps)


@triton.jit
def _post_and_comb(split_rows, split_mask, streams, stream_mask, base_ptr, scale_ptr, post_row, comb_row, rstd,
                   hc_eps, iterations, N: tl.constexpr):
    """post (twice a sigmoid) and comb (a row softmax made doubly stochastic by Sinkhorn) of one token, stored."""
    post_w = tl.sum(tl.load(split_rows[:, None] + N + streams[None, :],
                            mask=split_mask[:, None] & stream_mask[None, :], other=0.0), axis=0) * rstd
    square = streams[:, None] * N + streams[None, :]
    square_mask = stream_mask[:, None] & stream_mask[None, :]
    comb_w = tl.sum(tl.load(split_rows[:, None, None] + 2 * N + square[None, :, :],
                            mask=split_mask[:, None, None] & square_mask[None, :, :], other=0.0), axis=0) * rstd
    post = 2.0 * tl.sigmoid(post_w * tl.load(scale_ptr + 1).to(tl.float32)
                            + tl.load(base_ptr + N + streams, mask=stream_mask, other=0.0).to(tl.float32))
    logits = comb_w * tl.load(scale_ptr + 2).to(tl.float32) + tl.load(base_ptr + 2 * N + square, mask=square_mask,
                                                                      other=0.0).to(tl.float32)
    logits = tl.where(square_mask, logits, -1e30)  # padding: no weight in a real row, no inf - inf in its own
    shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = tl.where(square_mask, shifted / tl.sum(shifted, axis=1)[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(iterations - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(post_row + streams, post, mask=stream_mask)
    tl.store(comb_row + square, comb, mask=square_mask)


@triton.jit
def _collapse_slice(split_rows, split_mask, streams, stream_mask, base_ptr, scale_ptr, x_row, out_row, d_block, D,
                    rstd, hc_eps, BLOCK_D: tl.constexpr):
    """The d_block-th BLOCK_D elements of the streams collapsed by pre (a sigmoid, + hc_eps), stored."""
    pre_w = tl.sum(tl.load(split_rows[:, None] + streams[None, :], mask=split_mask[:, None] & stream_mask[None, :],
                           other=0.0), axis=0) * rstd
    pre = tl.sigmoid(pre_w * tl.load(scale_ptr).to(tl.float32)
                     + tl.load(base_ptr + streams, mask=stream_mask, other=0.0).to(tl.float32)) + hc_eps
    cols = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    x = tl.load(x_row + streams[:, None] * D + cols[None, :], mask=stream_mask[:, None] & (cols[None, :] < D),
                other=0.0).to(tl.float32)
    collapsed = tl.sum(pre[:, None] * x, axis=0)  # padded streams and columns load zeros
    tl.store(out_row + cols, collapsed.to(out_row.dtype.element_ty), mask=cols < D)


@triton.jit
def _mix_kernel(x_ptr, partial_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr,
                D, SPLITS, norm_eps, hc_eps, iterations,
                stride_xt, stride_pt, stride_ps, stride_post, stride_comb, stride_out,
                N: tl.constexpr, N_BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                USE_PDL: tl.constexpr):
    """Program (t, 0): token t's post and comb; program (t, 1 + b): its collapse's b-th slice of D. Post, comb and
    the collapse need only the partial sums, so they run side by side, and Sinkhorn's serial iterations overlap the
    collapse instead of preceding it. A token's row of partial sums holds, each summed over the splits, pre's
    projection at [0, N), post's at [N, 2N), comb's at 2N + i N + j, and the sum of squares at (2 + N) N."""
    wait_for_predecessor(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    column = tl.program_id(1)
    splits = tl.arange(0, SPLIT_BLOCK)
    split_rows = partial_ptr + token * stride_pt + splits * stride_ps
    split_mask = splits < SPLITS
    streams = tl.arange(0, N_BLOCK)
    stream_mask = streams < N
    rstd = _rstd(split_rows, split_mask, D, norm_eps, N)
    if column == 0:
        _post_and_comb(split_rows, split_mask, streams, stream_mask, base_ptr, scale_ptr,
                       post_ptr + token * stride_post, comb_ptr + token * stride_comb, rstd, hc_eps, iterations, N)
    else:
        _collapse_slice(split_rows, split_mask, streams, stream_mask, base_ptr, scale_ptr, x_ptr + token * stride_xt,
                        out_ptr + token * stride_out, column - 1, D, rstd, hc_eps, BLOCK_D)


@torch.library.triton_op("optiq::hyper_connection", mutates_args=())
def _hyper_connection_op(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                         norm_eps: float, hc_eps: float, iterations: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    *leading, n, d = streams.shape
    x = streams.reshape(-1, n * d)
    tokens, outputs = x.shape[0], fn.shape[0]
    splits = triton.cdiv(n * d, BLOCK_K)
    # Per token and slice: the projection's outputs, then the slice's sum of squares.
    partial = torch.empty((tokens, splits, outputs + 1), dtype=torch.float32, device=streams.device)
    post = torch.empty((tokens, n), dtype=torch.float32, device=streams.device)
    comb = torch.empty((tokens, n, n), dtype=torch.float32, device=streams.device)
    collapsed = torch.empty((tokens, d), dtype=streams.dtype, device=streams.device)
    tokens_block = min(triton.next_power_of_2(tokens), TOKENS_BLOCK)
    torch.library.wrap_triton(_project_kernel)[(triton.cdiv(tokens, tokens_block), splits)](
        x, fn, partial, tokens, n * d, outputs, x.stride(0), fn.stride(0), partial.stride(0), partial.stride(1),
        TOKENS_BLOCK=tokens_block, OUT_BLOCK=triton.next_power_of_2(outputs + 1), BLOCK_K=BLOCK_K, CHUNK_K=CHUNK_K,
        **launch_options(streams))
    mix_grid = (tokens, 1 + triton.cdiv(d, BLOCK_D))
    torch.library.wrap_triton(_mix_kernel)[mix_grid](
        x, partial, base, scale, post, comb, collapsed, d, splits, norm_eps, hc_eps, iterations,
        x.stride(0), partial.stride(0), partial.stride(1), post.stride(0), comb.stride(0), collapsed.stride(0),
        N=n, N_BLOCK=triton.next_power_of_2(n), SPLIT_BLOCK=triton.next_power_of_2(splits), BLOCK_D=BLOCK_D,
        **launch_options(streams, programs=mix_grid[0] * mix_grid[1]))
    return post.view(*leading, n), comb.view(*leading, n, n), collapsed.view(*leading, d)


def hyper_connection(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     norm_eps: float, hc_eps: float, iterations: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [..., N, D], fn [(2 + N) N, N D], base [(2 + N) N] and scale [3] (read as fp32) -> (post [..., N],
    comb [..., N, N], both fp32; collapsed [..., D] in the streams' dtype): HF's DeepseekV4HyperConnection.forward,
    the norm's eps ``norm_eps``, ``hc_eps`` added where HF adds it, ``iterations`` Sinkhorn iterations."""
    n, d = streams.shape[-2:]
    outputs = (2 + n) * n
    if fn.shape != (outputs, n * d) or base.shape != (outputs,) or scale.shape != (3,):
        raise ValueError(f"fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)} do not "
                         f"mix {n} streams of {d}")
    if iterations < 1:
        raise ValueError(f"{iterations} Sinkhorn iterations: at least one is needed")
    return torch.ops.optiq.hyper_connection(streams.contiguous(), fn.contiguous(), base, scale, float(norm_eps),
                                            float(hc_eps), int(iterations))

