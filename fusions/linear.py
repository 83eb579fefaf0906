"""Decode-sized GEMMs, y = x @ W.T (+ bias) with a few rows of x, as one weight-streaming Triton kernel.

At decode x has one row per sequence and the GEMM's cost is reading W once. Each program streams BLOCK_N rows of W
over all of K in wide tiles with several loads in flight, x (padded to the 16 rows a tensor-core dot takes) comes from
L2, and there is one launch, where cuBLAS splits K and adds the splits in a second kernel (qwen3-0.6b's o_proj and
down_proj, llama-3.1-8b's down_proj) or leaves SMs idle (96 CTAs for llama-3.1-8b's QKV GEMM); at one row it beat
cuBLAS on every preset GEMM measured (scripts/tiles.py linear; BENCHMARKS.md has the times). Past DECODE_ROWS rows
the GEMM goes to cuBLAS, through F.linear, which was faster there.
A residual may be added in the epilogue (the decoder layer's add after down_proj), so the sum is written once, with
one rounding, and costs no kernel of its own.
A projection too narrow to give every SM an output tile (a 1024-column o_proj is 32 tiles for 132 SMs) has its K cut
into slices, split-K, still in the one launch: each program writes its fp32 partial sum, and the last program of a
tile to arrive (an arrival counter per tile, left at zero for the next launch) adds the partials in slice order and
runs the epilogue, so the result does not depend on which program came last.
"""

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from optiq.fusions.gate_up_swiglu import fp32_dot, stream_dot
from optiq.fusions.launch import (launch_options, multiprocessor_count, prefetch_options, prefetch_rows,
                                 shared_memory_per_multiprocessor, wait_for_predecessor)

DECODE_ROWS = 16  # rows up to which the streaming kernel is used
MAX_BLOCK_M = 64  # the kernel's largest M tile: every row of x in one tile, so W is read once
KSPLIT_MIN = 256  # the narrowest K slice split-K cuts (qwen3-0.6b's down_proj was fastest in slices of 384)
MAX_SPLITS = 8
ARRIVAL_SLOTS = 1 << 16  # split-K arrival counters a device keeps: output tiles of one launch
TILE_GRID = [dict(BLOCK_N=n, BLOCK_K=k, SPLITS=splits)  # what scripts/tiles.py times (4 warps beat 8 everywhere)
             for n in (16, 32, 64) for k in (128, 256) for splits in (1, 2, 3, 4, 6, 8)]


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, partial_ptr, arrivals_ptr, M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_rn, stride_om, stride_on,
    stride_xg, stride_wg, stride_og,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, FP32_DOT: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr,
):
    """Output columns [BLOCK_N] of every row (M <= BLOCK_M) of group program_id(1) (x, w and out advanced by their
    group strides; one group for a plain linear), accumulated in fp32 over K slice program_id(2) of SPLITS, the bias
    and the residual added to the whole sum before its one rounding.

    With SPLITS > 1 each program writes its fp32 partial sum to ``partial_ptr`` and counts itself in the tile's
    arrival counter; the last to arrive adds the SPLITS partials in split order (the same sum whichever program is
    last), runs the epilogue and sets the counter back to 0 for the next call."""
    group = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    x_ptr += group * stride_xg + split * k_per_split * stride_xk
    w_ptr += group * stride_wg + split * k_per_split * stride_wk
    out_ptr += group * stride_og
    rows = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    cols = tl.program_id(0) * BLOCK_N + offs_n
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    k_slice = tl.minimum(K - split * k_per_split, k_per_split)
    prefetch_rows(w_ptr, cols, N, k_slice, stride_wn, stride_wk, PREFETCH_LINES, LINE)
    wait_for_predecessor(USE_PDL)
    acc = stream_dot(x_ptr, w_ptr, rows, cols, M, N, k_slice,
                     stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, FP32_DOT)
    last = True
    if SPLITS > 1:
        tile = group * tl.num_programs(0) + tl.program_id(0)
        partials = partial_ptr + ((tile * SPLITS * BLOCK_M + rows[:, None]) * BLOCK_N + offs_n[None, :])
        tl.store(partials + split * BLOCK_M * BLOCK_N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival that publishes them
        last = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel") == SPLITS - 1
        if last:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for other in range(SPLITS):  # from L2: written by other SMs during this kernel
                acc += tl.load(partials + other * BLOCK_M * BLOCK_N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(arrivals_ptr + tile, 0)
    if last:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if HAS_RESIDUAL:
            residual = tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :] * stride_rn, mask=mask, other=0.0)
            acc += residual.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


