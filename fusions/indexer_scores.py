"""A lightning indexer's scores (DeepSeek-V4's CSA) in one kernel: ``sum_h w[h] * relu(q[h] . k[t]) * scale``.

HF's scorer casts the queries and the compressed keys to fp32, multiplies them in an fp32 batched GEMM (a SIMT GEMM:
fp32 has no tensor-core path of its own precision), then runs the ReLU, the softmax scale, the weights' cast and
scale, their product and the sum over the heads as a kernel each: nine launches at decode beside the weights'
projection, and the [B, H, T] fp32 scores written and read back four times.

Here the queries and keys are read as bf16 and multiplied on the tensor cores with fp32 accumulation; the ReLU, the
head weights and the sum over the heads follow in registers, and only the [B, T] scores are written. bf16 operands
multiply exactly in fp32: in a bf16 model, whose queries and keys are bf16 (DeepSeek-V4's kv_norm returns its
input's dtype), only the order of the sums changes; fp32 ones (an fp32 model's) are rounded to bf16 in the kernel,
once, as they are loaded, and that rounding is the precision flip's error. One program takes one batch row and
BLOCK_T keys over all heads (in blocks of up to MAX_BLOCK_H) and all of D (in blocks of up to MAX_BLOCK_D); BLOCK_T
shrinks until the programs fill the SMs, since at one sequence a 256-entry cache is only four blocks of 64.
"""

import torch
import triton
import triton.language as tl

from optiq.fusions.gate_up_swiglu import dot_accumulate, fp32_dot
from optiq.fusions.launch import launch_options, multiprocessor_count, wait_for_predecessor
from optiq.fusions.rounding import round_to

MIN_BLOCK = 16  # the smallest side of a tensor-core dot
MAX_BLOCK_T = 64
MAX_BLOCK_H = 64  # V4-Flash's index_n_heads: every head in one dot
MAX_BLOCK_D = 128  # V4-Flash's index_head_dim


@triton.jit
def _bf16(x, FP32_DOT: tl.constexpr):
    """x rounded to bf16, to nearest with ties to even as the GPU converts. The interpreter's conversion truncates
    instead (about 0.3% toward zero an operand on average: a bias on every score, larger than the flip's own
    error); there the rounding is done on fp32's bits and the values stay fp32, which dot_accumulate takes in IEEE
    fp32 under FP32_DOT."""
    if FP32_DOT:
        rounded = round_to(x.to(tl.float32), tl.bfloat16)
    else:
        rounded = x.to(tl.bfloat16)
    return rounded  # one return: Triton (3.9) types a function by all its returns, even a constexpr branch's


