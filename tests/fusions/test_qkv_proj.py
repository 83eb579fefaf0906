"""qkv_proj against three float64 nn.Linear projections: bias or none, leading dims, GQA sizes, dtypes.

The op is one cuBLAS/CPU GEMM over the concatenated weight (no Triton kernel), so CPU and CUDA run the same code.
"""

import pytest
import torch

from optiq.fusions.linear import arrival_counters
from optiq.fusions.qkv_proj import benchmark_case, concat_qkv_weights, qkv_proj, qkv_proj_reference
from kernel_testing import CUDA, OPCHECKS, assert_graph_replay_and_compile, needs_cuda

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def make_inputs(seed, leading, hidden, sizes, dtype, device, with_bias):
    """x [*leading, H], weights [D, H] scaled as nn.Linear's, and biases (Qwen2-style) when asked; never zeros."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*leading, hidden, generator=generator, device=device).to(dtype)
    weights = [torch.randn(n, hidden, generator=generator, device=device).div(hidden**0.5).to(dtype) for n in sizes]
    biases = [torch.randn(n, generator=generator, device=device).to(dtype) if with_bias else None for n in sizes]
    return x, weights, biases


def check(seed, leading, hidden, sizes, dtype, device, with_bias=False):
    x, weights, biases = make_inputs(seed, leading, hidden, sizes, dtype, device, with_bias)
    bias = torch.cat(biases) if with_bias else None
    outputs = qkv_proj(x, concat_qkv_weights(*weights), sizes, bias)
    expected = qkv_proj_reference(x.double(), *(w.double() for w in weights),
                                  *(None if b is None else b.double() for b in biases))
    tol = TOLERANCES[dtype]
    for got, want, size in zip(outputs, expected, sizes, strict=True):
        assert got.shape == (*leading, size) and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    return outputs


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("leading", [(1,), (3,), (2, 5)])
def test_shapes_cpu(leading, with_bias):
    check(seed=10 * len(leading) + leading[-1] + with_bias, leading=leading, hidden=80, sizes=(64, 32, 32),
          dtype=torch.float32, device="cpu", with_bias=with_bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_cpu(dtype):
    check(seed=20 if dtype == torch.bfloat16 else 21, leading=(4,), hidden=64, sizes=(64, 32, 32), dtype=dtype,
          device="cpu", with_bias=True)


def test_outputs_are_views_of_one_gemm_cpu():
    q, k, v = check(seed=30, leading=(3,), hidden=64, sizes=(16, 8, 24), dtype=torch.float32, device="cpu")
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()


def test_wrong_inputs_fail_cpu():
    """The comparison can fail: k and v weights swapped give other answers; sizes must add up to the weight."""
    x, (w_q, w_k, w_v), _ = make_inputs(40, (2,), 64, (32, 16, 16), torch.float32, "cpu", with_bias=False)
    _, k, v = qkv_proj(x, concat_qkv_weights(w_q, w_v, w_k), (32, 16, 16))
    _, k_ref, v_ref = qkv_proj_reference(x, w_q, w_k, w_v)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(k, k_ref)
    with pytest.raises(ValueError):
        qkv_proj(x, concat_qkv_weights(w_q, w_k, w_v), (32, 16, 8))


def test_custom_op_registration():
    device = "cuda" if CUDA else "cpu"
    x, weights, biases = make_inputs(50, (2,), 32, (16, 8, 8), torch.float32, device, with_bias=True)
    torch.library.opcheck(torch.ops.optiq.qkv_proj.default,
                          (x, concat_qkv_weights(*weights), arrival_counters(x.device), torch.cat(biases)), **OPCHECKS)


PRESETS = {  # name: (hidden, q heads, kv heads, head_dim)
    "qwen3-0.6b": (1024, 16, 8, 128),
    "llama-3.2-1b": (2048, 32, 8, 64),
    "llama-3.1-8b": (4096, 32, 8, 128),
    "qwen3-30b-a3b": (2048, 32, 4, 128),
}


@needs_cuda
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
def test_presets_cuda(preset, rows):
    hidden, heads_q, heads_kv, head_dim = PRESETS[preset]
    sizes = (heads_q * head_dim, heads_kv * head_dim, heads_kv * head_dim)
    check(seed=rows + hidden, leading=(rows,), hidden=hidden, sizes=sizes, dtype=torch.bfloat16, device="cuda")


@needs_cuda
def test_benchmark_case_cuda():
    case = benchmark_case(16, torch.bfloat16, "cuda")
    for got, want in zip(case["fused"](), case["eager"](), strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@needs_cuda
def test_cuda_graph_and_compile_cuda():
    sizes = (4096, 1024, 1024)
    x, weights, _ = make_inputs(60, (16,), 4096, sizes, torch.bfloat16, "cuda", with_bias=False)
    weight = concat_qkv_weights(*weights)
    assert_graph_replay_and_compile(lambda: qkv_proj(x, weight, sizes), lambda: x.copy_(torch.randn_like(x)))
