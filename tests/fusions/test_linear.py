"""The decode GEMM against nn.Linear in float64: rows 1-16 with and without bias, odd K and N, every output element
written, prefill rows handed to cuBLAS; its grouped form against the block-diagonal product in float64.

CPU cases run under the Triton interpreter at small shapes; CUDA cases use the presets' projections."""

import pytest
import torch
import torch.nn.functional as F

from optiq.fusions import linear as linear_module
from optiq.fusions.linear import (DECODE_ROWS, GROUPED_PROJECTIONS, MAX_BLOCK_M, PROJECTIONS, arrival_counters,
                                 benchmark_case, grouped_linear, grouped_linear_reference, linear)
from kernel_testing import OPCHECKS, SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda, seed_of

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def make_inputs(seed, leading, k, n, dtype, device, bias):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*leading, k, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(device=device, dtype=dtype)
    return x, weight, torch.randn(n, generator=gen).to(device=device, dtype=dtype) if bias else None


def check(x, weight, bias, kernel=linear):
    got = kernel(x, weight, bias)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == want.shape and got.dtype == x.dtype
    tolerance = TOLERANCES[x.dtype]
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    return got


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("leading, k, n", [((1,), 64, 48), ((3, 1), 96, 40), ((16,), 300, 33), ((2, 5), 600, 20)])
def test_matches_nn_linear(request, poisoned_empty, leading, k, n, bias):
    check(*make_inputs(seed_of(request), leading, k, n, torch.float32, SMALL_DEVICE, bias))