def split_count(tiles: int, k: int, num_sms: int) -> int:
    """K slices each output tile is cut into when the tiles alone leave a third of the SMs idle or more (qwen3-0.6b's
    1024 columns are 32 tiles of 32 for 132 SMs, Gemma-3-1B's 1152 are 36): as many as keep every program on an SM
    of its own (a slice more, and some SMs stream two programs' weights while others idle), each slice still
    KSPLIT_MIN wide; one where the tiles (nearly) fill the GPU (Phi-3's 3072 columns, 96 tiles: slicing them
    measured no faster)."""
    if 3 * tiles > 2 * num_sms or os.environ.get("OPTIQ_SPLIT_K", "1") == "0":  # the knob: to measure what it buys
        return 1
    return max(1, min(num_sms // tiles, k // KSPLIT_MIN, MAX_SPLITS))


def tile_config(n: int, k: int, device: torch.device, rows: int = 1, itemsize: int = 2) -> dict:
    """Tiles from the shapes, as measured on the H200 and H100 (scripts/tiles.py linear, 4 warps always ahead of 8):
    32 output columns per program from 2048 columns up, or past 8 rows (where x's re-reads through L2 count), else
    16, so that a 1024-column projection still spreads over 64 SMs at one row, unless its K is sliced (split_count),
    where 32 columns a tile halve the slices' x reads. K tiles of 512 when every program has an SM of its own and its
    K slice spans four tiles or more. When the programs outnumber the SMs, K tiles of 128 wherever their four stages
    let all of an SM's programs stay resident together: 256-wide ones left Phi-3's QKV (three programs an SM) 16%
    slower and DeepSeek-V4's grouped output projection (two an SM) a third slower, and cost Llama's QKV (one or two an
    SM) under 3%. Else 256: an LM head's thousands of programs run in waves whatever the tile."""
    num_sms = multiprocessor_count(device)
    block_n = 32 if n >= 2048 or rows > 8 or split_count(triton.cdiv(n, 16), k, num_sms) > 1 else 16
    tiles = triton.cdiv(n, block_n)
    splits = split_count(tiles, k, num_sms)
    # Past 16 rows (which the product hands to cuBLAS; scripts/tiles.py times the kernel there, to find where it
    # should take over): one 64-row x tile, whose K tiles of 128 keep three stages within shared memory
    if rows > 16:
        block_m, block_k, stages = MAX_BLOCK_M, 128, 3
    else:
        block_m, stages = 16, 4
        per_sm = triton.cdiv(tiles * splits, num_sms)  # programs an SM holds in one wave
        resident = per_sm * stages * (16 + block_n) * 128 * itemsize <= shared_memory_per_multiprocessor(device)
        block_k = 512 if k // splits >= 4 * 512 and per_sm == 1 else 128 if per_sm > 1 and resident else 256
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=k_slices(k, splits, block_k)[1],
                num_warps=4, num_stages=stages)


def k_slices(k: int, splits: int, block_k: int) -> tuple[int, int]:
    """(slice width, slices): ``splits`` slices of whole K tiles each, as many as that leaves (none empty)."""
    width = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    return width, triton.cdiv(k, width)


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters of ``device``: made zero once, and left zero by every launch (the last program of
    a tile resets its counter), so no launch needs a memset of its own. Launches on one stream take turns with them."""
    if device not in _ARRIVALS:
        _ARRIVALS[device] = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)
    return _ARRIVALS[device]


def launch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, arrivals: torch.Tensor,
                  residual: torch.Tensor | None = None, groups: int = 1) -> torch.Tensor:
    """The kernel for up to DECODE_ROWS rows of x, cuBLAS past them (with the residual in its epilogue, addmm, when
    there is no bias; one batched GEMM over the groups). Called from inside a triton_op; ``arrivals`` are
    arrival_counters(x.device), which the op mutates (and leaves as it found them)."""
    k = x.shape[-1]
    n = weight.shape[0] // groups
    x3d = x.reshape(-1, groups, k)
    rows = x3d.shape[0]
    if rows > DECODE_ROWS:
        if groups > 1:
            out = torch.bmm(x3d.transpose(0, 1), weight.view(groups, n, k).transpose(1, 2)).transpose(0, 1)
            return out.reshape(*x.shape[:-1], n)
        if residual is None:
            return F.linear(x, weight, bias)
        if bias is None:
            return torch.addmm(residual.reshape(rows, n), x3d[:, 0], weight.t()).view(residual.shape)
        return residual + F.linear(x, weight, bias)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    out3d = out.view(rows, groups, n)
    r2d = residual.reshape(rows, n) if residual is not None else out3d[:, 0]
    config = tile_config(groups * n, k, x.device, rows, x.element_size())  # the programs of every group share SMs
    tiles = triton.cdiv(n, config["BLOCK_N"])
    k_per_split, splits = k_slices(k, config["SPLITS"] if groups * tiles <= arrivals.numel() else 1, config["BLOCK_K"])
    launch = launch_options(x, programs=groups * tiles * splits)
    partials = torch.empty((groups * tiles * splits * config["BLOCK_M"] * config["BLOCK_N"],) if splits > 1 else (1,),
                           dtype=torch.float32, device=x.device)
    torch.library.wrap_triton(_linear_kernel)[(tiles, groups, splits)](
        x3d, weight, bias if bias is not None else weight, r2d, out3d, partials, arrivals, rows, n, k, k_per_split,
        x3d.stride(0), x3d.stride(2), *weight.stride(), *r2d.stride(), out3d.stride(0), out3d.stride(2),
        x3d.stride(1), n * weight.stride(0), out3d.stride(1),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, FP32_DOT=fp32_dot(x.dtype),
        **{**config, "SPLITS": splits}, **launch,
        **prefetch_options(launch, config["BLOCK_N"], k_per_split, weight.element_size()),
    )
    return out


@torch.library.triton_op("optiq::linear", mutates_args={"arrivals"})
def _linear_op(x: torch.Tensor, weight: torch.Tensor, arrivals: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, groups: int = 1) -> torch.Tensor:
    return launch_linear(x, weight, bias, arrivals, residual, groups)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) (+ residual [..., N]) -> [..., N] in x's dtype: nn.Linear's
    function, and the residual add after it, accumulated in fp32 and rounded once; more than DECODE_ROWS rows go to
    cuBLAS."""
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} is not [N, {x.shape[-1]}]")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} is not [{weight.shape[0]}]")
    if residual is not None and residual.shape != (*x.shape[:-1], weight.shape[0]):
        raise ValueError(f"residual {tuple(residual.shape)} is not {(*x.shape[:-1], weight.shape[0])}")
    return torch.ops.optiq.linear(x, weight, arrival_counters(x.device), bias, residual)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """x [..., G, K] and weight [G N, K] -> [..., G, N] in x's dtype: group g of x through the g-th block of N rows
    of weight, a block-diagonal projection (DeepSeek-V4's grouped output projection), every group in the one launch
    of the decode GEMM (HF's batched GEMM is followed by a copy of its transposed output); cuBLAS's batched GEMM past
    DECODE_ROWS rows."""
    if groups < 1 or weight.dim() != 2 or weight.shape[0] % groups or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} is not [{groups} N, {x.shape[-1]}]")
    if x.dim() < 2 or x.shape[-2] != groups:
        raise ValueError(f"x {tuple(x.shape)} does not hold {groups} groups in its second-to-last dim")
    return torch.ops.optiq.linear(x, weight, arrival_counters(x.device), None, None, groups)


