"""Gate and up projections as one GEMM with SwiGLU in the epilogue: `silu(x @ w_gate.T) * (x @ w_up.T)`.

Eager HF (LlamaMLP without down_proj) runs two GEMMs that each write an [M, I] tensor, then silu and a multiply that
read them back. Here the gate and up weights are interleaved row by row once, at patch time, into one [2I, H] matrix:
a weight tile of 2*BLOCK_N rows holds the gate and up rows of BLOCK_N output columns, so a single tl.dot gives both
and the epilogue pairs them up in registers; the only tensor written is the [M, I] result. Row-by-row interleaving
(rather than in blocks of BLOCK_N) keeps the weight layout independent of the tile size, so the tile can follow M.
"""

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from optiq.fusions.activation import activation_index, activation_reference, gated_activation
from optiq.fusions.launch import launch_options, prefetch_options, prefetch_rows, wait_for_predecessor


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """[I, H] gate and up weights (nn.Linear layout) -> [2I, H] with row 2j = gate row j, row 2j + 1 = up row j."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} weights differ in shape")
    return torch.stack((w_gate, w_up), dim=1).reshape(2 * w_gate.shape[0], w_gate.shape[1]).contiguous()


@triton.jit
def dot_accumulate(a, b, acc, FP32_DOT: tl.constexpr):
    """acc + a @ b; in IEEE fp32 when FP32_DOT: fp32 models (no tf32 rounding), and the interpreter, whose bf16/fp16
    dot is wrong."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def stream_dot(x_ptr, w_ptr, rows, w_rows, M, W_ROWS, K, stride_xm, stride_xk, stride_wn, stride_wk,
               BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
    """x[rows] @ w[w_rows].T [BLOCK_M, BLOCK_W] over all of K, accumulated in fp32: the K loop of a decode GEMM,
    whose cost is streaming w's rows (rows past M and w rows past W_ROWS read as zeros)."""
    cols_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols_k[None, :] * stride_xk
    w_ptrs = w_ptr + w_rows[None, :].to(tl.int64) * stride_wn + cols_k[:, None] * stride_wk
    row_mask = rows[:, None] < M
    w_mask = w_rows[None, :] < W_ROWS
    acc = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = cols_k + k0 < K
        x = tl.load(x_ptrs, mask=row_mask & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=w_mask & k_mask[:, None], other=0.0)
        acc = dot_accumulate(x, w, acc, FP32_DOT)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc


def fp32_dot(dtype: torch.dtype) -> bool:
    """dot_accumulate's FP32_DOT for inputs of ``dtype``: fp32 inputs, or any under the interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1" or dtype == torch.float32


@triton.jit
def _gate_up_gemm_swiglu_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
    ACTIVATION: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr,
):
    """Output tile [BLOCK_M, BLOCK_N] of act(gate) * up; its weight tile is 2 * BLOCK_N interleaved rows.

    Program ids run over M fastest, so the M tiles that share a weight tile run together and share it through L2.
    """
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % num_m_tiles
    pid_n = tl.program_id(0) // num_m_tiles
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    w_rows = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
    prefetch_rows(w_ptr, w_rows, 2 * N, K, stride_wn, stride_wk, PREFETCH_LINES, LINE)
    wait_for_predecessor(USE_PDL)
    acc = stream_dot(x_ptr, w_ptr, rows, w_rows, M, 2 * N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                     BLOCK_M, 2 * BLOCK_N, BLOCK_K, FP32_DOT)
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    out = gated_activation(gate, ACTIVATION) * up
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _tile_config(rows: int, intermediate: int) -> dict:
    """Tiles from the shapes (the interpreter cannot autotune).

    Decode rows are few, so the weight stream is the cost. The M tile is the smallest the tensor cores take that
    covers the rows (16 rows per mma; 64 for a Hopper warpgroup; 128 past 64 rows, to re-read the weight less). The
    N tile is the widest that still gives every H200 SM (132) a program, as each program re-reads x through L2.
    """
    block_m = 16 if rows <= 16 else 64 if rows <= 64 else 128
    m_tiles = triton.cdiv(rows, block_m)
    block_n = next((n for n in (64, 32) if m_tiles * triton.cdiv(intermediate, n) >= 132), 16)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128 if block_m <= 64 else 64,
                num_warps=4 if block_m <= 64 else 8, num_stages=4 if block_m <= 16 else 3)


@torch.library.triton_op("optiq::gate_up_swiglu", mutates_args=())
def _gate_up_swiglu_op(x: torch.Tensor, w_gate_up: torch.Tensor, activation: int) -> torch.Tensor:
    hidden = x.shape[-1]
    intermediate = w_gate_up.shape[0] // 2
    x2d = x.reshape(-1, hidden)
    rows = x2d.shape[0]
    out = torch.empty((*x.shape[:-1], intermediate), dtype=x.dtype, device=x.device)
    out2d = out.view(rows, intermediate)
    config = _tile_config(rows, intermediate)
    grid = (triton.cdiv(rows, config["BLOCK_M"]) * triton.cdiv(intermediate, config["BLOCK_N"]),)
    launch = launch_options(x)
    torch.library.wrap_triton(_gate_up_gemm_swiglu_kernel)[grid](
        x2d, w_gate_up, out2d, rows, intermediate, hidden,
        *x2d.stride(), *w_gate_up.stride(), *out2d.stride(),
        FP32_DOT=fp32_dot(x.dtype), ACTIVATION=activation, **config, **launch,
        **prefetch_options(launch, 2 * config["BLOCK_N"], hidden, w_gate_up.element_size()),
    )
    return out


def gate_up_swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x [..., H], w_gate_up [2I, H] from interleave_gate_up -> act(gate) * up [..., I], in x's dtype (act: silu,
    or gelu_tanh for GeGLU).

    Accumulates and applies SwiGLU in fp32, rounding once at the end (eager rounds gate and up to the model dtype).
    """
    if w_gate_up.shape[0] % 2 or w_gate_up.shape[1] != x.shape[-1]:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} is not [2I, {x.shape[-1]}]")
    return torch.ops.optiq.gate_up_swiglu(x, w_gate_up, activation_index(activation))


def gate_up_swiglu_reference(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                             activation: str = "silu") -> torch.Tensor:
    """HF LlamaMLP (GemmaMLP for gelu_tanh) up to down_proj, in x's dtype."""
    return activation_reference(F.linear(x, w_gate), activation) * F.linear(x, w_up)


def benchmark_case(rows: int, dtype: torch.dtype, device, *, hidden: int = 4096, intermediate: int = 14336) -> dict:
    """llama-3.1-8b MLP gate/up at `rows` decode tokens (other presets through hidden and intermediate)."""
    gen = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen, device=device, dtype=dtype)
    w_gate, w_up = (torch.randn(intermediate, hidden, generator=gen, device=device, dtype=dtype) / hidden**0.5
                    for _ in range(2))
    w_gate_up = interleave_gate_up(w_gate, w_up)
    size = dtype.itemsize
    return {
        "fused": lambda: gate_up_swiglu(x, w_gate_up),
        "eager": lambda: gate_up_swiglu_reference(x, w_gate, w_up),
        "bytes": (rows * hidden + 2 * intermediate * hidden + rows * intermediate) * size,
        "flops": 2 * rows * hidden * 2 * intermediate + 5 * rows * intermediate,  # two GEMMs; silu (4) and the product
    }
