"""RMSNorm kernel against a float64 reference; the reference itself against HF's Llama, Gemma and OLMo 2 norms."""

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from optiq.fusions.rmsnorm import rmsnorm, rmsnorm_reference
from kernel_testing import NORM_KINDS, SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda, seed_of

# bf16/fp16 round twice (normed, then times weight); the interpreter truncates instead of rounding.
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 1e-2, "atol": 1e-2},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}
EPS = 1e-6


def make_inputs(shape, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    weight = 1.0 + 0.5 * torch.randn(shape[-1], generator=generator)
    return x.to(device=device, dtype=dtype), weight.to(device=device, dtype=dtype)


def check(out, x, weight, eps, offset, weight_first=False):
    """out must be fully written and match the float64 reference within the dtype's tolerance."""
    assert not out.isnan().any(), "the kernel left poisoned elements unwritten"
    expected = rmsnorm_reference(x.double(), weight.double(), eps, offset, weight_first)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[x.dtype])


def run_poisoned(x, weight, eps, offset, weight_first=False):
    out = torch.full_like(x, float("nan"))
    assert rmsnorm(x, weight, eps, offset, out=out, weight_first=weight_first) is out
    return out


@NORM_KINDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 80), (1, 64), (2, 3, 48)])
def test_matches_reference_small(request, shape, dtype, offset, weight_first):
    x, weight = make_inputs(shape, dtype, SMALL_DEVICE, seed_of(request))
    check(run_poisoned(x, weight, EPS, offset, weight_first), x, weight, EPS, offset, weight_first)


def test_strided_rows(request):
    """Rows that are a slice of wider rows (row stride > hidden) are read in place."""
    wide, weight = make_inputs((4, 96), torch.float32, SMALL_DEVICE, seed_of(request))
    x = wide[:, :80]
    weight = weight[:80].contiguous()
    check(rmsnorm(x, weight, EPS), x, weight, EPS, False)


def test_wrong_inputs_fail_the_check(request):
    """The comparison can fail: a wrong eps or a flipped offset flag is caught."""
    x, weight = make_inputs((3, 80), torch.float32, SMALL_DEVICE, seed_of(request))
    with pytest.raises(AssertionError):
        check(rmsnorm(x, weight, 1.0), x, weight, EPS, False)
    with pytest.raises(AssertionError):
        check(rmsnorm(x, weight, EPS, offset=True), x, weight, EPS, False)


def test_rejects_mismatched_weight():
    with pytest.raises(ValueError, match="weight shape"):
        rmsnorm(torch.ones(2, 8), torch.ones(9), EPS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_is_hf(request, dtype):
    """The reference reproduces HF's rounding bit for bit: Llama rounds before the weight, Gemma and OLMo 2 after
    (the two orders differ: the test could fail)."""
    x, weight = make_inputs((4, 64), dtype, "cpu", seed_of(request))
    norms = [LlamaRMSNorm(64, eps=EPS).to(dtype), Gemma3RMSNorm(64, eps=EPS).to(dtype), Olmo2RMSNorm(64, eps=EPS)]
    norms[2].to(dtype)
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(weight)
        llama, gemma, olmo2 = (norm(x) for norm in norms)
    assert torch.equal(rmsnorm_reference(x, weight, EPS), llama)
    assert torch.equal(rmsnorm_reference(x, weight, EPS, offset=True), gemma)
    assert torch.equal(rmsnorm_reference(x, weight, EPS, weight_first=True), olmo2)
    assert not torch.equal(llama, olmo2)


@needs_cuda
@NORM_KINDS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
@pytest.mark.parametrize("hidden", [1024, 2048, 4096])
def test_matches_reference_cuda(request, hidden, rows, dtype, offset, weight_first):
    x, weight = make_inputs((rows, hidden), dtype, "cuda", seed_of(request))
    out = run_poisoned(x, weight, EPS, offset, weight_first)
    check(out, x, weight, EPS, offset, weight_first)
    # Against HF's own fp32 sequence the kernel agrees to the last bit but for rare rounding-boundary cases.
    hf = rmsnorm_reference(x, weight, EPS, offset, weight_first)
    torch.testing.assert_close(out, hf, rtol=2**-7, atol=1e-6)
    assert (out != hf).float().mean() < 1e-3


@needs_cuda
def test_cuda_graph_and_compile(request):
    x, weight = make_inputs((16, 4096), torch.bfloat16, "cuda", seed_of(request))
    assert_graph_replay_and_compile(
        lambda: rmsnorm(x, weight, EPS),
        lambda: x.copy_(make_inputs((16, 4096), torch.bfloat16, "cuda", seed_of(request) + 1)[0]))