@triton.jit
def _indexer_scores_kernel(q_ptr, k_ptr, w_ptr, out_ptr, H, T, D, scale,
                           BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                           FP32_DOT: tl.constexpr, USE_PDL: tl.constexpr):
    """out[b, t] for batch row program_id(0) and keys program_id(1) * BLOCK_T + [0, BLOCK_T): per block of heads,
    the [BLOCK_H, BLOCK_T] dots over all of D, then ReLU, times the heads' weights, summed over the heads. Padded
    heads load zero weights, padded keys and columns zeros: they add nothing."""
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    keys = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    key_mask = keys < T
    q_row = q_ptr + row * H * D
    k_row = k_ptr + row * T * D
    cols = tl.arange(0, BLOCK_D)
    scores = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        head_mask = heads < H
        dots = tl.zeros((BLOCK_H, BLOCK_T), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            col_mask = d0 + cols < D
            q = tl.load(q_row + heads[:, None] * D + d0 + cols[None, :], mask=head_mask[:, None] & col_mask[None, :],
                        other=0.0)
            k = tl.load(k_row + keys[None, :] * D + d0 + cols[:, None], mask=key_mask[None, :] & col_mask[:, None],
                        other=0.0)  # [BLOCK_D, BLOCK_T]: the keys transposed
            dots = dot_accumulate(_bf16(q, FP32_DOT), _bf16(k, FP32_DOT), dots, FP32_DOT)
        weights = tl.load(w_ptr + row * H + heads, mask=head_mask, other=0.0).to(tl.float32)
        scores += tl.sum(tl.maximum(dots, 0.0) * weights[:, None], axis=0)
    # in fp32 whatever the scale's type: eager Triton passes a float as fp32, Inductor as fp64
    tl.store(out_ptr + row * T + keys, scores * tl.cast(scale, tl.float32), mask=key_mask)


def _block_t(batch: int, entries: int, device: torch.device) -> int:
    """The keys a program takes: the most (up to MAX_BLOCK_T, no more than the entries need) at which the programs
    still fill the SMs, else the fewest a dot takes."""
    block = max(MIN_BLOCK, min(MAX_BLOCK_T, triton.next_power_of_2(entries)))
    while block > MIN_BLOCK and batch * triton.cdiv(entries, block) < multiprocessor_count(device):
        block //= 2
    return block


def _block(size: int, largest: int) -> int:
    return max(MIN_BLOCK, min(largest, triton.next_power_of_2(size)))


@torch.library.triton_op("optiq::indexer_scores", mutates_args=())
def _indexer_scores_op(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    q, k, weights = q.contiguous(), k.contiguous(), weights.contiguous()
    (batch, heads, dim), entries = q.shape, k.shape[1]
    out = torch.empty((batch, entries), dtype=torch.float32, device=q.device)
    if entries == 0:  # a sequence before its first closed window: nothing to score, and no grid to launch
        return out
    block_t = _block_t(batch, entries, q.device)
    grid = (batch, triton.cdiv(entries, block_t))
    torch.library.wrap_triton(_indexer_scores_kernel)[grid](
        q, k, weights, out, heads, entries, dim, scale,
        BLOCK_H=_block(heads, MAX_BLOCK_H), BLOCK_T=block_t, BLOCK_D=_block(dim, MAX_BLOCK_D),
        FP32_DOT=fp32_dot(torch.bfloat16), num_warps=4, **launch_options(q, programs=grid[0] * grid[1]))
    return out


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D], k [B, T, D] and weights [B, H] (any float dtypes) -> scores [B, T] fp32:
    ``sum_h weights[b, h] * relu(q[b, h] . k[b, t]) * scale``, q and k rounded to bf16 and multiplied with fp32
    accumulation (module docstring). HF's DeepseekV4IndexerScorer at one query position, its two scales as one."""
    if q.dim() != 3 or k.dim() != 3 or weights.shape != q.shape[:2] or (k.shape[0], k.shape[2]) != (q.shape[0],
                                                                                                   q.shape[2]):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and weights {tuple(weights.shape)} do not fit: "
                         f"need [B, H, D], [B, T, D] and [B, H]")
    return torch.ops.optiq.indexer_scores(q, k, weights, float(scale))


def indexer_scores_reference(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """What HF's scorer computes from the same operands, in torch ops and fp32 (the benchmark's eager path)."""
    scores = torch.relu(q.float() @ k.float().transpose(-1, -2))  # [B, H, T]
    return (scores * weights.float().unsqueeze(-1)).sum(dim=-2) * scale


def benchmark_case(rows: int, dtype: torch.dtype, device) -> dict:
    """DeepSeek-V4-Flash's indexer (64 heads of 128) at ``rows`` decode tokens over a 1024-position cache's 256
    compressed entries; queries, keys and weights in ``dtype``, as the model computes them."""
    gen = torch.Generator(device=device).manual_seed(rows)
    q = torch.randn(rows, 64, 128, generator=gen, device=device).to(dtype)
    k = torch.randn(rows, 256, 128, generator=gen, device=device).to(dtype)
    weights = torch.randn(rows, 64, generator=gen, device=device).to(dtype)
    scale = (128 * 64) ** -0.5
    return {
        "fused": lambda: indexer_scores(q, k, weights, scale),
        "eager": lambda: indexer_scores_reference(q, k, weights, scale),
        "bytes": (q.numel() + k.numel() + weights.numel()) * dtype.itemsize + rows * 256 * 4,
        "flops": 2 * rows * 64 * 256 * 128,
    }
