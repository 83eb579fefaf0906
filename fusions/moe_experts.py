"""MoE experts for decode: grouped GEMMs over the routed experts, SwiGLU in the first one's epilogue.

HF's MoE block hands the experts module the tokens [T, H], each token's k expert ids and routing weights; the weights
are two 3-D parameters, gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I]. Here:

1. Packing (one small kernel, fixed shapes, no host sync): the T*k (token, choice) slots are counted per expert (a
   histogram), placed by a prefix sum and a per-expert running rank (a stable counting sort) and turned into tiles,
   so each expert's slots are contiguous and padded only to the M tile of its last rows. (As torch ops this is a
   radix sort, a scatter-add and three scans: ten launches, a third of the op's time at one token.)
2. Gate/up GEMM: a program owns BLOCK_M packed slots of one expert and BLOCK_N columns of the intermediate. Its
   weight tile is the expert's BLOCK_N gate rows followed by the matching BLOCK_N up rows, loaded as one
   [2*BLOCK_N, K] tile, so a single tl.dot gives gate and up side by side and SwiGLU pairs them in registers. (The
   weights are read where they lie: interleaving them would copy 39 GB on Qwen3-30B-A3B.)
3. Down GEMM: the same tiling over the packed activations; the epilogue scales each row by its routing weight and
   writes it (fp32) to the slot's own row.
4. A token's k slot rows are summed in choice order and rounded once (one small kernel: deterministic, no atomics,
   and the same bits eager, compiled or replayed from a CUDA graph).

The grid is sized from shapes alone (every tile an expert could need: cdiv(T*k, BLOCK_M) + min(E, T*k)); programs
past the last real tile find no rows and store nothing, so the op captures into a CUDA graph.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from optiq.fusions.gate_up_swiglu import dot_accumulate, fp32_dot
from optiq.fusions.launch import launch_options, wait_for_predecessor


@triton.jit
def _expert_tile(pid, tile_end_ptr, expert_start_ptr, counts_ptr, num_experts,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, packed row indices, row mask) of tile ``pid``; an all-false mask past the last tile."""
    experts = tl.arange(0, BLOCK_E)
    ends = tl.load(tile_end_ptr + experts, mask=experts < num_experts, other=2**30)
    owner = tl.sum((ends <= pid).to(tl.int32), axis=0)  # the first expert whose tiles reach past pid
    expert = tl.minimum(owner, num_experts - 1)
    count = tl.load(counts_ptr + expert)
    first_tile = tl.load(tile_end_ptr + expert) - tl.cdiv(count, BLOCK_M)
    offsets = (pid - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(expert_start_ptr + expert) + offsets
    return expert.to(tl.int64), rows, offsets < tl.where(owner < num_experts, count, 0)


@triton.jit
def _experts_gate_up_kernel(
    x_ptr, order_ptr, tile_end_ptr, expert_start_ptr, counts_ptr, w_ptr, act_ptr,
    top_k, num_experts, N, K, limit,
    stride_xm, stride_we, stride_wn, stride_wk, stride_am,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    FP32_DOT: tl.constexpr, CLAMP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """act[packed rows, BLOCK_N columns] = silu(x @ gate.T) * (x @ up.T) for one expert's tile of slots, with CLAMP
    the gate clamped from above and up on both sides at ``limit`` first."""
    wait_for_predecessor(USE_PDL)
    expert, rows, row_mask = _expert_tile(tl.program_id(0), tile_end_ptr, expert_start_ptr, counts_ptr, num_experts,
                                          BLOCK_M, BLOCK_E)
    tokens = tl.load(order_ptr + rows, mask=row_mask, other=0) // top_k
    j = tl.arange(0, 2 * BLOCK_N)
    cols = tl.program_id(1) * BLOCK_N + j % BLOCK_N
    w_rows = tl.where(j < BLOCK_N, cols, N + cols)  # gate rows, then the same columns' up rows
    cols_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None].to(tl.int64) * stride_xm + cols_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + w_rows[None, :].to(tl.int64) * stride_wn + cols_k[:, None] * stride_wk
    w_mask = cols[None, :] < tl.where(tl.max(row_mask.to(tl.int32), axis=0) > 0, N, 0)  # idle tiles read no weights

    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = cols_k + k0 < K
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=w_mask & k_mask[:, None], other=0.0)
        acc = dot_accumulate(x, w, acc, FP32_DOT)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    out = gate * tl.sigmoid(gate) * up
    out_cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    act_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_am + out_cols[None, :]
    tl.store(act_ptrs, out.to(act_ptr.dtype.element_ty), mask=row_mask[:, None] & (out_cols[None, :] < N))


