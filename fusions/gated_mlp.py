"""The whole gated MLP of a decode step's few rows in one launch: down(act(x @ Wg.T) * (x @ Wu.T)) (+ bias)
(+ residual).

At one row each of the MLP's two kernels (gate_up_swiglu's GEMM, then the down projection's) pays a kernel's ramp,
tail and dependency wait beyond its bytes, and the down GEMM cannot start streaming its weight until the last gate/up
program has written the intermediate. Here program p owns slice p of the intermediate: it streams the 2S interleaved
gate/up rows of its S columns (interleave_gate_up's layout), applies the activation in registers, rounds as HF's
down_proj input is rounded, and at once multiplies those S values by the S matching columns of the down weight: a
partial sum of every output column over its slice (split-K over the intermediate, which never leaves the SM). No
program waits on another until the partials are written.

The partials are then added in program order, so the result does not depend on which program finished last: the last
REDUCERS programs to arrive each take a share of the output columns, wait until every program has arrived (a spin on
the arrival counter), add the partials, the bias and the residual, and round once. That wait needs every program of
the grid resident at once, so the grid is at most one program an SM (``slice_width``); under the Triton interpreter,
which runs programs one after another, a single reducer, the last program, finds every other arrived.

Past FUSED_ROWS rows the partials (programs x rows x hidden, fp32) would cost a sizeable share of the down weight's
own bytes, and the MLP runs as two kernels: gate_up_swiglu and the decode GEMM (linear) with the residual in its
epilogue.
"""

import os

import torch
import triton
import triton.language as tl

from optiq.fusions.activation import activation_index
from optiq.fusions.gate_up_swiglu import (dot_accumulate, fp32_dot, gate_up_swiglu, gate_up_swiglu_reference,
                                          gated_tile, interleave_gate_up)
from optiq.fusions.launch import (launch_options, multiprocessor_count, prefetch_options,
                                 shared_memory_per_multiprocessor)
from optiq.fusions.linear import linear, linear_reference, rotating_copies

FUSED_ROWS = 4  # rows up to which the MLP is one kernel (OPTIQ_MLP_FUSED_ROWS overrides it, 0 = never, to measure)
BLOCK_H = 128  # output columns a partial tile and a reducer's share hold
BLOCK_P = 32  # partials a reducer adds in one load


