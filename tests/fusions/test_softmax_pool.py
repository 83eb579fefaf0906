"""Softmax-weighted pooling against the same computation in float64: a window's slots (2 to 128, odd feature counts,
a slot masked as DeepSeek-V4's first window masks its overlap), the values in fp32 and bf16, the gates fp32; and read
from per-position buffers by window (softmax_pool_window) against optiq's V4 cache's own gather of them.

CPU cases run under the Triton interpreter at small shapes; CUDA cases take DeepSeek-V4-Flash's windows."""

import pytest
import torch

from optiq.decode_caches.deepseek_v4 import window_slots
from optiq.fusions.softmax_pool import (POOLS, benchmark_case, softmax_pool, softmax_pool_reference,
                                       softmax_pool_window, tile_config)
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


def make_buffers(seed, rows, length, width, dtype, device):
    """Per-position kv and gate buffers, and a position per row: the first window, a window's first and last
    position, one past several windows (the rows cycle through them)."""
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(rows, length, width, generator=generator).to(device=device, dtype=dtype)
    gate = (2 * torch.randn(rows, length, width, generator=generator)).to(device)
    positions = torch.tensor([1, 4, 7, length - 1, 8, 0][:rows] * (rows // 6 + 1), device=device)[:rows]
    return kv, gate, positions


def check_window(kv, gate, positions, rate, overlap, kernel=softmax_pool_window):
    rows, offsets = torch.arange(kv.shape[0], device=kv.device), torch.arange(rate, device=kv.device)
    values, gates = window_slots(kv.double(), gate.double(), positions, rate, overlap, rows, offsets)
    want = (values * gates.softmax(dim=1)).sum(dim=1)
    got = kernel(kv, gate, positions, rate, overlap)
    assert got.shape == want.shape and got.dtype == kv.dtype
    torch.testing.assert_close(got.double(), want, rtol=TOLERANCES[kv.dtype], atol=TOLERANCES[kv.dtype])


@pytest.mark.parametrize("rate, width, overlap", [(4, 40, 0), (4, 48, 24), (2, 130, 65), (8, 24, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_read_from_the_buffers(request, rate, width, overlap, dtype):
    """Six rows at different places in their windows (the first window, where the overlap's previous series is
    absent, its first and last position, later windows), with and without CSA's overlap, odd feature counts."""
    check_window(*make_buffers(seed_of(request), 6, 24, width, dtype, SMALL_DEVICE), rate, overlap)


def test_the_window_comparison_can_fail(request):
    """A kernel that pools the window before the position's, or reads the overlap's series from this window, is
    caught; so are buffers that do not fit the window."""
    kv, gate, positions = make_buffers(seed_of(request), 6, 24, 48, torch.float32, SMALL_DEVICE)
    with pytest.raises(AssertionError):
        check_window(kv, gate, positions, 4, 24,
                     kernel=lambda k, g, p, r, o: softmax_pool_window(k, g, (p - r).clamp(min=0), r, o))
    with pytest.raises(AssertionError):
        check_window(kv, gate, positions, 4, 24,
                     kernel=lambda k, g, p, r, o: softmax_pool_window(k, g, p, r, 0)[:, o:])
    with pytest.raises(ValueError):
        softmax_pool_window(kv, gate, positions, 4, 16)  # 48 features are not two series of 16
    with pytest.raises(ValueError):
        softmax_pool_window(kv, gate[:, :3], positions, 4)


def test_window_op_registration(request):
    kv, gate, positions = make_buffers(seed_of(request), 2, 16, 32, torch.float32, SMALL_DEVICE)
    torch.library.opcheck(torch.ops.optiq.softmax_pool_window.default, (kv, gate, positions, 4, 16), **OPCHECKS)


@needs_cuda
@pytest.mark.parametrize("rate, width, overlap", [(4, 1024, 512), (128, 512, 0), (4, 256, 128)])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_deepseek_v4_flash_buffers_cuda(rows, rate, width, overlap):
    """V4-Flash's CSA compressor (rate 4, two series of 512), HCA's (128 positions of 512) and the CSA indexer's
    (two series of 128), bf16 kv and fp32 gates, in a CUDA graph and under torch.compile."""
    kv, gate, positions = make_buffers(rows + rate, rows, 1024, width, torch.bfloat16, "cuda")
    check_window(kv, gate, positions, rate, overlap)
    assert_graph_replay_and_compile(lambda: softmax_pool_window(kv, gate, positions, rate, overlap),
                                    lambda: positions.add_(1))


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
