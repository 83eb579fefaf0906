"""The MLP block (RMSNorm, gate/up, SwiGLU, down, residual add) against HF's op sequence in float64."""

import pytest
import torch

from fusions.gate_up_swiglu import fold_norm_weight, interleave_gate_up
from fusions.residual_mlp import benchmark_case, residual_mlp, residual_mlp_reference
from kernel_testing import SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda, seed_of, within_one_bf16_rounding

# An output near zero is the difference of summands of a few units, each rounded to bf16 (half an ulp at 4: 0.016).
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2)}


def make_inputs(seed, rows, hidden, intermediate, dtype, device):
    """h at a residual stream's scale, a norm weight that is not all ones, nn.Linear-scaled weights."""
    gen = torch.Generator().manual_seed(seed)
    tensors = (4 * torch.randn(rows, hidden, generator=gen), 1 + 0.2 * torch.randn(hidden, generator=gen),
               torch.randn(intermediate, hidden, generator=gen) / hidden**0.5,
               torch.randn(intermediate, hidden, generator=gen) / hidden**0.5,
               torch.randn(hidden, intermediate, generator=gen) / intermediate**0.5)
    return [t.to(device=device, dtype=dtype) for t in tensors]


def fused(h, norm_weight, w_gate, w_up, w_down, eps=1e-6):
    return residual_mlp(h, eps, fold_norm_weight(interleave_gate_up(w_gate, w_up), norm_weight), w_down)


def check(h, norm_weight, w_gate, w_up, w_down, eps=1e-6, against_eager=False):
    """Against HF's function in float64; ``against_eager``: also about as accurate as HF's own op sequence in h's
    dtype (the folded norm weight is rounded once where HF rounds the normalised activations twice). On the GPU only:
    the interpreter rounds bf16 by truncation."""
    got = fused(h, norm_weight, w_gate, w_up, w_down, eps)
    want = residual_mlp_reference(*(t.double() for t in (h, norm_weight)), eps,
                                  *(t.double() for t in (w_gate, w_up, w_down)))
    assert got.shape == h.shape and got.dtype == h.dtype
    rtol, atol = TOLERANCES[h.dtype]
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
    if against_eager:
        eager = residual_mlp_reference(h, norm_weight, eps, w_gate, w_up, w_down)
        assert (got.double() - want).norm() <= 1.25 * (eager.double() - want).norm()


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("rows, hidden, intermediate", [(1, 64, 96), (5, 80, 56), (19, 64, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf(request, rows, hidden, intermediate, dtype):
    check(*make_inputs(seed_of(request), rows, hidden, intermediate, dtype, SMALL_DEVICE))


def test_the_comparison_can_fail(request):
    """gate and up swapped, or the down weight of another layer, give another answer."""
    h, norm_weight, w_gate, w_up, w_down = make_inputs(seed_of(request), 3, 64, 48, torch.float32, SMALL_DEVICE)
    for wrong in ((h, norm_weight, w_up, w_gate, w_down), (h, norm_weight, w_gate, w_up, w_down.roll(1, 0)),
                  (h, torch.ones_like(norm_weight), w_gate, w_up, w_down)):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(fused(*wrong), residual_mlp_reference(h, norm_weight, 1e-6, w_gate, w_up,
                                                                             w_down))
    with pytest.raises(ValueError):
        residual_mlp(h, 1e-6, interleave_gate_up(w_gate, w_up), w_down[:, :-1])


PRESETS = {"qwen3-0.6b": (1024, 3072), "llama-3.1-8b": (4096, 14336)}


@needs_cuda
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_presets_cuda(preset, rows):
    check(*make_inputs(rows, rows, *PRESETS[preset], torch.bfloat16, "cuda"), against_eager=True)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 64])
def test_cuda_graph_and_compile_cuda(rows):
    h, norm_weight, w_gate, w_up, w_down = make_inputs(rows, rows, 1024, 3072, torch.bfloat16, "cuda")
    w_gate_up = fold_norm_weight(interleave_gate_up(w_gate, w_up), norm_weight)
    assert_graph_replay_and_compile(lambda: residual_mlp(h, 1e-6, w_gate_up, w_down),
                                    lambda: h.copy_(torch.randn_like(h)), same_compiled=within_one_bf16_rounding)


@needs_cuda
def test_benchmark_case_cuda():
    case = benchmark_case(16, torch.bfloat16, "cuda", hidden=1024, intermediate=3072)
    torch.testing.assert_close(case["fused"](), case["eager"](), rtol=2e-2, atol=5e-2)
