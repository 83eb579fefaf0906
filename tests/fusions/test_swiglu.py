"""SwiGLU kernel against the float64 reference, and bit-exact against eager bf16 on the GPU."""

import pytest
import torch

from optiq.fusions.swiglu import swiglu, swiglu_reference
from kernel_testing import SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda, seed_of

# bf16/fp16 round twice (silu, then the product); the interpreter truncates instead of rounding.
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 1e-2, "atol": 1e-2},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def make_input(shape, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(shape, generator=generator)).to(device=device, dtype=dtype)


def check(out, gate_up, activation="silu"):
    """out must be fully written and match the float64 reference within the dtype's tolerance."""
    assert not out.isnan().any(), "the kernel left poisoned elements unwritten"
    torch.testing.assert_close(out.double(), swiglu_reference(gate_up.double(), activation),
                               **TOLERANCE[gate_up.dtype])


def run_poisoned(gate_up, activation="silu"):
    shape = (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    out = torch.full(shape, float("nan"), dtype=gate_up.dtype, device=gate_up.device)
    assert swiglu(gate_up, out=out, activation=activation) is out
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 2 * 45), (1, 2 * 16), (2, 3, 2 * 80), (2, 2 * 1100)])
def test_matches_reference_small(request, shape, dtype):
    """Odd widths exercise the mask; 1100 > one program's 1024 columns exercises the column grid."""
    gate_up = make_input(shape, dtype, SMALL_DEVICE, seed_of(request))
    check(run_poisoned(gate_up), gate_up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_matches_reference_small(request, dtype):
    """GeGLU (Gemma's gelu_tanh gate); the silu reference does not pass for it."""
    gate_up = make_input((3, 2 * 45), dtype, SMALL_DEVICE, seed_of(request))
    out = run_poisoned(gate_up, "gelu_tanh")
    check(out, gate_up, "gelu_tanh")
    with pytest.raises(AssertionError):
        check(out, gate_up, "silu")


def test_strided_rows(request):
    """Rows that are a slice of wider rows (row stride > 2I) are read in place."""
    gate_up = make_input((3, 200), torch.float32, SMALL_DEVICE, seed_of(request))[:, :160]
    check(swiglu(gate_up), gate_up)


def test_swapped_halves_fail_the_check(request):
    """The comparison can fail: feeding [up, gate] instead of [gate, up] is caught."""
    gate_up = make_input((3, 2 * 45), torch.float32, SMALL_DEVICE, seed_of(request))
    gate, up = gate_up.chunk(2, dim=-1)
    with pytest.raises(AssertionError):
        check(swiglu(torch.cat([up, gate], dim=-1)), gate_up)


def test_rejects_odd_width():
    with pytest.raises(ValueError, match="must be even"):
        swiglu(torch.ones(2, 7))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
@pytest.mark.parametrize("inter", [768, 3072, 8192, 14336])
def test_matches_reference_cuda(request, inter, rows, dtype):
    gate_up = make_input((rows, 2 * inter), dtype, "cuda", seed_of(request))
    out = run_poisoned(gate_up)
    check(out, gate_up)
    # Rounding where eager rounds: equal to F.silu(gate) * up but for rare last-bit sigmoid differences.
    eager = swiglu_reference(gate_up)
    torch.testing.assert_close(out, eager, rtol=2**-7, atol=1e-6)
    assert (out != eager).float().mean() < 1e-3


@needs_cuda
def test_cuda_graph_and_compile(request):
    gate_up = make_input((16, 2 * 14336), torch.bfloat16, "cuda", seed_of(request))
    assert_graph_replay_and_compile(
        lambda: swiglu(gate_up),
        lambda: gate_up.copy_(make_input((16, 2 * 14336), torch.bfloat16, "cuda", seed_of(request) + 1)))