@triton.jit
def _experts_down_kernel(
    act_ptr, order_ptr, routing_ptr, tile_end_ptr, expert_start_ptr, counts_ptr, w_ptr, out_ptr,
    num_experts, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    FP32_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[slot, BLOCK_N columns] = routing weight * (act @ down.T) for one expert's tile of packed slots."""
    wait_for_predecessor(USE_PDL)
    expert, rows, row_mask = _expert_tile(tl.program_id(0), tile_end_ptr, expert_start_ptr, counts_ptr, num_experts,
                                          BLOCK_M, BLOCK_E)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_am + cols_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + cols_k[:, None] * stride_wk
    w_mask = cols[None, :] < tl.where(tl.max(row_mask.to(tl.int32), axis=0) > 0, N, 0)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = cols_k + k0 < K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=w_mask & k_mask[:, None], other=0.0)
        acc = dot_accumulate(a, w, acc, FP32_DOT)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    slots = tl.load(order_ptr + rows, mask=row_mask, other=0)
    routing = tl.load(routing_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + slots[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc * routing[:, None], mask=row_mask[:, None] & (cols[None, :] < N))


@triton.jit
def _experts_sum_choices_kernel(per_slot_ptr, out_ptr, top_k, N, stride_s, stride_o, BLOCK_N: tl.constexpr,
                                USE_PDL: tl.constexpr):
    """out[token, BLOCK_N columns] = sum over its k slots, in choice order, rounded once."""
    wait_for_predecessor(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for choice in range(top_k):
        acc += tl.load(per_slot_ptr + (token * top_k + choice) * stride_s + cols, mask=cols < N, other=0.0)
    tl.store(out_ptr + token * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)


# Programs a grouped GEMM should have in flight to keep an H100/H200's HBM busy (132 SMs x ~4).
_PROGRAMS_IN_FLIGHT = 512


TILE_GRID = [dict(BLOCK_N=n, BLOCK_K=k, num_stages=s) for n in (16, 32, 64) for k in (64, 128) for s in (3, 4)]


def tile_config(slots: int, experts: int, n: int) -> dict:
    """Tiles from the shapes (the interpreter cannot autotune): decode gives each expert a few slots, so the M tile
    is the smallest the tensor cores take and the weight stream is the cost; the N tile shrinks until the experts
    in use (at least min(E, slots) tiles) give enough programs to stream the weights in parallel."""
    block_m = 16 if slots <= 256 else 32
    busy = min(experts, slots)
    block_n = next(b for b in (64, 32, 16) if busy * triton.cdiv(n, b) >= _PROGRAMS_IN_FLIGHT or b == 16)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, num_warps=4, num_stages=3)


@triton.jit
def _experts_pack_kernel(ids_ptr, order_ptr, counts_ptr, start_ptr, tile_end_ptr, S, E,
                         BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """One program: per-expert counts, starts and tile ends, and order[start[e] + rank] = slot for each slot, rank
    being how many earlier slots chose the same expert. Slots are visited CHUNK at a time as one-hot rows."""
    wait_for_predecessor(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for s0 in range(0, S, CHUNK):
        slots = s0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + slots, mask=slots < S, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    tl.store(counts_ptr + experts, counts, mask=experts < E)
    tl.store(start_ptr + experts, starts, mask=experts < E)
    tl.store(tile_end_ptr + experts, tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, axis=0), mask=experts < E)
    placed = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for s0 in range(0, S, CHUNK):
        slots = s0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + slots, mask=slots < S, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot + placed[None, :]
        position = tl.sum(onehot * (starts[None, :] + rank), axis=1)
        tl.store(order_ptr + position, slots, mask=slots < S)
        placed += tl.sum(onehot, axis=0)


def pack_by_expert(top_k_index: torch.Tensor, num_experts: int, block_m: int):
    """(order, counts, expert_start, tile_end): the slots (token * k + choice) sorted by expert, stably, the slots per
    expert, where each expert's slots start in that order, and the running count of M tiles; all on the device."""
    flat = top_k_index.reshape(-1).contiguous()
    order = torch.empty(flat.numel(), dtype=torch.int32, device=flat.device)
    counts, expert_start, tile_end = (torch.empty(num_experts, dtype=torch.int32, device=flat.device) for _ in range(3))
    torch.library.wrap_triton(_experts_pack_kernel)[(1,)](
        flat, order, counts, expert_start, tile_end, flat.numel(), num_experts,
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=32, num_warps=4,
        **launch_options(flat),
    )
    return order, counts, expert_start, tile_end


@torch.library.triton_op("optiq::moe_experts", mutates_args=())
def _moe_experts_op(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    w_gate_up: torch.Tensor, w_down: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    tokens, hidden = x.shape
    top_k = top_k_index.shape[1]
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    slots = tokens * top_k
    gate_up = tile_config(slots, num_experts, inter)
    down = tile_config(slots, num_experts, hidden)
    block_m = gate_up["BLOCK_M"]
    order, counts, expert_start, tile_end = pack_by_expert(top_k_index, num_experts, block_m)
    max_tiles = triton.cdiv(slots, block_m) + min(num_experts, slots)
    x = x.contiguous()
    act = torch.empty((slots, inter), dtype=x.dtype, device=x.device)
    per_slot = torch.empty((slots, hidden), dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    routing = top_k_weights.reshape(-1).contiguous()
    common = dict(BLOCK_E=triton.next_power_of_2(num_experts),
                  FP32_DOT=fp32_dot(x.dtype))
    torch.library.wrap_triton(_experts_gate_up_kernel)[(max_tiles, triton.cdiv(inter, gate_up["BLOCK_N"]))](
        x, order, tile_end, expert_start, counts, w_gate_up, act,
        top_k, num_experts, inter, hidden, 0.0 if limit is None else limit,
        x.stride(0), *w_gate_up.stride(), act.stride(0), **common, **gate_up, CLAMP=limit is not None,
        **launch_options(x),
    )
    torch.library.wrap_triton(_experts_down_kernel)[(max_tiles, triton.cdiv(hidden, down["BLOCK_N"]))](
        act, order, routing, tile_end, expert_start, counts, w_down, per_slot,
        num_experts, hidden, inter,
        act.stride(0), *w_down.stride(), per_slot.stride(0), **common, **down, **launch_options(x),
    )
    torch.library.wrap_triton(_experts_sum_choices_kernel)[(tokens, triton.cdiv(hidden, 256))](
        per_slot, out, top_k, hidden, per_slot.stride(0), out.stride(0), BLOCK_N=256, **launch_options(x),
    )
    return out


def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """x [T, H]; top_k_index, top_k_weights [T, k]; w_gate_up [E, 2I, H] (gate rows, then up rows) and w_down
    [E, H, I] as transformers stores them -> [T, H] in x's dtype: sum over each token's k experts of
    weight * down(silu(gate(x)) * up(x)), accumulated in fp32 and rounded once. With ``limit`` (DeepSeek-V4's
    swiglu_limit), gate(x) is clamped to at most limit and up(x) to [-limit, limit] before the SwiGLU."""
    num_experts, two_inter, hidden = w_gate_up.shape
    if two_inter % 2 or x.shape[-1] != hidden or tuple(w_down.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} do not fit x "
                         f"{tuple(x.shape)}: need [E, 2I, H] and [E, H, I]")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} "
                         f"must both be [{x.shape[0]}, k]")
    return torch.ops.optiq.moe_experts(x, top_k_index, top_k_weights, w_gate_up, w_down, limit)


def moe_experts_reference(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          w_gate_up: torch.Tensor, w_down: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """transformers' eager experts loop, in x's dtype (float64 inputs give a float64 reference)."""
    out = torch.zeros_like(x)
    for expert in top_k_index.unique().tolist():
        token, choice = torch.where(top_k_index == expert)
        gate, up = F.linear(x[token], w_gate_up[expert]).chunk(2, dim=-1)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        y = F.linear(F.silu(gate) * up, w_down[expert]) * top_k_weights[token, choice, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def grouped_mm_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The peer: transformers' grouped path (sort the slots by expert, two torch._grouped_mm over the expert
    offsets, SwiGLU and the routing weights in between, sum per token), with no host sync, so it graph-captures."""
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w_gate_up.shape[0], dtype=torch.int32, device=flat.device)  # (bincount syncs with the host)
    offsets = torch.cumsum(counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)), 0).to(torch.int32)
    gate, up = torch._grouped_mm(x[order // top_k], w_gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=offsets)
    y = y * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(y).index_copy_(0, order, y).view(tokens, top_k, -1).sum(dim=1)


def benchmark_case(rows: int, dtype: torch.dtype, device, *, experts: int = 128, top_k: int = 8, hidden: int = 2048,
                   intermediate: int = 768) -> dict:
    """One Qwen3-30B-A3B MoE layer's experts at ``rows`` decode tokens, uniform random routing; "eager" is the
    grouped_mm path transformers takes on Hopper."""
    gen = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen, device=device, dtype=dtype)
    scores = torch.rand(rows, experts, generator=gen, device=device)
    top_k_weights, top_k_index = scores.topk(top_k, dim=-1)
    top_k_weights = (top_k_weights / top_k_weights.sum(-1, keepdim=True)).to(dtype)
    w_gate_up = torch.randn(experts, 2 * intermediate, hidden, generator=gen, device=device, dtype=dtype) / hidden**0.5
    w_down = torch.randn(experts, hidden, intermediate, generator=gen, device=device, dtype=dtype) / intermediate**0.5
    touched = top_k_index.unique().numel()
    return {
        "fused": lambda: moe_experts(x, top_k_index, top_k_weights, w_gate_up, w_down),
        "eager": lambda: grouped_mm_experts(x, top_k_index, top_k_weights, w_gate_up, w_down),
        "bytes": touched * 3 * intermediate * hidden * dtype.itemsize + 2 * rows * hidden * dtype.itemsize,
        "flops": 2 * rows * top_k * 3 * intermediate * hidden,
    }
