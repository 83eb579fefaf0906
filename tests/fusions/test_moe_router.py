"""moe_router against HF's routing in float64: top-k sets and order, ties to the lower expert index, renormalisation
and scaling, the fused bf16 logits GEMM; on CUDA also against torch.topk itself, whose tie order is the model's.

CPU cases run under the Triton interpreter at small, odd shapes; CUDA cases use Qwen3-30B-A3B's and DeepSeek-V2-Lite's.
"""

import pytest
import torch

from optiq.fusions.moe_router import route, route_from_hidden, route_reference
from kernel_testing import CUDA, OPCHECKS, SMALL_DEVICE, assert_graph_replay_and_compile, needs_cuda, seed_of

TOLERANCES = {torch.float32: 1e-6, torch.bfloat16: 8e-3}


def make_logits(seed, tokens, experts, dtype, device, levels=None):
    """Random logits; with ``levels``, only that many distinct values, so most rows tie at the k-th value."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen) if levels is None else \
        torch.randint(0, levels, (tokens, experts), generator=gen) / levels
    return logits.to(device=device, dtype=dtype)


def expected(logits, top_k, renormalize, scale):
    """float64 routing with the tie rule spelled out: descending probability, the lower index first among equals."""
    probs = torch.softmax(logits.double(), dim=-1)
    order = torch.sort(-probs, dim=-1, stable=True).indices[:, :top_k]
    top = probs.gather(-1, order)
    if renormalize:
        top = top / top.sum(-1, keepdim=True)
    return top * scale, order


def check(got, logits, top_k, renormalize, scale, out_dtype):
    weights, index = got
    want_weights, want_index = expected(logits, top_k, renormalize, scale)
    assert index.dtype == torch.int64 and weights.dtype == out_dtype
    assert torch.equal(index.cpu(), want_index.cpu()), f"{index.tolist()} != {want_index.tolist()}"
    tolerance = TOLERANCES[out_dtype]
    torch.testing.assert_close(weights.double(), want_weights, rtol=tolerance, atol=tolerance)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("levels", [None, 4])
@pytest.mark.parametrize("tokens, experts, top_k, renormalize, scale", [
    (1, 8, 2, True, 1.0), (3, 6, 4, False, 2.5), (17, 5, 3, True, 1.0), (40, 128, 8, True, 1.0),
    (5, 64, 6, False, 16.0),
])
def test_route_matches_reference(request, tokens, experts, top_k, renormalize, scale, levels):
    """17 and 40 tokens span two and three programs; 5 and 6 experts leave masked lanes; 4 levels make most rows
    tie at the k-th value, where the lower index must win."""
    logits = make_logits(seed_of(request), tokens, experts, torch.float32, SMALL_DEVICE, levels)
    check(route(logits, top_k, renormalize, scale), logits, top_k, renormalize, scale, torch.float32)


@pytest.mark.parametrize("levels", [None, 4])
def test_route_bf16_logits_weights_in_their_dtype(request, levels):
    logits = make_logits(seed_of(request), 9, 16, torch.bfloat16, SMALL_DEVICE, levels)
    check(route(logits, 4, renormalize=True), logits, 4, True, 1.0, torch.bfloat16)
    check(route(logits, 4, out_dtype=torch.float32), logits, 4, False, 1.0, torch.float32)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, hidden", [(1, 8, 40), (19, 6, 130)])
def test_route_from_hidden(request, dtype, tokens, experts, hidden):
    """The logits come from the fused GEMM (K tails at 40 and 130), then route as from given logits."""
    gen = torch.Generator().manual_seed(seed_of(request))
    x = torch.randn(tokens, hidden, generator=gen).to(SMALL_DEVICE, dtype)
    weight = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(SMALL_DEVICE, dtype)
    logits, weights, index = route_from_hidden(x, weight, 3, renormalize=False, scale=1.5)
    want_logits = x.double() @ weight.double().T
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), want_logits, rtol=1e-5, atol=1e-5)
    check((weights, index), want_logits, 3, False, 1.5, torch.float32)


def test_wrong_answers_and_inputs_fail():
    """The comparison can fail: a top-k that breaks ties to the higher index, or skips the renormalisation, is told
    apart; shapes that do not fit are refused."""
    logits = make_logits(3, 6, 8, torch.float32, SMALL_DEVICE, levels=3)
    weights, index = route(logits, 3, renormalize=True)
    flipped = 7 - route(logits.flip(-1), 3, renormalize=True)[1]  # the same top-k, ties to the higher index
    with pytest.raises(AssertionError):
        check((weights, flipped), logits, 3, True, 1.0, torch.float32)
    with pytest.raises(AssertionError):
        check(route(logits, 3), logits, 3, True, 1.0, torch.float32)
    with pytest.raises(ValueError):
        route(logits, 9)
    with pytest.raises(ValueError):
        route_from_hidden(logits, logits.T, 2)


def test_reference_is_hf_routing(request):
    """route_reference (the benchmark's eager path) is HF's routing: it agrees with the spelled-out rule."""
    logits = make_logits(seed_of(request), 7, 16, torch.float32, SMALL_DEVICE)
    check(route_reference(logits, 4, renormalize=True), logits, 4, True, 1.0, torch.float32)


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 16, 64])
@pytest.mark.parametrize("levels", [None, 8])
def test_same_experts_as_torch_topk_cuda(tokens, levels):
    """At Qwen3-30B-A3B's router (128 experts, top 8, bf16 logits), including rows full of ties: the experts chosen
    and their weights are torch.topk's on CUDA, which is what the model computes. Their order within a row is not:
    torch.topk (measured on the H200) returns equal values in no fixed order, this kernel lower index first."""
    logits = make_logits(tokens, tokens, 128, torch.bfloat16, "cuda", levels)
    weights, index = route(logits, 8, renormalize=True)
    want_weights, want_index = route_reference(logits, 8, renormalize=True)
    by_id, want_by_id = index.argsort(-1), want_index.argsort(-1)
    assert torch.equal(index.gather(-1, by_id), want_index.gather(-1, want_by_id))
    torch.testing.assert_close(weights.gather(-1, by_id), want_weights.gather(-1, want_by_id),
                               rtol=TOLERANCES[torch.bfloat16], atol=0)


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64])
def test_deepseek_v2_lite_shapes_cuda(tokens):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 2048, generator=gen, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(64, 2048, generator=gen, device="cuda") / 2048**0.5).to(torch.bfloat16)
    logits, weights, index = route_from_hidden(x, weight, 6)
    want_logits = x.double() @ weight.double().T
    torch.testing.assert_close(logits.double(), want_logits, rtol=1e-5, atol=1e-5)
    check((weights, index), want_logits, 6, False, 1.0, torch.float32)


@needs_cuda
def test_cuda_graph_and_compile_cuda():
    logits = make_logits(5, 16, 128, torch.bfloat16, "cuda")
    assert_graph_replay_and_compile(lambda: route(logits, 8, renormalize=True),
                                    lambda: logits.copy_(logits.roll(1, dims=1)))
    x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16) / 2048**0.5
    assert_graph_replay_and_compile(lambda: route_from_hidden(x, weight, 6), lambda: x.copy_(x.roll(1, dims=0)))


@pytest.mark.parametrize("op, args", [
    ("moe_route", lambda: (make_logits(1, 3, 8, torch.float32, SMALL_DEVICE), 2, True, 1.0, torch.float32)),
    ("moe_route_gemm", lambda: (torch.randn(3, 32, device=SMALL_DEVICE), torch.randn(8, 32, device=SMALL_DEVICE),
                                2, False, 1.0, torch.float32)),
])
def test_custom_op_registration(op, args):
    torch.library.opcheck(getattr(torch.ops.optiq, op).default, args(), **OPCHECKS)
