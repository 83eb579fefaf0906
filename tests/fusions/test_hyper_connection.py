"""The hyper-connection kernels (DeepSeek-V4's mHC) against the float64 formula of patching.structure, and that
formula against HF's own module; fresh random streams and parameters every case (never ones or zeros: HF initialises
base to zeros and scale to ones, on which a kernel that forgot either would agree)."""

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

from optiq.fusions.hyper_connection import BLOCK_D, BLOCK_K, TOKENS_BLOCK, hyper_connection
from optiq.patching.structure import stream_mixing
from kernel_testing import SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda, seed_of

# post and comb are fp32 sums over N D products (reordered here); collapsed is rounded once to the streams' dtype
# (the interpreter truncates to bf16 instead of rounding).
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 1e-5, "atol": 1e-6}}
COLLAPSED = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2}}
NORM_EPS, HC_EPS = 1e-6, 1e-6


def make_inputs(leading, n, d, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    outputs = (2 + n) * n
    streams = torch.randn(*leading, n, d, generator=generator)
    fn = torch.randn(outputs, n * d, generator=generator) / (n * d) ** 0.5
    base = 0.5 * torch.randn(outputs, generator=generator)
    scale = 1 + 0.3 * torch.randn(3, generator=generator)
    return streams.to(device, dtype), fn.to(device), base.to(device), scale.to(device)


def check(got, streams, fn, base, scale, iterations):
    want = stream_mixing(streams.double(), fn.double(), base.double(), scale.double(), NORM_EPS, HC_EPS, iterations)
    for name, g, w in zip(("post", "comb"), got[:2], want[:2]):
        assert g.dtype == torch.float32 and g.shape == w.shape, name
        torch.testing.assert_close(g.double(), w, **TOLERANCE[streams.dtype], msg=name)
    assert got[2].dtype == streams.dtype and got[2].shape == want[2].shape
    torch.testing.assert_close(got[2].double(), want[2], **COLLAPSED[streams.dtype])


@pytest.mark.usefixtures("poisoned_empty")  # a slice of the collapse or a partial sum left unwritten reads NaN
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leading, n, d, iterations", [
    ((1, 1), 4, 64, 20),                 # one decode token, V4's four streams, D inside one collapse slice
    ((3,), 4, BLOCK_D + 40, 20),         # D and N D past one collapse / projection slice; 3 tokens in a block of 4
    # two full blocks of tokens and one of a single token; three collapse slices, the last partial; N D past a
    # whole number of projection slices
    ((2 * TOKENS_BLOCK + 1,), 4, 2 * BLOCK_D + 24, 20),
    ((2, 2), 3, 70, 5),                  # three streams: padded to four in the kernel
    ((3,), 3, 2 * BLOCK_D + 1, 4),       # three streams over three collapse slices, the last a single element
    ((1,), 2, BLOCK_K // 2 + 3, 1),      # a single Sinkhorn iteration (columns only)
    ((TOKENS_BLOCK + 1,), 2, BLOCK_D + 8, 20),  # two streams, two collapse slices, two blocks of tokens
])
def test_matches_the_float64_formula(request, leading, n, d, iterations, dtype):
    streams, fn, base, scale = make_inputs(leading, n, d, dtype, SMALL_DEVICE, seed_of(request))
    check(hyper_connection(streams, fn, base, scale, NORM_EPS, HC_EPS, iterations), streams, fn, base, scale,
          iterations)


def test_the_formula_is_hfs_module(request):
    """stream_mixing is what DeepseekV4HyperConnection computes (HF computes in fp32 whatever it is given: agreement
    to fp32's precision), and the comparison can fail: one Sinkhorn iteration fewer is far outside it."""
    config = DeepseekV4Config(hidden_size=48, hc_mult=4, hc_sinkhorn_iters=7, hc_eps=1e-5, rms_norm_eps=1e-5)
    module = DeepseekV4HyperConnection(config).double()
    streams, fn, base, scale = (t.double() for t in make_inputs((2, 3), 4, 48, torch.float32, "cpu",
                                                                  seed_of(request)))
    with torch.no_grad():
        for name, value in (("fn", fn), ("base", base), ("scale", scale)):
            getattr(module, name).copy_(value)
        got = module(streams)
    for g, w in zip(got, stream_mixing(streams, fn, base, scale, 1e-5, 1e-5, 7)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    short = stream_mixing(streams, fn, base, scale, 1e-5, 1e-5, 6)[1]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got[1], short, rtol=1e-5, atol=1e-6)


def test_wrong_parameters_are_refused():
    streams, fn, base, scale = make_inputs((1,), 4, 32, torch.float32, "cpu", 0)
    with pytest.raises(ValueError, match="do not mix 4 streams of 32"):
        hyper_connection(streams, fn[:, :-1], base, scale, NORM_EPS, HC_EPS, 20)
    with pytest.raises(ValueError, match="at least one"):
        hyper_connection(streams, fn, base, scale, NORM_EPS, HC_EPS, 0)


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 64])
def test_v4_flash_shapes_on_the_gpu(request, tokens):
    """DeepSeek-V4-Flash's four streams of 4096 in bf16, fn in fp32 as the model keeps it; CUDA-graph replay. Token
    counts that fill the projection's blocks of tokens and ones that leave the last block part-empty."""
    streams, fn, base, scale = make_inputs((tokens, 1), 4, 4096, torch.bfloat16, "cuda", seed_of(request))
    check(hyper_connection(streams, fn, base, scale, NORM_EPS, HC_EPS, 20), streams, fn, base, scale, 20)
    fresh = make_inputs((tokens, 1), 4, 4096, torch.bfloat16, "cuda", seed_of(request) + 1)[0]
    assert_graph_replay_and_compile(lambda: hyper_connection(streams, fn, base, scale, NORM_EPS, HC_EPS, 20),
                                    lambda: streams.copy_(fresh), compile=False)
