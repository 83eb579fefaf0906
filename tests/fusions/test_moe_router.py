"""moe_router against HF's routing in float64: top-k sets and order, ties to the lower expert index, renormalisation
and scaling, the fused bf16 logits GEMM; on CUDA also against torch.topk itself, whose tie order is the model's.

CPU cases run under the Triton interpreter at small, odd shapes; CUDA cases use Qwen3-30B-A3B's and DeepSeek-V2-Lite's.
"""

import pytest
import torch
import torch.nn.functional as F

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


def v4_expected(logits, top_k, bias=None, ids=None, table=None, scale=1.5):
    """DeepSeek-V4's routing in float64 from the scores the model compares (sqrt(softplus) rounded twice to the logits'
    dtype, as torch rounds each op), ties to the lower index, weights renormalised with its 1e-20."""
    scores = F.softplus(logits).sqrt().double()
    keys = scores if bias is None else scores + bias.double()
    index = table[ids] if table is not None else torch.sort(-keys, dim=-1, stable=True).indices[:, :top_k]
    top = scores.gather(-1, index)
    return top / (top.sum(-1, keepdim=True) + 1e-20) * scale, index


def v4_route(logits, top_k, **kwargs):
    return route(logits, top_k, renormalize=True, scale=1.5, score="sqrtsoftplus", eps=1e-20, **kwargs)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (17, 24, 6)])
def test_sqrtsoftplus_with_selection_bias(request, dtype, tokens, experts, top_k):
    """V4's learned routing: experts chosen on score + a per-expert bias (random, of either sign, large enough to
    reorder the choice), weighted by their scores alone; the logits span softplus's regimes (-30 to 25)."""
    gen = torch.Generator().manual_seed(seed_of(request))
    logits = (torch.randn(tokens, experts, generator=gen) * 8).clamp(-30, 25).to(SMALL_DEVICE, dtype)
    bias = (torch.randn(experts, generator=gen) * 2).to(SMALL_DEVICE)
    weights, index = v4_route(logits, top_k, out_dtype=torch.float32, bias=bias)
    want_weights, want_index = v4_expected(logits, top_k, bias)
    assert torch.equal(index.cpu(), want_index.cpu())
    torch.testing.assert_close(weights.double(), want_weights, rtol=1e-6, atol=1e-6)
    assert not torch.equal(index, v4_route(logits, top_k, out_dtype=torch.float32)[1])  # the bias did choose


def test_sqrtsoftplus_scores_round_as_torch(request):
    """Every expert chosen, no renormalisation: the weights are the scores themselves, bit for bit torch's bf16
    sqrt(softplus), across softplus's regimes (log1p of tiny exp(x), past its threshold of 20)."""
    gen = torch.Generator().manual_seed(seed_of(request))
    logits = torch.cat([torch.linspace(-40, 30, 61), torch.randn(3) * 4]).view(2, 32).to(SMALL_DEVICE, torch.bfloat16)
    weights, index = route(logits, 32, score="sqrtsoftplus", out_dtype=torch.float32)
    want = F.softplus(logits).sqrt().float()
    assert torch.equal(weights, want.gather(-1, index))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hashed_routing_reads_the_table(request, dtype):
    """V4's hash routing: the experts are row ids[t] of the token -> experts table (no choice made), the weights the
    scores of those experts, renormalised and scaled."""
    gen = torch.Generator().manual_seed(seed_of(request))
    tokens, experts, top_k, vocab = 19, 16, 4, 50
    logits = torch.randn(tokens, experts, generator=gen).to(SMALL_DEVICE, dtype)
    table = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(vocab)]).to(SMALL_DEVICE)
    ids = torch.randint(vocab, (tokens,), generator=gen).to(SMALL_DEVICE)
    weights, index = v4_route(logits, top_k, out_dtype=torch.float32, ids=ids, table=table)
    want_weights, want_index = v4_expected(logits, top_k, ids=ids, table=table)
    assert torch.equal(index, want_index)
    torch.testing.assert_close(weights.double(), want_weights, rtol=1e-6, atol=1e-6)
    with pytest.raises(AssertionError):  # a kernel reading the next token's row would be told apart
        torch.testing.assert_close(v4_route(logits, top_k, out_dtype=torch.float32, ids=ids.roll(1),
                                            table=table)[0].double(), want_weights, rtol=1e-6, atol=1e-6)


