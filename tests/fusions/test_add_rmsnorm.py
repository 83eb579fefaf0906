"""Fused residual add + RMSNorm against the float64 reference: both outputs, inputs left untouched."""

import pytest
import torch

from optiq.fusions.add_rmsnorm import add_rmsnorm, add_rmsnorm_reference, norm_add_rmsnorm, norm_add_rmsnorm_reference
from kernel_testing import (NORM_KINDS, SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda,
                            seed_of)

# The sum is rounded to the model dtype, then the norm rounds twice; the interpreter truncates.
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 1e-2, "atol": 1e-2},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}
EPS = 1e-6


def make_inputs(shape, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    residual = torch.randn(shape, generator=generator)
    weight = 1.0 + 0.5 * torch.randn(shape[-1], generator=generator)
    return [t.to(device=device, dtype=dtype) for t in (x, residual, weight)]


def check(outputs, x, residual, weight, eps, offset, weight_first=False):
    """Both outputs must be fully written and match the float64 reference within the dtype's tolerance."""
    expected = add_rmsnorm_reference(x.double(), residual.double(), weight.double(), eps, offset, weight_first)
    for name, out, want in zip(("normed", "new_residual"), outputs, expected):
        assert not out.isnan().any(), f"the kernel left poisoned elements of {name} unwritten"
        torch.testing.assert_close(out.double(), want, **TOLERANCE[x.dtype], msg=lambda m: f"{name}: {m}")


def run_poisoned(x, residual, weight, eps, offset, weight_first=False):
    normed, new_residual = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    outputs = add_rmsnorm(x, residual, weight, eps, offset, normed=normed, new_residual=new_residual,
                          weight_first=weight_first)
    assert outputs[0] is normed and outputs[1] is new_residual
    return outputs


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 80), (1, 64), (2, 3, 48)])
def test_matches_reference_small(request, shape, dtype, offset):
    x, residual, weight = make_inputs(shape, dtype, SMALL_DEVICE, seed_of(request))
    inputs_before = [x.clone(), residual.clone(), weight.clone()]
    check(run_poisoned(x, residual, weight, EPS, offset), x, residual, weight, EPS, offset)
    for before, after in zip(inputs_before, (x, residual, weight)):
        assert torch.equal(before, after), "the op must not write its inputs"


def test_wrong_inputs_fail_the_check(request):
    """The comparison can fail: a different residual or a wrong eps is caught."""
    x, residual, weight = make_inputs((3, 80), torch.float32, SMALL_DEVICE, seed_of(request))
    with pytest.raises(AssertionError):
        check(add_rmsnorm(x, residual.flip(0), weight, EPS), x, residual, weight, EPS, False)
    with pytest.raises(AssertionError):
        check(add_rmsnorm(x, residual, weight, 1.0), x, residual, weight, EPS, False)


def test_rejects_mismatched_residual():
    with pytest.raises(ValueError, match="residual shape"):
        add_rmsnorm(torch.ones(2, 8), torch.ones(3, 8), torch.ones(8), EPS)


@needs_cuda
@NORM_KINDS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
@pytest.mark.parametrize("hidden", [1024, 2048, 4096])
def test_matches_reference_cuda(request, hidden, rows, dtype, offset, weight_first):
    x, residual, weight = make_inputs((rows, hidden), dtype, "cuda", seed_of(request))
    normed, new_residual = run_poisoned(x, residual, weight, EPS, offset, weight_first)
    check((normed, new_residual), x, residual, weight, EPS, offset, weight_first)
    # The new residual is the eager model-dtype add exactly; the normed rows agree with HF's fp32 sequence
    # to the last bit but for rare rounding-boundary cases.
    eager_normed, eager_residual = add_rmsnorm_reference(x, residual, weight, EPS, offset, weight_first)
    assert torch.equal(new_residual, eager_residual)
    torch.testing.assert_close(normed, eager_normed, rtol=2**-7, atol=1e-6)
    assert (normed != eager_normed).float().mean() < 1e-3


