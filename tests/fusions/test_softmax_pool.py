"""Softmax-weighted pooling against the same computation in float64: a window's slots (2 to 128, odd feature counts,
a slot masked as DeepSeek-V4's first window masks its overlap), the values in fp32 and bf16, the gates fp32.

CPU cases run under the Triton interpreter at small shapes; CUDA cases take DeepSeek-V4-Flash's windows."""

import pytest
import torch

from optiq.fusions.softmax_pool import POOLS, benchmark_case, softmax_pool, softmax_pool_reference, tile_config
from kernel_testing import OPCHECKS, SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda, seed_of

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def make_inputs(seed, rows, slots, features, dtype, device):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, slots, features, generator=generator).to(device=device, dtype=dtype)
    gates = (2 * torch.randn(rows, slots, features, generator=generator)).to(device)
    return values, gates


def check(values, gates, kernel=softmax_pool):
    got = kernel(values, gates)
    weights = gates.double().softmax(dim=1)
    want = (values.double() * weights).sum(dim=1)
    assert got.shape == want.shape and got.dtype == values.dtype
    torch.testing.assert_close(got.double(), want, rtol=TOLERANCES[values.dtype], atol=TOLERANCES[values.dtype])


@pytest.mark.parametrize("rows, slots, features", [(1, 2, 16), (3, 8, 40), (2, 5, 130), (2, 128, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_float64_pool(request, poisoned_empty, rows, slots, features, dtype):
    check(*make_inputs(seed_of(request), rows, slots, features, dtype, SMALL_DEVICE))


def test_a_masked_slot_weighs_nothing(request):
    """DeepSeek-V4's first window has no previous one: its overlap slots carry -inf gates and zero values."""
    values, gates = make_inputs(seed_of(request), 2, 8, 32, torch.float32, SMALL_DEVICE)
    gates[:, :4] = float("-inf")
    values[:, :4] = 0.0
    check(values, gates)
    torch.testing.assert_close(softmax_pool(values, gates), softmax_pool(values[:, 4:].contiguous(),
                                                                         gates[:, 4:].contiguous()))


@needs_cuda
def test_it_rounds_as_eager_code_does_cuda(request):
    """bf16 values: the weights and each product rounded to bf16 as eager's cast and multiply round them, so the
    result is eager's up to the order of the sum (a rounding or two at most). On the GPU only: the interpreter
    rounds fp32 to bf16 by truncation."""
    values, gates = make_inputs(seed_of(request), 4, 8, 64, torch.bfloat16, "cuda")
    got, want = softmax_pool(values, gates).float(), softmax_pool_reference(values, gates).float()
    assert ((got - want).abs() <= 2 * torch.finfo(torch.bfloat16).eps * want.abs() + 1e-6).all()


def test_the_comparison_can_fail(request):
    """A pool that forgets the last slot, or takes the softmax over the features, is caught."""
    values, gates = make_inputs(seed_of(request), 2, 8, 32, torch.float32, SMALL_DEVICE)
    with pytest.raises(AssertionError):
        check(values, gates, kernel=lambda v, g: softmax_pool(v[:, :-1].contiguous(), g[:, :-1].contiguous()))
    with pytest.raises(AssertionError):
        check(values, gates, kernel=lambda v, g: (v * g.softmax(dim=2)).sum(dim=1))


def test_tiles_hold_every_slot():
    assert tile_config(8, 512) == dict(BLOCK_S=8, BLOCK_F=128, num_warps=4)
    assert tile_config(128, 512)["BLOCK_F"] == 16 and tile_config(5, 12)["BLOCK_S"] == 8


def test_wrong_shapes_are_refused():
    values = torch.randn(2, 4, 8)
    with pytest.raises(ValueError):
        softmax_pool(values, values[:, :3])
    with pytest.raises(ValueError):
        softmax_pool(values[0], values[0])
    with pytest.raises(ValueError):
        softmax_pool(values.transpose(1, 2), values.transpose(1, 2))


def test_custom_op_registration(request):
    values, gates = make_inputs(seed_of(request), 2, 4, 16, torch.float32, SMALL_DEVICE)
    torch.library.opcheck(torch.ops.optiq.softmax_pool.default, (values, gates), **OPCHECKS)


@needs_cuda
@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_deepseek_v4_flash_windows_cuda(pool, rows):
    slots, features = POOLS[pool]
    values, gates = make_inputs(rows + slots, rows, slots, features, torch.bfloat16, "cuda")
    check(values, gates)
    assert_graph_replay_and_compile(lambda: softmax_pool(values, gates), lambda: values.copy_(torch.randn_like(values)))


@needs_cuda
def test_benchmark_cases_cuda():
    for case in benchmark_case(16, torch.bfloat16, "cuda").values():
        torch.testing.assert_close(case["fused"](), case["eager"](), rtol=2e-2, atol=2e-2)
