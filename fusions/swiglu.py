"""SwiGLU: act(gate) * up from one merged [..., 2I] projection (gate = first half, up = second half), act silu or
GeGLU's gelu_tanh (optiq.fusions.activation).

One launch instead of eager's two (silu, then mul) and no [..., I] intermediate in memory. It rounds where
eager rounds: act(gate) to the model dtype first, then the product, so bf16 results match F.silu(gate) * up.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from optiq.fusions.activation import activation_index, activation_reference, gated_activation
from optiq.fusions.launch import launch_options, wait_for_predecessor
from optiq.fusions.rmsnorm import as_rows

COLUMNS_PER_PROGRAM = 1024  # output columns per program: 8 bf16 (16 bytes) per thread at 4 warps


@triton.jit
def _swiglu_kernel(gate_up_ptr, gate_up_row_stride, out_ptr, out_row_stride, inter, BLOCK: tl.constexpr,
                   ACTIVATION: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row_start = gate_up_ptr + row * gate_up_row_stride
    gate = tl.load(row_start + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_start + inter + cols, mask=mask, other=0.0).to(tl.float32)
    activation = gated_activation(gate, ACTIVATION).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (activation * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton_op("optiq::swiglu", mutates_args=("out",))
def _swiglu_op(gate_up: torch.Tensor, out: torch.Tensor, activation: int) -> None:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"last dim {gate_up.shape[-1]} of gate_up must be even (gate then up)")
    inter = gate_up.shape[-1] // 2
    rows = as_rows(gate_up)
    out_rows = out.view(-1, inter)  # view, never a copy: the kernel must write into `out` itself
    block = min(COLUMNS_PER_PROGRAM, triton.next_power_of_2(inter))
    grid = (rows.shape[0], triton.cdiv(inter, block))
    wrap_triton(_swiglu_kernel)[grid](
        rows, rows.stride(0), out_rows, out_rows.stride(0), inter, BLOCK=block, ACTIVATION=activation, num_warps=4,
        **launch_options(rows),
    )


def swiglu(gate_up: torch.Tensor, out: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """act(gate_up[..., :I]) * gate_up[..., I:] as [..., I] in gate_up's dtype; returns out (new if None)."""
    kind = activation_index(activation)
    if out is None:
        out = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype, device=gate_up.device)
    torch.ops.optiq.swiglu(gate_up, out, kind)
    return out


def swiglu_reference(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The eager sequence, in gate_up's dtype (float64 inputs give a float64 reference)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return activation_reference(gate, activation) * up


def benchmark_case(rows: int, dtype: torch.dtype, device) -> dict:
    """llama-3.1-8b: intermediate 14336, so the merged gate_up input is [rows, 28672]."""
    inter = 14336
    gate_up = torch.randn(rows, 2 * inter, dtype=dtype, device=device)
    return {
        "fused": lambda: swiglu(gate_up),
        "eager": lambda: swiglu_reference(gate_up),
        "bytes": 3 * rows * inter * gate_up.element_size(),  # read gate and up, write the product
        "flops": 5 * rows * inter,  # sigmoid as exp, add, divide; times gate; times up
    }