def test_v4_reference_is_hf_routing(request):
    """route_reference's V4 path is DeepseekV4TopKRouter's own forward (same logits, bias, scale) on the CPU."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter
    config = DeepseekV4Config(hidden_size=32, num_local_experts=16, num_experts_per_tok=4)
    torch.manual_seed(seed_of(request))
    router = DeepseekV4TopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.normal_()
    hidden = torch.randn(5, 32)
    logits, weights, index = router(hidden)
    want_weights, want_index = route_reference(logits, 4, True, config.routed_scaling_factor, score="sqrtsoftplus",
                                               eps=1e-20, bias=router.e_score_correction_bias)
    assert torch.equal(index.sort(-1).values, want_index.sort(-1).values)
    torch.testing.assert_close(weights.gather(-1, index.argsort(-1)), want_weights.gather(-1, want_index.argsort(-1)))


def v3_expected(logits, top_k, bias, groups, topk_group, group_top=2, scale=2.5):
    """DeepSeek-V3's routing in float64 with its rules spelled out: sigmoid scores, groups ranked by the sum of their
    ``group_top`` best score + bias, experts of the kept groups by score + bias (ties to the lower index, groups and
    experts), weighted by their scores, renormalised and scaled."""
    scores = logits.double().sigmoid()
    keys = scores + bias.double()
    size = logits.shape[-1] // groups
    group_scores = keys.view(len(keys), groups, size).sort(-1, descending=True).values[..., :group_top].sum(-1)
    kept = torch.sort(-group_scores, dim=-1, stable=True).indices[:, :topk_group]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    keys = keys.masked_fill(~allowed.repeat_interleave(size, dim=-1), float("-inf"))
    index = torch.sort(-keys, dim=-1, stable=True).indices[:, :top_k]
    top = scores.gather(-1, index)
    return top / top.sum(-1, keepdim=True) * scale, index


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("tokens, experts, top_k, groups, topk_group, group_top", [
    (1, 16, 4, 1, 1, 2), (3, 32, 6, 4, 2, 2), (17, 64, 8, 8, 3, 2), (5, 16, 2, 8, 8, 2), (17, 64, 6, 8, 3, 1),
])
def test_sigmoid_routing_in_groups_with_selection_bias(request, tokens, experts, top_k, groups, topk_group,
                                                       group_top):
    """DeepSeek-V3's learned routing: experts chosen on sigmoid + bias within the best groups (scored by their two
    best, or by their best as V2's group-limited greedy); a bias large enough to reorder the choice, and the groups
    kept must change the experts (else the case proves nothing)."""
    gen = torch.Generator().manual_seed(seed_of(request))
    logits = (torch.randn(tokens, experts, generator=gen) * 3).to(SMALL_DEVICE)
    bias = (torch.randn(experts, generator=gen) * 0.5).to(SMALL_DEVICE)
    weights, index = route(logits, top_k, True, 2.5, score="sigmoid", bias=bias, groups=groups,
                           topk_group=topk_group, group_top=group_top)
    want_weights, want_index = v3_expected(logits, top_k, bias, groups, topk_group, group_top)
    assert torch.equal(index.cpu(), want_index.cpu()), f"{index.tolist()} != {want_index.tolist()}"
    torch.testing.assert_close(weights.double(), want_weights, rtol=1e-6, atol=1e-6)
    if topk_group < groups:
        assert not torch.equal(index, route(logits, top_k, True, 2.5, score="sigmoid", bias=bias)[1])


def test_v3_reference_is_hf_routing(request):
    """route_reference's sigmoid, group-limited path is DeepseekV3TopkRouter's own forward on the CPU."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    config = DeepseekV3Config(hidden_size=32, n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2)
    torch.manual_seed(seed_of(request))
    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.normal_(std=0.5)
    logits, weights, index = router(torch.randn(5, 32))
    want_weights, want_index = route_reference(logits, 4, True, config.routed_scaling_factor, score="sigmoid",
                                               eps=1e-20, bias=router.e_score_correction_bias, groups=4,
                                               topk_group=2)
    assert torch.equal(index.sort(-1).values, want_index.sort(-1).values)
    torch.testing.assert_close(weights.gather(-1, index.argsort(-1)), want_weights.gather(-1, want_index.argsort(-1)))


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_v4_flash_router_cuda(tokens):
    """At V4-Flash's router (256 experts, top 6, bf16 logits, a selection bias): the experts torch chooses on CUDA,
    their weights within bf16's rounding of the model's chain."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, 256, generator=gen, device="cuda").to(torch.bfloat16)
    bias = torch.randn(256, generator=gen, device="cuda") * 0.1
    weights, index = v4_route(logits, 6, bias=bias)
    want_weights, want_index = route_reference(logits, 6, True, 1.5, score="sqrtsoftplus", eps=1e-20, bias=bias)
    by_id, want_by_id = index.argsort(-1), want_index.argsort(-1)
    assert torch.equal(index.gather(-1, by_id), want_index.gather(-1, want_by_id))
    torch.testing.assert_close(weights.gather(-1, by_id).float(), want_weights.gather(-1, want_by_id).float(),
                               rtol=2 * TOLERANCES[torch.bfloat16], atol=0)
    assert_graph_replay_and_compile(lambda: v4_route(logits, 6, bias=bias),
                                    lambda: logits.copy_(logits.roll(1, dims=1)))


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
    ("moe_route", lambda: (make_logits(1, 3, 8, torch.float32, SMALL_DEVICE), 2, True, 1.0, torch.float32, 0, 0.0,
                           None, None, None)),
    ("moe_route", lambda: (make_logits(1, 3, 8, torch.bfloat16, SMALL_DEVICE), 2, True, 1.5, torch.bfloat16, 1,
                           1e-20, torch.randn(8, device=SMALL_DEVICE), None, None)),
    ("moe_route_gemm", lambda: (torch.randn(3, 32, device=SMALL_DEVICE), torch.randn(8, 32, device=SMALL_DEVICE),
                                2, False, 1.0, torch.float32)),
])
def test_custom_op_registration(op, args):
    torch.library.opcheck(getattr(torch.ops.optiq, op).default, args(), **OPCHECKS)
