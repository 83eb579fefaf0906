"""mla_decode against a float64 reference (split counts, lengths, dtypes, masking) and, with the up-projections
absorbed, against HF's expand-then-SDPA path.

CPU cases run the kernels under the Triton interpreter at small, odd shapes; CUDA cases use DeepSeek-V2-Lite's.
"""

import pytest
import torch

from optiq.fusions.mla_decode import benchmark_case, mla_decode, mla_decode_reference
from kernel_testing import OPCHECKS, SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda, seed_of

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def make_inputs(seed, batch, heads, latent, rope, max_len, lengths, dtype, device):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    return (randn(batch, heads, latent) / latent**0.25, randn(batch, heads, rope), randn(batch, max_len, latent),
            randn(batch, max_len, rope), torch.tensor(lengths, device=device))


def check(inputs, scale, dtype):
    got = mla_decode(*inputs, scale)
    want = mla_decode_reference(*(t.double() if t.is_floating_point() else t for t in inputs), scale)
    assert got.dtype == dtype and got.shape == inputs[0].shape
    torch.testing.assert_close(got.double(), want, rtol=TOLERANCES[dtype], atol=TOLERANCES[dtype])


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("heads, latent, rope, max_len, lengths", [
    (4, 40, 8, 50, [50, 1, 17]),  # odd widths; a full cache, a single position, a partial block
    (16, 64, 16, 96, [96, 33]),  # DeepSeek's 16 heads
    (3, 32, 8, 40, [0, 12]),  # an idle slot (length 0) gives zeros
])
def test_shapes_and_lengths(request, heads, latent, rope, max_len, lengths):
    inputs = make_inputs(seed_of(request), len(lengths), heads, latent, rope, max_len, lengths, torch.float32,
                         SMALL_DEVICE)
    check(inputs, 0.3, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(request, dtype):
    check(make_inputs(seed_of(request), 2, 4, 32, 8, 40, [40, 7], dtype, SMALL_DEVICE), 0.2, dtype)


def test_positions_beyond_length_are_ignored():
    inputs = make_inputs(5, 2, 4, 32, 8, 48, [20, 9], torch.float32, SMALL_DEVICE)
    want = mla_decode(*inputs, 0.25)
    for cache in inputs[2:4]:
        cache[0, 20:] = 1e4
        cache[1, 9:] = -1e4
    torch.testing.assert_close(mla_decode(*inputs, 0.25), want, rtol=0, atol=0)


def test_wrong_length_or_scale_fails_the_comparison():
    inputs = make_inputs(6, 2, 4, 32, 8, 40, [30, 12], torch.float32, SMALL_DEVICE)
    want = mla_decode_reference(*inputs, 0.3)
    short = inputs[:4] + (inputs[4] - 1,)
    for got in (mla_decode(*short, 0.3), mla_decode(*inputs, 0.31)):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(got, want)
    with pytest.raises(ValueError):
        mla_decode(inputs[0], inputs[1], inputs[2], inputs[3][:, :10], inputs[4], 0.3)


def test_absorbed_path_equals_hf_expand_then_sdpa():
    """q_nope @ W_UK, attention in the latent space, then @ W_UV.T computes what expanding the latent does."""
    case = benchmark_case(2, torch.float32, SMALL_DEVICE, heads=4, latent=32, rope=8, max_len=40)
    torch.testing.assert_close(case["fused"](), case["eager"](), rtol=1e-4, atol=1e-5)


def test_custom_op_registration():
    inputs = make_inputs(7, 2, 4, 16, 8, 20, [20, 3], torch.float32, SMALL_DEVICE)  # all checks on CUDA: OPCHECKS
    torch.library.opcheck(torch.ops.optiq.mla_decode.default, (*inputs, 0.3), **OPCHECKS)


@needs_cuda
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_deepseek_v2_lite_shapes_cuda(batch):
    lengths = [(37 * b) % 1024 + 1 for b in range(batch)]
    check(make_inputs(batch, batch, 16, 512, 64, 1024, lengths, torch.bfloat16, "cuda"), 192**-0.5, torch.bfloat16)


@needs_cuda
def test_cuda_graph_and_compile_cuda():
    q_lat, q_pe, c, pe, lengths = make_inputs(9, 4, 16, 512, 64, 256, [256, 3, 100, 17], torch.bfloat16, "cuda")
    assert_graph_replay_and_compile(
        lambda: mla_decode(q_lat, q_pe, c, pe, lengths, 0.1), lambda: lengths.copy_(torch.tensor([5, 256, 1, 64])),
        same=lambda got, want: torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3))