@pytest.mark.parametrize("rows", [3, DECODE_ROWS + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_is_added_before_the_one_rounding(request, rows, dtype):
    """residual + x @ W.T, for decode rows in the kernel's epilogue and past them in cuBLAS's (addmm); as close to
    the float64 sum as the plain product is to its own (one rounding of the sum, not two)."""
    x, weight, _ = make_inputs(seed_of(request), (rows,), 96, 40, dtype, SMALL_DEVICE, bias=False)
    residual = torch.randn(rows, 40, generator=torch.Generator().manual_seed(rows)).to(SMALL_DEVICE, dtype) * 4
    got = linear(x, weight, residual=residual)
    want = residual.double() + F.linear(x.double(), weight.double())
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=TOLERANCES[dtype], atol=TOLERANCES[dtype])
    assert not torch.allclose(got.double(), want - residual.double(), atol=0.5)  # the residual is really in it
    with pytest.raises(ValueError):
        linear(x, weight, residual=residual[:, :-1])


def test_bf16(request):
    check(*make_inputs(seed_of(request), (5,), 160, 48, torch.bfloat16, SMALL_DEVICE, bias=True))


def test_k_tiles_keep_every_program_resident(request, monkeypatch):
    """On the H200's 132 SMs: where programs outnumber the SMs, 128-wide K tiles, whose four stages keep all of an
    SM's programs resident (Phi-3's QKV, three an SM; DeepSeek-V4's grouped output projection, two); one program an
    SM over a long K takes 512; an LM head's thousands of programs, which no tile keeps resident, 256. The 128-wide
    path computes the same product (bf16, 5 programs an SM of 4 SMs, on the GPU too)."""
    monkeypatch.setattr(linear_module, "multiprocessor_count", lambda device: 132)
    cuda_like = torch.device("cpu")
    qkv = linear_module.tile_config(9216, 3072, cuda_like, rows=16)
    assert qkv["BLOCK_K"] == 128
    assert 3 * qkv["num_stages"] * (16 + qkv["BLOCK_N"]) * qkv["BLOCK_K"] * 2 <= 228 * 1024
    assert linear_module.tile_config(8 * 1024, 4096, cuda_like)["BLOCK_K"] == 128
    assert linear_module.tile_config(4096, 14336, cuda_like)["BLOCK_K"] == 512
    assert linear_module.tile_config(128256, 2048, cuda_like)["BLOCK_K"] == 256
    monkeypatch.setattr(linear_module, "multiprocessor_count", lambda device: 4)
    monkeypatch.setattr(linear_module, "shared_memory_per_multiprocessor", lambda device: 228 * 1024)
    assert linear_module.tile_config(300, 600, torch.device(SMALL_DEVICE))["BLOCK_K"] == 128
    check(*make_inputs(seed_of(request), (1,), 600, 300, torch.bfloat16, SMALL_DEVICE, bias=False))


@pytest.mark.parametrize("rows", [1, 5, DECODE_ROWS])
@pytest.mark.parametrize("extras", ["none", "bias", "residual"])
def test_split_k_sums_every_slice_once(request, poisoned_empty, monkeypatch, rows, extras):
    """K cut into slices whose partial sums the last program of the output tile adds up (one 32-column tile for 4
    SMs, four slices asked, which whole 256-wide K tiles make three: 256, 256 and 88): the float64 product, bias and
    residual added once, the arrival counters left at zero for the next launch, and the same bits at every call
    whichever program arrives last."""
    monkeypatch.setattr(linear_module, "KSPLIT_MIN", 128)
    assert linear_module.tile_config(20, 600, torch.device(SMALL_DEVICE), rows)["SPLITS"] == 3
    x, weight, bias = make_inputs(seed_of(request), (rows,), 600, 20, torch.float32, SMALL_DEVICE, extras == "bias")
    residual = torch.randn(rows, 20, generator=torch.Generator().manual_seed(rows)).to(SMALL_DEVICE)
    residual = residual if extras == "residual" else None
    got = linear(x, weight, bias, residual)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    want = want if residual is None else want + residual.double()
    torch.testing.assert_close(got.double(), want, rtol=TOLERANCES[torch.float32], atol=TOLERANCES[torch.float32])
    assert not arrival_counters(x.device).any()
    assert torch.equal(linear(x, weight, bias, residual), got)


def test_split_count_fills_idle_sms_only(monkeypatch):
    """On 132 SMs: qwen3-0.6b's o_proj and down_proj (1024 columns) and Gemma-3-1B's down_proj (1152) are cut in K into
    32-column tiles, as many slices as leave every program an SM of its own; a projection whose tiles fill two thirds
    of the SMs or more (Phi-3's o_proj, 96 tiles; Llama-3.1-8B's down_proj; an LM head) is not, nor a K too short for
    two slices."""
    monkeypatch.setattr(linear_module, "multiprocessor_count", lambda device: 132)
    cuda_like = torch.device("cpu")
    qwen_o_proj = linear_module.tile_config(1024, 2048, cuda_like)
    assert (qwen_o_proj["BLOCK_N"], qwen_o_proj["SPLITS"]) == (32, 4)  # 32 tiles of 4 slices: 128 programs
    assert linear_module.tile_config(1024, 3072, cuda_like)["SPLITS"] == 4
    assert linear_module.tile_config(1152, 6912, cuda_like, rows=16)["SPLITS"] == 3
    assert linear_module.tile_config(2048, 8192, cuda_like)["SPLITS"] == 2  # Llama-3.2-1B's down_proj, 64 tiles
    assert linear_module.tile_config(3072, 3072, cuda_like)["SPLITS"] == 1
    assert linear_module.tile_config(4096, 14336, cuda_like)["SPLITS"] == 1
    assert linear_module.tile_config(128256, 2048, cuda_like)["SPLITS"] == 1
    assert linear_module.tile_config(1024, 256, cuda_like)["SPLITS"] == 1


def test_the_comparison_can_fail(request):
    """A kernel that left out the last column of K would be caught at these tolerances."""
    x, weight, bias = make_inputs(seed_of(request), (3,), 96, 40, torch.float32, SMALL_DEVICE, bias=True)
    with pytest.raises(AssertionError):
        check(x, weight, bias, kernel=lambda x, weight, bias: linear(x[:, :-1], weight[:, :-1], bias))


@pytest.mark.parametrize("rows", [DECODE_ROWS + 1, 40, MAX_BLOCK_M])
def test_the_kernel_takes_up_to_its_largest_m_tile(request, monkeypatch, rows):
    """Past DECODE_ROWS the product hands over to cuBLAS, but the kernel itself (which scripts/tiles.py times there)
    computes every row of its one 64-row tile, bias and residual included."""
    monkeypatch.setattr(linear_module, "DECODE_ROWS", MAX_BLOCK_M)
    x, weight, bias = make_inputs(seed_of(request), (rows,), 300, 40, torch.float32, SMALL_DEVICE, True)
    residual = torch.randn(rows, 40, generator=torch.Generator().manual_seed(rows)).to(SMALL_DEVICE)
    got = linear(x, weight, bias, residual)
    assert not torch.equal(got, F.linear(x, weight, bias) + residual)  # not cuBLAS's result: the kernel's
    want = F.linear(x.double(), weight.double(), bias.double()) + residual.double()
    torch.testing.assert_close(got.double(), want, rtol=TOLERANCES[torch.float32], atol=TOLERANCES[torch.float32])


def test_prefill_rows_are_cublas_s(request):
    x, weight, bias = make_inputs(seed_of(request), (DECODE_ROWS + 1,), 64, 32, torch.float32, SMALL_DEVICE, True)
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))