@triton.jit
def _gated_mlp_kernel(
    x_ptr, w_gate_up_ptr, w_down_ptr, b_ptr, r_ptr, out_ptr, partial_ptr, counters_ptr, M, H, I,
    stride_xm, stride_xk, stride_gn, stride_gk, stride_dn, stride_dk, stride_rm, stride_rn, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    REDUCERS: tl.constexpr, FP32_DOT: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr,
    LINE: tl.constexpr,
):
    """Program p: act(gate) * up for intermediate columns [p S, (p + 1) S) of every row (M <= BLOCK_M), times
    W_down[:, those columns].T into partial [p, M, H] (fp32); then, if among the last REDUCERS to arrive, the sum
    over every program's partial of its share of the output columns (BLOCK_H-wide chunks, every REDUCERS-th).
    ``counters_ptr`` holds the arrivals and the finished reducers, zero at launch and left zero."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_M)
    act = gated_tile(x_ptr, w_gate_up_ptr, rows, pid, M, I, H, stride_xm, stride_xk, stride_gn, stride_gk, BLOCK_M,
                     BLOCK_S, BLOCK_K, FP32_DOT, ACTIVATION, USE_PDL, PREFETCH_LINES, LINE)
    act = act.to(x_ptr.dtype.element_ty)  # down_proj's input, rounded as HF rounds it

    inner = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_H)
    down_ptrs = w_down_ptr + inner[:, None].to(tl.int64) * stride_dk + cols[None, :] * stride_dn  # W_down.T tiles
    partial_ptrs = partial_ptr + (pid * M + rows[:, None]).to(tl.int64) * H + cols[None, :]
    for h0 in range(0, H, BLOCK_H):
        in_h = cols + h0 < H
        w = tl.load(down_ptrs, mask=(inner[:, None] < I) & in_h[None, :], other=0.0)
        part = dot_accumulate(act, w, tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32), FP32_DOT)
        tl.store(partial_ptrs, part, mask=(rows[:, None] < M) & in_h[None, :])
        down_ptrs += BLOCK_H * stride_dn
        partial_ptrs += BLOCK_H

    tl.debug_barrier()  # every thread's partial is written before the arrival that publishes them
    reducer = tl.atomic_add(counters_ptr, 1, sem="acq_rel") - (programs - REDUCERS)
    if reducer >= 0:
        while tl.atomic_add(counters_ptr, 0, sem="acquire") < programs:
            pass
        offs_p = tl.arange(0, BLOCK_P)
        for chunk in range(reducer, tl.cdiv(H, BLOCK_H), REDUCERS):
            out_cols = chunk * BLOCK_H + cols
            in_h = out_cols < H
            for m in range(M):
                total = tl.zeros((BLOCK_H,), dtype=tl.float32)
                for p0 in range(0, programs, BLOCK_P):  # in program order: the same sum whoever reduces
                    owners = p0 + offs_p
                    tile = tl.load(partial_ptr + (owners[:, None] * M + m).to(tl.int64) * H + out_cols[None, :],
                                   mask=(owners[:, None] < programs) & in_h[None, :], other=0.0, cache_modifier=".cg")
                    total += tl.sum(tile, axis=0)
                if HAS_BIAS:
                    total += tl.load(b_ptr + out_cols, mask=in_h, other=0.0).to(tl.float32)
                if HAS_RESIDUAL:
                    total += tl.load(r_ptr + m * stride_rm + out_cols * stride_rn, mask=in_h, other=0.0).to(tl.float32)
                tl.store(out_ptr + m * stride_om + out_cols * stride_on, total.to(out_ptr.dtype.element_ty),
                         mask=in_h)
        if tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel") == REDUCERS - 1:  # every reducer is past its wait
            tl.atomic_xchg(counters_ptr + 1, 0)
            tl.atomic_xchg(counters_ptr, 0)


def fused_rows() -> int:
    return int(os.environ.get("OPTIQ_MLP_FUSED_ROWS", FUSED_ROWS))


def slice_width(intermediate: int, device: torch.device) -> int:
    """S, the intermediate columns a program owns: the narrowest power of two from 16 up that needs no more programs
    than the device has SMs (every program must be resident at once for the reducers' wait): 64 for Llama-3.2-1B's
    and Phi-3-mini's 8192 (128 programs on 132 SMs), 32 for qwen3-0.6b's 3072 (96), 128 for Llama-3.1-8B's 14336
    (112)."""
    width = 16
    while triton.cdiv(intermediate, width) > multiprocessor_count(device):
        width *= 2
    return width


def tile_config(intermediate: int, device: torch.device, itemsize: int = 2) -> dict:
    """One program an SM streams 2S gate/up rows, then S down columns in BLOCK_H-wide tiles: K tiles of 128 where
    three stages of both loops' tiles fit the SM's shared memory (64 where not: Llama-3.1-8B's S of 128), and as many
    stages as fit, up to four."""
    width = slice_width(intermediate, device)
    block_m = 16  # the tensor cores' smallest M, which covers every fused row
    budget = shared_memory_per_multiprocessor(device) - 1024

    def stage_bytes(block_k: int) -> int:
        return ((block_m + 2 * width) * block_k + width * BLOCK_H) * itemsize

    block_k = 128 if 3 * stage_bytes(128) <= budget else 64
    return dict(BLOCK_M=block_m, BLOCK_S=width, BLOCK_K=block_k, num_warps=4,
                num_stages=max(2, min(4, budget // stage_bytes(block_k))))


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def mlp_counters(device: torch.device) -> torch.Tensor:
    """The kernel's two counters on ``device`` (arrivals, finished reducers): zero once, left zero by every launch."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return _COUNTERS[device]


@torch.library.triton_op("optiq::gated_mlp", mutates_args={"counters"})
def _gated_mlp_op(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, counters: torch.Tensor,
                  bias: torch.Tensor | None, residual: torch.Tensor | None, activation: int) -> torch.Tensor:
    hidden, intermediate = w_down.shape
    x2d = x.reshape(-1, x.shape[-1])
    rows = x2d.shape[0]
    out = torch.empty((*x.shape[:-1], hidden), dtype=x.dtype, device=x.device)
    out2d = out.view(rows, hidden)
    r2d = residual.reshape(rows, hidden) if residual is not None else out2d
    config = tile_config(intermediate, x.device, x.element_size())
    programs = triton.cdiv(intermediate, config["BLOCK_S"])
    partials = torch.empty(programs * rows * hidden, dtype=torch.float32, device=x.device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    launch = launch_options(x, programs=programs)
    torch.library.wrap_triton(_gated_mlp_kernel)[(programs,)](
        x2d, w_gate_up, w_down, bias if bias is not None else w_down, r2d, out2d, partials, counters,
        rows, x.shape[-1], intermediate, *x2d.stride(), *w_gate_up.stride(), *w_down.stride(), *r2d.stride(),
        *out2d.stride(), HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, ACTIVATION=activation,
        BLOCK_H=BLOCK_H, BLOCK_P=BLOCK_P, REDUCERS=1 if interpreted else min(programs, triton.cdiv(hidden, BLOCK_H)),
        FP32_DOT=fp32_dot(x.dtype), **config, **launch,
        **prefetch_options(launch, 2 * config["BLOCK_S"], x.shape[-1], w_gate_up.element_size()),
    )
    return out


def gated_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """x [..., H], w_gate_up [2I, H] from interleave_gate_up, w_down [H, I] (nn.Linear's layout; its bias [H])
    -> down(act(gate) * up) (+ residual) [..., H] in x's dtype (act: silu, or gelu_tanh for GeGLU): one kernel up to
    FUSED_ROWS rows, gate_up_swiglu and the decode GEMM past them. The activation's output is rounded to x's dtype
    as HF's is; the down projection, bias and residual are summed in fp32 and rounded once."""
    hidden = x.shape[-1]
    if w_gate_up.dim() != 2 or w_gate_up.shape[0] % 2 or w_gate_up.shape[1] != hidden:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} is not [2I, {hidden}]")
    if w_down.shape != (hidden, w_gate_up.shape[0] // 2):
        raise ValueError(f"w_down {tuple(w_down.shape)} is not [{hidden}, {w_gate_up.shape[0] // 2}]")
    if bias is not None and bias.shape != (hidden,):
        raise ValueError(f"bias {tuple(bias.shape)} is not [{hidden}]")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} is not {tuple(x.shape)}")
    if x[..., 0].numel() > fused_rows():
        return linear(gate_up_swiglu(x, w_gate_up, activation), w_down, bias, residual)
    return torch.ops.optiq.gated_mlp(x, w_gate_up, w_down, mlp_counters(x.device), bias, residual,
                                     activation_index(activation))


def gated_mlp_reference(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                        activation: str = "silu") -> torch.Tensor:
    """HF's LlamaMLP (GemmaMLP for gelu_tanh), in x's dtype."""
    return linear_reference(gate_up_swiglu_reference(x, w_gate, w_up, activation), w_down)


MLPS = {  # (hidden, intermediate) of the presets' MLPs
    "llama-3.2-1b": (2048, 8192), "qwen3-0.6b": (1024, 3072), "llama-3.1-8b": (4096, 14336),
    "phi-3-mini": (3072, 8192), "gemma-3-1b": (1152, 6912),
}


def benchmark_case(rows: int, dtype: torch.dtype, device, *, l2_bytes: int = 50 * 2**20) -> dict:
    """The presets' MLPs at ``rows`` decode tokens, fused against HF's four kernels, each call reading its weights
    from HBM as a decode step does (``rotating_copies``)."""
    gen = torch.Generator(device=device).manual_seed(rows)
    cases = {}
    for label, (hidden, intermediate) in MLPS.items():
        x = torch.randn(rows, hidden, generator=gen, device=device, dtype=dtype)
        w_gate, w_up, w_down = (torch.randn(*shape, generator=gen, device=device, dtype=dtype) / shape[1]**0.5
                                for shape in ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate)))
        next_copy = rotating_copies((interleave_gate_up(w_gate, w_up), w_gate, w_up, w_down), l2_bytes)
        cases[f"gated_mlp {label}"] = {
            "fused": lambda x=x, copy=next_copy: (lambda w: gated_mlp(x, w[0], w[3]))(copy()),
            "eager": lambda x=x, copy=next_copy: (lambda w: gated_mlp_reference(x, w[1], w[2], w[3]))(copy()),
            "compile": False,
            "bytes": (2 * rows * hidden + 3 * intermediate * hidden) * dtype.itemsize,
            "flops": 2 * rows * hidden * 3 * intermediate,
        }
    return cases
