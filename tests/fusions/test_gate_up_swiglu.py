"""gate_up_swiglu against a float64 reference: every tile configuration, masked edges, leading dims, dtypes.

CPU cases run the kernel under the Triton interpreter at small shapes; CUDA cases use the presets' shapes.
"""

import pytest
import torch

from optiq.fusions.gate_up_swiglu import (
    _tile_config,
    benchmark_case,
    gate_up_swiglu,
    gate_up_swiglu_reference,
    interleave_gate_up,
)
from kernel_testing import CUDA, OPCHECKS, assert_graph_replay_and_compile, needs_cuda

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def make_inputs(seed, leading, hidden, intermediate, dtype, device):
    """x [*leading, H] and nn.Linear-scaled gate and up weights [I, H], never zeros."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*leading, hidden, generator=generator, device=device).to(dtype)
    w_gate, w_up = (torch.randn(intermediate, hidden, generator=generator, device=device).div(hidden**0.5).to(dtype)
                    for _ in range(2))
    return x, w_gate, w_up


def check(seed, leading, hidden, intermediate, dtype, device, activation="silu"):
    x, w_gate, w_up = make_inputs(seed, leading, hidden, intermediate, dtype, device)
    out = gate_up_swiglu(x, interleave_gate_up(w_gate, w_up), activation)
    assert out.shape == (*leading, intermediate) and out.dtype == dtype
    assert torch.isfinite(out).all(), "an output element was left unwritten"
    expected = gate_up_swiglu_reference(x.double(), w_gate.double(), w_up.double(), activation)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("leading, hidden, intermediate", [
    ((1,), 64, 96),        # one decode row, BLOCK_M 16
    ((3,), 80, 56),        # hidden and intermediate not multiples of their tiles
    ((2, 9), 64, 40),      # leading dims flattened to 18 rows: BLOCK_M 64
    ((70,), 48, 24),       # BLOCK_M 128, BLOCK_K 64 (hidden 48 masked)
])
def test_shapes_cpu(leading, hidden, intermediate):
    check(seed=hidden + intermediate + len(leading), leading=leading, hidden=hidden, intermediate=intermediate,
          dtype=torch.float32, device="cpu")


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_cpu(dtype):
    check(seed=5 if dtype == torch.bfloat16 else 6, leading=(5,), hidden=64, intermediate=48, dtype=dtype,
          device="cpu")


@pytest.mark.usefixtures("poisoned_empty")
def test_gelu_tanh_cpu():
    """GeGLU's gate (Gemma): checked against its own reference, and the silu one rejects it."""
    check(seed=7, leading=(3,), hidden=80, intermediate=56, dtype=torch.float32, device="cpu", activation="gelu_tanh")
    with pytest.raises(AssertionError):
        x, w_gate, w_up = make_inputs(7, (3,), 80, 56, torch.float32, "cpu")
        torch.testing.assert_close(gate_up_swiglu(x, interleave_gate_up(w_gate, w_up), "gelu_tanh").double(),
                                   gate_up_swiglu_reference(x.double(), w_gate.double(), w_up.double()))


def test_interleave_layout():
    w_gate = torch.arange(12.0).view(3, 4)
    w_up = -w_gate - 1
    w = interleave_gate_up(w_gate, w_up)
    assert w.shape == (6, 4) and w.is_contiguous()
    assert torch.equal(w[0::2], w_gate) and torch.equal(w[1::2], w_up)


def test_wrong_inputs_fail_cpu():
    """The comparison can fail: gate and up swapped in the interleaved weight give another answer."""
    x, w_gate, w_up = make_inputs(7, (3,), 32, 40, torch.float32, "cpu")
    out = gate_up_swiglu(x, interleave_gate_up(w_up, w_gate))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out.double(), gate_up_swiglu_reference(x.double(), w_gate.double(), w_up.double()),
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        gate_up_swiglu(x, interleave_gate_up(w_gate, w_up)[:, :-1])


def test_tile_config_fills_the_gpu():
    """Every H200 SM gets a program at every decode row count of the dense presets' MLPs."""
    for intermediate in (3072, 8192, 14336):
        for rows in (1, 16, 17, 64, 65, 256):
            config = _tile_config(rows, intermediate)
            programs = -(-rows // config["BLOCK_M"]) * -(-intermediate // config["BLOCK_N"])
            assert programs >= 132, (intermediate, rows, config)


def test_custom_op_registration():
    device = "cuda" if CUDA else "cpu"
    x, w_gate, w_up = make_inputs(8, (2,), 32, 24, torch.float32, device)
    for activation in (0, 1):  # silu, gelu_tanh
        torch.library.opcheck(torch.ops.optiq.gate_up_swiglu.default, (x, interleave_gate_up(w_gate, w_up), activation),
                              **OPCHECKS)


PRESETS = {"qwen3-0.6b": (1024, 3072), "llama-3.2-1b": (2048, 8192), "llama-3.1-8b": (4096, 14336)}


@needs_cuda
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("rows", [1, 16, 37, 64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_presets_cuda(preset, rows, dtype):
    hidden, intermediate = PRESETS[preset]
    check(seed=rows + hidden, leading=(rows,), hidden=hidden, intermediate=intermediate, dtype=dtype, device="cuda")


@needs_cuda
def test_fp32_and_benchmark_case_cuda():
    """fp32 uses an IEEE dot (no tf32), and the benchmark's two callables agree."""
    check(seed=3, leading=(16,), hidden=4096, intermediate=1024, dtype=torch.float32, device="cuda")
    case = benchmark_case(16, torch.bfloat16, "cuda")
    torch.testing.assert_close(case["fused"](), case["eager"](), rtol=2e-2, atol=2e-2)


@needs_cuda
def test_cuda_graph_and_compile_cuda():
    x, w_gate, w_up = make_inputs(9, (4,), 4096, 14336, torch.bfloat16, "cuda")
    w_gate_up = interleave_gate_up(w_gate, w_up)
    assert_graph_replay_and_compile(lambda: gate_up_swiglu(x, w_gate_up), lambda: x.copy_(torch.randn_like(x)))
