"""moe_experts against transformers' eager experts loop in float64: routing patterns, tile edges, dtypes, packing.

CPU cases run the kernels under the Triton interpreter at small, odd shapes; CUDA cases use Qwen3-30B-A3B's.
"""

import pytest
import torch

from optiq.fusions.moe_experts import (benchmark_case, grouped_mm_experts, moe_experts, moe_experts_reference,
                                 pack_by_expert)
from kernel_testing import OPCHECKS, SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda, seed_of

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def make_inputs(seed, tokens, experts, top_k, hidden, inter, dtype, device, routing=None):
    """x, top-k ids (distinct per token; ``routing`` overrides them), normalised weights, expert weights scaled
    as nn.Linear's; never zeros."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    scores = torch.rand(tokens, experts, generator=gen, device=device)
    weights, index = scores.topk(top_k, dim=-1)
    if routing is not None:
        index = torch.as_tensor(routing, device=device).reshape(tokens, top_k)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=gen, device=device) / inter**0.5).to(dtype)
    return x, index, weights, w_gate_up, w_down


def check(inputs, dtype, limit=None):
    got = moe_experts(*inputs, limit=limit)
    want = moe_experts_reference(*(t.double() if t.is_floating_point() else t for t in inputs), limit=limit)
    assert got.dtype == dtype and got.shape == inputs[0].shape
    torch.testing.assert_close(got.double(), want, rtol=TOLERANCES[dtype], atol=TOLERANCES[dtype])
    return want


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu(request, dtype):
    """DeepSeek-V4's clamp: gate at most the limit, up within [-limit, limit]; with a limit of 0.7 most products
    of these inputs pass it, so a kernel that forgot the clamp fails."""
    inputs = make_inputs(seed_of(request), 7, 8, 2, 40, 24, dtype, SMALL_DEVICE)
    want = check(inputs, dtype, limit=0.7)
    double = [t.double() if t.is_floating_point() else t for t in inputs]
    assert not torch.allclose(want, moe_experts_reference(*double), rtol=1e-2, atol=1e-2)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (3, 8, 2), (17, 5, 3), (40, 16, 4)])
def test_routing_shapes(request, tokens, experts, top_k):
    check(make_inputs(seed_of(request), tokens, experts, top_k, 40, 24, torch.float32, SMALL_DEVICE), torch.float32)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("routing, why", [
    ([3, 3, 3, 3, 3, 3], "every slot on one expert: 6 slots in a 16-row tile, the other experts idle"),
    (list(range(6)), "one slot per expert"),
    ([5] * 19 + [0], "one expert past a tile's 16 rows, its second tile partial"),
])
def test_uneven_routing(request, routing, why):
    tokens = len(routing)
    inputs = make_inputs(seed_of(request), tokens, 6, 1, 40, 24, torch.float32, SMALL_DEVICE, routing=routing)
    check(inputs, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(request, dtype):
    check(make_inputs(seed_of(request), 5, 8, 2, 32, 16, dtype, SMALL_DEVICE), dtype)


def test_packing_is_sorted_counted_and_tiled():
    index = torch.tensor([[2, 0], [2, 1], [0, 2]], device=SMALL_DEVICE)
    order, counts, start, tile_end = pack_by_expert(index, 4, block_m=2)
    assert order.tolist() == [1, 4, 3, 0, 2, 5]  # slots of expert 0, then 1, then 2, each in slot order
    assert counts.tolist() == [2, 1, 3, 0] and start.tolist() == [0, 2, 3, 6] and tile_end.tolist() == [1, 2, 4, 4]


def test_packing_many_slots_is_a_stable_sort(request):
    """160 slots over 13 experts: five 32-slot chunks, ranks carried from chunk to chunk."""
    gen = torch.Generator().manual_seed(seed_of(request))
    index = torch.randint(0, 13, (40, 4), generator=gen).to(SMALL_DEVICE)
    order, counts, start, tile_end = pack_by_expert(index, 13, block_m=16)
    flat = index.reshape(-1)
    assert torch.equal(order.long(), torch.argsort(flat, stable=True))
    want_counts = torch.bincount(flat, minlength=13)
    assert torch.equal(counts.long(), want_counts) and torch.equal(start.long(), want_counts.cumsum(0) - want_counts)
    assert torch.equal(tile_end.long(), ((want_counts + 15) // 16).cumsum(0))


def test_wrong_inputs_fail():
    """The comparison can fail: swapped routing weights or the up half taken as gate give other answers; shapes
    that do not fit are refused."""
    x, index, weights, w_gate_up, w_down = make_inputs(7, 4, 8, 2, 32, 16, torch.float32, SMALL_DEVICE)
    want = moe_experts_reference(x, index, weights, w_gate_up, w_down)
    for wrong in (moe_experts(x, index, weights.flip(-1), w_gate_up, w_down),
                  moe_experts(x, index, weights, w_gate_up.roll(16, dims=1), w_down)):
        with pytest.raises(AssertionError):
            torch.testing.assert_close(wrong, want)
    with pytest.raises(ValueError):
        moe_experts(x, index, weights, w_gate_up, w_down.transpose(1, 2))


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_qwen3_30b_a3b_shapes_cuda(tokens):
    check(make_inputs(tokens, tokens, 128, 8, 2048, 768, torch.bfloat16, "cuda"), torch.bfloat16)


@needs_cuda
def test_cuda_graph_and_compile_cuda():
    x, index, weights, w_gate_up, w_down = make_inputs(11, 16, 128, 8, 2048, 768, torch.bfloat16, "cuda")
    assert_graph_replay_and_compile(lambda: moe_experts(x, index, weights, w_gate_up, w_down),
                                    lambda: index.copy_(index.roll(1, dims=0)))


def test_benchmark_case_and_grouped_mm_peer_agree():
    """The benchmark's peer (transformers' grouped_mm path, re-done without host syncs) computes the reference too."""
    case = benchmark_case(3, torch.float32, SMALL_DEVICE, experts=8, top_k=2, hidden=32, intermediate=16)
    torch.testing.assert_close(case["fused"](), case["eager"](), rtol=1e-5, atol=1e-5)
    inputs = make_inputs(17, 5, 6, 2, 32, 16, torch.float32, SMALL_DEVICE)
    torch.testing.assert_close(grouped_mm_experts(*inputs), moe_experts_reference(*inputs), rtol=1e-5, atol=1e-5)


def test_custom_op_registration():
    inputs = make_inputs(13, 3, 4, 2, 16, 8, torch.float32, SMALL_DEVICE)  # all checks on CUDA; see OPCHECKS
    torch.library.opcheck(torch.ops.optiq.moe_experts.default, inputs, **OPCHECKS)