def grouped_linear_reference(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """The block-diagonal product as HF's DeepseekV4GroupedLinear computes it: one batched GEMM over the groups."""
    n, k = weight.shape[0] // groups, weight.shape[1]
    x3d = x.reshape(-1, groups, k).transpose(0, 1)
    return torch.bmm(x3d, weight.view(groups, n, k).transpose(1, 2)).transpose(0, 1).reshape(*x.shape[:-1], n)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """nn.Linear as HF runs it."""
    return F.linear(x, weight, bias)


PROJECTIONS = {  # (K, N) of the presets' decode GEMMs
    "llama-3.2-1b qkv": (2048, 3072), "llama-3.2-1b o_proj": (2048, 2048), "llama-3.2-1b down_proj": (8192, 2048),
    "qwen3-0.6b qkv": (1024, 4096), "qwen3-0.6b o_proj": (2048, 1024), "qwen3-0.6b down_proj": (3072, 1024),
    "llama-3.1-8b qkv": (4096, 6144), "llama-3.1-8b o_proj": (4096, 4096), "llama-3.1-8b down_proj": (14336, 4096),
    "phi-3-mini qkv": (3072, 9216), "phi-3-mini o_proj": (3072, 3072), "phi-3-mini down_proj": (8192, 3072),
    "gemma-3-1b qkv": (1152, 1536), "gemma-3-1b o_proj": (1024, 1152), "gemma-3-1b down_proj": (6912, 1152),
}


GROUPED_PROJECTIONS = {  # (K, N of a group, groups) of the grouped decode GEMMs
    "deepseek-v4-flash o_a_proj": (4096, 1024, 8),
}


def benchmark_case(rows: int, dtype: torch.dtype, device, *, l2_bytes: int = 50 * 2**20) -> dict:
    """The presets' projections at ``rows`` decode tokens, each call reading its weight from HBM as a decode step
    does (a layer's weights are read once per step): successive calls take successive copies of the weight, enough
    of them to fill the L2 four times over. Not compiled: torch.compile of one F.linear is the same cuBLAS call."""
    gen = torch.Generator(device=device).manual_seed(rows)
    cases = {}
    shapes = {**{label: (k, n, 1) for label, (k, n) in PROJECTIONS.items()}, **GROUPED_PROJECTIONS}
    for label, (k, n, groups) in shapes.items():
        x = torch.randn(rows, *((groups,) if groups > 1 else ()), k, generator=gen, device=device, dtype=dtype)
        weight = torch.randn(groups * n, k, generator=gen, device=device, dtype=dtype) / k**0.5
        copies = [weight] + [weight.clone() for _ in range(-(-4 * l2_bytes // weight.nbytes) - 1)]
        turn = [0]

        def next_copy(copies=copies, turn=turn) -> torch.Tensor:
            turn[0] = (turn[0] + 1) % len(copies)
            return copies[turn[0]]

        cases[f"linear {label}"] = {
            "fused": (lambda x=x, copy=next_copy, groups=groups: grouped_linear(x, copy(), groups)) if groups > 1
            else (lambda x=x, copy=next_copy: linear(x, copy())),
            "eager": (lambda x=x, copy=next_copy, groups=groups: grouped_linear_reference(x, copy(), groups))
            if groups > 1 else (lambda x=x, copy=next_copy: linear_reference(x, copy())),
            "compile": False,
            "bytes": (rows * groups * k + groups * n * k + rows * groups * n) * dtype.itemsize,
            "flops": 2 * rows * groups * k * n,
        }
    return cases
