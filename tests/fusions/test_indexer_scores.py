"""The lightning indexer's scoring kernel against float64: equal, to fp32 accumulation, to the scores of the operands
rounded to bf16 (the flip, to nearest even), and within the flip's rounding of the scores of the operands as given;
the reference against HF's own module. Fresh random inputs every case (weights of both signs, never ones or zeros:
a kernel that forgot the weights or the ReLU would agree with those).

CPU cases run under the Triton interpreter at small, odd shapes; CUDA cases at DeepSeek-V4-Flash's 64 heads of 128.
"""

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

from optiq.fusions.indexer_scores import (MAX_BLOCK_D, MAX_BLOCK_H, MAX_BLOCK_T, benchmark_case, indexer_scores,
                                          indexer_scores_reference)
from kernel_testing import OPCHECKS, SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda, seed_of

BF16_EPS = torch.finfo(torch.bfloat16).eps


def make_inputs(batch, heads, dim, entries, q_dtype, k_dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=generator)
    k = torch.randn(batch, entries, dim, generator=generator)
    weights = torch.randn(batch, heads, generator=generator) / heads**0.5
    return q.to(device, q_dtype), k.to(device, k_dtype), weights.to(device, q_dtype)


def expected(q, k, weights, scale):
    """The scores in float64 of the operands as they are given."""
    scores = torch.relu(q.double() @ k.double().transpose(-1, -2))
    return (scores * weights.double().unsqueeze(-1)).sum(dim=-2) * scale


def check(got, q, k, weights, scale):
    """Equal, to fp32 accumulation, to the scores of q and k rounded to bf16 (the element tolerance at the size of
    the largest score: a score is a sum of products of both signs); within two bf16 roundings of the exact ones."""
    want = expected(q.to(torch.bfloat16), k.to(torch.bfloat16), weights, scale)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    exact = expected(q, k, weights, scale)
    assert (got.double() - exact).norm() <= 2 * BF16_EPS * exact.norm()


@pytest.mark.usefixtures("poisoned_empty")  # a block of keys left unwritten reads NaN
@pytest.mark.parametrize("q_dtype, k_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("batch, heads, dim, entries", [
    (1, 3, 16, 5),                          # the tiny preset's indexer: everything padded to one block of 16
    (2, 5, 24, 37),                         # odd heads and dim, entries past a block
    (3, 16, 32, 2 * MAX_BLOCK_T + 3),       # three blocks of keys at the widest, the last of three keys
    (1, MAX_BLOCK_H + 6, MAX_BLOCK_D + 8, 19),  # two blocks of heads and of dim, each the last partial
])
def test_matches_the_bf16_operands_scores_in_float64(request, batch, heads, dim, entries, q_dtype, k_dtype):
    """fp32 operands are compared with torch's rounding to bf16 (to nearest even): a kernel that truncated them, as
    the interpreter's own conversion does, would be a bf16 ulp off on half the keys."""
    q, k, weights = make_inputs(batch, heads, dim, entries, q_dtype, k_dtype, SMALL_DEVICE, seed_of(request))
    scale = (dim * heads) ** -0.5
    check(indexer_scores(q, k, weights, scale), q, k, weights, scale)


def test_no_entries_and_shapes_that_do_not_fit():
    q, k, weights = make_inputs(2, 4, 16, 0, torch.bfloat16, torch.float32, SMALL_DEVICE, 0)
    assert indexer_scores(q, k, weights, 1.0).shape == (2, 0)
    k = torch.randn(2, 5, 16, device=SMALL_DEVICE)
    for args in ((q, k[:, :, :-1], weights), (q, k[:1], weights), (q, k, weights[:, :-1]), (q[:, 0], k, weights)):
        with pytest.raises(ValueError, match="do not fit"):
            indexer_scores(*args, 1.0)


def test_the_reference_is_hfs_module(request):
    """indexer_scores_reference, given the module's projected weights and its two scales as one, is what
    DeepseekV4IndexerScorer computes at one query position (both in fp32)."""
    config = DeepseekV4Config(hidden_size=48, index_n_heads=5, index_head_dim=24)
    module = DeepseekV4IndexerScorer(config)
    generator = torch.Generator().manual_seed(seed_of(request))
    with torch.no_grad():
        module.weights_proj.weight.copy_(torch.randn(5, 48, generator=generator))
        q, k = torch.randn(3, 1, 5, 24, generator=generator), torch.randn(3, 7, 24, generator=generator)
        hidden = torch.randn(3, 1, 48, generator=generator)
        got = module(q, k, hidden)
        weights = module.weights_proj(hidden[:, 0])
    scale = module.softmax_scale * module.weights_scaling
    torch.testing.assert_close(indexer_scores_reference(q[:, 0], k, weights, scale), got[:, 0], rtol=1e-5,
                               atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("k_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_v4_flash_shapes_on_the_gpu(request, batch, k_dtype):
    """V4-Flash's indexer over a 1024-position cache's 256 entries: bf16 queries and weights, keys bf16 as the bf16
    model gives them or fp32 (rounded by the GPU's conversion); CUDA-graph replay and torch.compile."""
    q, k, weights = make_inputs(batch, 64, 128, 256, torch.bfloat16, k_dtype, "cuda", seed_of(request))
    scale = (128 * 64) ** -0.5
    check(indexer_scores(q, k, weights, scale), q, k, weights, scale)
    fresh = make_inputs(batch, 64, 128, 256, torch.bfloat16, k_dtype, "cuda", seed_of(request) + 1)[1]
    assert_graph_replay_and_compile(lambda: indexer_scores(q, k, weights, scale), lambda: k.copy_(fresh))


@needs_cuda
def test_benchmark_case_cuda():
    case = benchmark_case(16, torch.bfloat16, "cuda")
    fused, eager = case["fused"](), case["eager"]()
    assert (fused.double() - eager.double()).norm() <= 2 * BF16_EPS * eager.double().norm()


def test_custom_op_registration():
    q, k, weights = make_inputs(2, 4, 16, 5, torch.bfloat16, torch.float32, SMALL_DEVICE, 0)
    torch.library.opcheck(torch.ops.optiq.indexer_scores.default, (q, k, weights, 0.5), **OPCHECKS)