@needs_cuda
def test_cuda_graph_and_compile(request):
    x, residual, weight = make_inputs((16, 4096), torch.bfloat16, "cuda", seed_of(request))
    assert_graph_replay_and_compile(
        lambda: add_rmsnorm(x, residual, weight, EPS),
        lambda: x.copy_(make_inputs((16, 4096), torch.bfloat16, "cuda", seed_of(request) + 1)[0]))


def check_sandwich(outputs, x, residual, branch_weight, weight, offset, weight_first=False):
    """norm_add_rmsnorm against its float64 reference: the normed sum (when asked for) and the new residual."""
    expected = norm_add_rmsnorm_reference(x.double(), residual.double(), branch_weight.double(),
                                          None if weight is None else weight.double(), EPS, offset, weight_first)
    assert (outputs[0] is None) == (weight is None)
    for name, out, want in zip(("normed", "new_residual"), outputs, expected):
        if want is not None:
            torch.testing.assert_close(out.double(), want, **TOLERANCE[x.dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("normalise_sum", [True, False])
@NORM_KINDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 80), (2, 3, 48)])
def test_norm_add_rmsnorm_matches_reference_small(request, shape, dtype, offset, weight_first, normalise_sum):
    x, residual, weight = make_inputs(shape, dtype, SMALL_DEVICE, seed_of(request))
    branch_weight = make_inputs(shape, dtype, SMALL_DEVICE, seed_of(request) + 1)[2]
    weight = weight if normalise_sum else None
    check_sandwich(norm_add_rmsnorm(x, residual, branch_weight, weight, EPS, offset, weight_first), x, residual,
                   branch_weight, weight, offset, weight_first)


def test_norm_add_rmsnorm_without_its_branch_norm_fails_the_check(request):
    """The comparison can fail: the branch's norm weight swapped for the sum's, or left out, is caught."""
    x, residual, weight = make_inputs((3, 80), torch.float32, SMALL_DEVICE, seed_of(request))
    branch_weight = make_inputs((3, 80), torch.float32, SMALL_DEVICE, seed_of(request) + 1)[2]
    with pytest.raises(AssertionError):
        check_sandwich(norm_add_rmsnorm(x, residual, weight, weight, EPS), x, residual, branch_weight, weight, False)
    with pytest.raises(AssertionError):
        check_sandwich(add_rmsnorm(x, residual, weight, EPS), x, residual, branch_weight, weight, False)


@needs_cuda
@pytest.mark.parametrize("normalise_sum", [True, False])
@NORM_KINDS
@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("hidden", [1152, 2048, 2304, 4096])  # gemma-3-1b, olmo-2-1b, gemma-2-2b, glm-4-9b
def test_norm_add_rmsnorm_matches_reference_cuda(request, hidden, rows, offset, weight_first, normalise_sum):
    x, residual, weight = make_inputs((rows, hidden), torch.bfloat16, "cuda", seed_of(request))
    branch_weight = make_inputs((rows, hidden), torch.bfloat16, "cuda", seed_of(request) + 1)[2]
    weight = weight if normalise_sum else None
    outputs = norm_add_rmsnorm(x, residual, branch_weight, weight, EPS, offset, weight_first)
    check_sandwich(outputs, x, residual, branch_weight, weight, offset, weight_first)
    # the same roundings as the eager sequence: the new residual agrees but for rare rounding-boundary cases
    eager = norm_add_rmsnorm_reference(x, residual, branch_weight, weight, EPS, offset, weight_first)
    assert (outputs[1] != eager[1]).float().mean() < 1e-3


@needs_cuda
def test_norm_add_rmsnorm_cuda_graph_and_compile(request):
    x, residual, weight = make_inputs((16, 1152), torch.bfloat16, "cuda", seed_of(request))
    assert_graph_replay_and_compile(
        lambda: norm_add_rmsnorm(x, residual, weight.flip(0), weight, EPS, True),
        lambda: x.copy_(make_inputs((16, 1152), torch.bfloat16, "cuda", seed_of(request) + 1)[0]))