def test_wrong_shapes_are_refused():
    x, weight, bias = make_inputs(1, (2,), 64, 32, torch.float32, "cpu", bias=True)
    with pytest.raises(ValueError):
        linear(x, weight[:, :32])
    with pytest.raises(ValueError):
        linear(x, weight, bias[:16])


def block_diagonal(x, weight, groups):
    """Group g of x [..., G, K] through rows [g N, (g + 1) N) of weight, in float64, one group at a time."""
    n = weight.shape[0] // groups
    return torch.stack([x[..., g, :].double() @ weight[g * n:(g + 1) * n].double().T for g in range(groups)], dim=-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leading, groups, k, n", [((1,), 3, 96, 40), ((5,), 4, 64, 24), ((2, 3), 2, 300, 33),
                                                   ((DECODE_ROWS + 4,), 3, 64, 16)])
def test_grouped_matches_the_block_diagonal_product(request, poisoned_empty, dtype, leading, groups, k, n):
    """Every group through its own block of weight rows, in the kernel up to DECODE_ROWS rows and in cuBLAS's batched
    GEMM past them; as close to float64 as HF's batched GEMM is."""
    gen = torch.Generator().manual_seed(seed_of(request))
    x = torch.randn(*leading, groups, k, generator=gen).to(SMALL_DEVICE, dtype)
    weight = (torch.randn(groups * n, k, generator=gen) / k**0.5).to(SMALL_DEVICE, dtype)
    got = grouped_linear(x, weight, groups)
    want = block_diagonal(x, weight, groups)
    assert got.shape == (*leading, groups, n) and got.dtype == dtype
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(grouped_linear_reference(x, weight, groups).double(), want, rtol=tolerance,
                               atol=tolerance)
    swapped = torch.cat([weight[n:2 * n], weight[:n], weight[2 * n:]])  # groups 0 and 1 through each other's rows
    assert not torch.allclose(grouped_linear(x, swapped, groups).double(), want, rtol=tolerance, atol=tolerance)


def test_grouped_wrong_shapes_are_refused():
    x = torch.randn(2, 4, 64)
    with pytest.raises(ValueError):
        grouped_linear(x, torch.randn(4 * 8 + 1, 64), 4)  # rows not a multiple of the groups
    with pytest.raises(ValueError):
        grouped_linear(x, torch.randn(3 * 8, 64), 3)  # x holds 4 groups


def test_custom_op_registration(request):
    x, weight, bias = make_inputs(seed_of(request), (2,), 64, 32, torch.float32, SMALL_DEVICE, bias=True)
    torch.library.opcheck(torch.ops.optiq.linear.default, (x, weight, arrival_counters(x.device), bias), **OPCHECKS)
    grouped = x.view(2, 2, 32)  # two groups of 32 through [2 x 16, 32]
    torch.library.opcheck(torch.ops.optiq.linear.default,
                          (grouped, weight[:, :32], arrival_counters(grouped.device), None, None, 2), **OPCHECKS)


@needs_cuda
@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("rows", [1, 16])
def test_preset_projections_cuda(projection, rows):
    k, n = PROJECTIONS[projection]
    check(*make_inputs(rows + k + n, (rows,), k, n, torch.bfloat16, "cuda", bias=False))


@needs_cuda
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_grouped_projections_cuda(rows):
    for k, n, groups in GROUPED_PROJECTIONS.values():
        gen = torch.Generator().manual_seed(rows + k + n)
        x = torch.randn(rows, groups, k, generator=gen).to("cuda", torch.bfloat16)
        weight = (torch.randn(groups * n, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)
        got = grouped_linear(x, weight, groups)
        torch.testing.assert_close(got.double(), block_diagonal(x, weight, groups), rtol=1e-2, atol=1e-2)
        assert_graph_replay_and_compile(lambda: grouped_linear(x, weight, groups),
                                        lambda: x.copy_(torch.randn_like(x)))


@needs_cuda
@pytest.mark.parametrize("k, n", [(2048, 1024), (4096, 4096)])
def test_cuda_graph_and_compile_cuda(k, n):
    x, weight, bias = make_inputs(k + n, (4, 1), k, n, torch.bfloat16, "cuda", bias=True)
    assert_graph_replay_and_compile(lambda: linear(x, weight, bias), lambda: x.copy_(torch.randn_like(x)))


@needs_cuda
def test_benchmark_cases_cuda():
    for case in benchmark_case(16, torch.bfloat16, "cuda").values():
        torch.testing.assert_close(case["fused"](), case["eager"](), rtol=2e-2, atol=2e-2)
