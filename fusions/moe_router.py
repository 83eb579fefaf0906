"""MoE routing in one kernel: scores over the experts, top-k, optional renormalisation and scaling, one cast.

HF's top-k routers spend 4-9 kernels per layer on this (softmax, topk, sum and divide or multiply, cast): at decode,
launches rather than bytes. The scores are a softmax (Qwen3-MoE, Mixtral, DeepSeek-V2), a sigmoid (DeepSeek-V3) or
DeepSeek-V4's sqrt(softplus), the last two rounded to the logits' dtype as the model rounds them (so the choice is
made on the values the model compares). The experts may be chosen on the scores plus a per-expert selection bias
that does not enter the weights (V3's and V4's correction term), among the best groups of experts only (DeepSeek's
group-limited choice), or not chosen at all but read from a token -> experts table (V4's hash routing), the weights
still the scores of those experts. Two entry points share the routing kernel:

- ``route(logits, ...)`` takes the logits as the model computed them (Qwen3-MoE's bf16 F.linear). Equal logits give
  equal probabilities here as in torch, and among equal probabilities the lower expert index is taken first, the
  rule torch.topk follows on CUDA (the values above the k-th, then those equal to it, each in index order): the chosen
  experts are the model's own, ties included.
- ``route_from_hidden(hidden, weight, ...)`` first computes the logits with bf16 tensor-core dots and fp32
  accumulation, split over the hidden dimension (a kernel of its own; the routing kernel adds the splits in a fixed
  order): the precision flip for routers that HF runs in fp32 (DeepSeek-V2 casts both operands to fp32 and runs a
  SIMT GEMM). bf16 operands multiply exactly in fp32, so with bf16 weights only the summation order changes; fp32
  weights are rounded to bf16 once, by the caller.

Weights come out [T, k] in descending order (lower index first among equal weights), expert ids [T, k] int64.
A routing program takes BLOCK_T tokens over all experts (E <= 1024), so the top-k needs no second pass.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from optiq.fusions.gate_up_swiglu import dot_accumulate, fp32_dot
from optiq.fusions.launch import launch_options, wait_for_predecessor
from optiq.fusions.rounding import round_to

BLOCK_T = 16  # tokens per program: the smallest M tile of tl.dot
BLOCK_K = 64
SPLIT_K = 128  # hidden columns per program of the logits GEMM: 16 programs per 64 experts at DeepSeek-V2's 2048


@triton.jit
def _moe_router_gemm_kernel(
    h_ptr, w_ptr, partial_ptr, T, E, K, stride_h, stride_w,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """partial[split, BLOCK_T tokens, BLOCK_E experts] = h @ w.T over the split's SPLIT_K columns (fp32). The logits
    GEMM is split over K so that its few hundred KB of weights stream through many SMs instead of one."""
    wait_for_predecessor(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    experts = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
    cols_k = split * SPLIT_K + tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + cols_k[None, :]
    w_ptrs = w_ptr + experts[None, :].to(tl.int64) * stride_w + cols_k[:, None]
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, SPLIT_K, BLOCK_K):
        k_mask = cols_k + k0 < K
        h = tl.load(h_ptrs, mask=(rows[:, None] < T) & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=(experts[None, :] < E) & k_mask[:, None], other=0.0)
        acc = dot_accumulate(h, w, acc, FP32_DOT)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(partial_ptr + (split * T + rows[:, None]).to(tl.int64) * E + experts[None, :], acc,
             mask=(rows[:, None] < T) & (experts[None, :] < E))


SCORES = {"softmax": 0, "sqrtsoftplus": 1, "sigmoid": 2}  # the kernel's SCORE


@triton.jit
def sqrt_softplus(logits, ROUND_TO: tl.constexpr):
    """sqrt(softplus(x)) as torch computes it in ROUND_TO: softplus (x past 20 as itself, else log1p(exp(x)),
    log1p written out so that tiny exp(x) are not lost to 1 + y) rounded, then its square root rounded."""
    y = tl.exp(-tl.abs(logits))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    softplus = tl.where(logits > 20.0, logits, tl.maximum(logits, 0.0) + log1p)
    return round_to(tl.sqrt_rn(round_to(softplus, ROUND_TO)), ROUND_TO)


@triton.jit
def _keep_top_groups(keys, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, GROUPS: tl.constexpr,
                     TOPK_GROUP: tl.constexpr, GROUP_TOP: tl.constexpr):
    """keys [BLOCK_T, BLOCK_E] with every expert outside its token's TOPK_GROUP best groups (of GROUPS equal runs of
    experts, a group's score its best key (GROUP_TOP 1: DeepSeek-V2) or the sum of its two best (2: V3)) set to
    -inf: the group-limited choice. Among equal group scores the lower group is kept first."""
    SIZE: tl.constexpr = BLOCK_E // GROUPS
    grouped = tl.reshape(keys, (BLOCK_T, GROUPS, SIZE))
    inner = tl.arange(0, SIZE)
    first = tl.max(grouped, axis=2)
    first_at = tl.min(tl.where(grouped == first[:, :, None], inner[None, None, :], SIZE), axis=2)
    group_scores = first
    if GROUP_TOP == 2:
        group_scores += tl.max(tl.where(inner[None, None, :] == first_at[:, :, None], float("-inf"), grouped), axis=2)
    groups = tl.arange(0, GROUPS)
    kept = tl.zeros((BLOCK_T, GROUPS), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(group_scores, axis=1)
        pick = tl.min(tl.where(group_scores == best[:, None], groups[None, :], GROUPS), axis=1)
        kept = tl.where(groups[None, :] == pick[:, None], 1, kept)
        group_scores = tl.where(groups[None, :] == pick[:, None], float("-inf"), group_scores)
    keep = tl.reshape(tl.broadcast_to(kept[:, :, None], (BLOCK_T, GROUPS, SIZE)), (BLOCK_T, BLOCK_E))
    return tl.where(keep != 0, keys, float("-inf"))


@triton.jit
def _moe_routing_kernel(
    src_ptr, logits_ptr, weights_ptr, index_ptr, bias_ptr, ids_ptr, table_ptr, T, E, splits, scale, eps, stride_s,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, FROM_SPLITS: tl.constexpr, SCORE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HASHED: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
    GROUP_TOP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """weights, index [BLOCK_T, TOP_K] of BLOCK_T tokens; src is the logits [T, E], or (FROM_SPLITS) the router
    GEMM's partial sums [splits, T, E], added in split order and stored as the logits (fp32). The experts are the
    top TOP_K of score + bias (HAS_BIAS) within the TOPK_GROUP best of GROUPS groups (all when GROUPS is 1; a group
    scored by its GROUP_TOP best), or
    (HASHED) row ids[t] of table [V, TOP_K]; their weights are their scores, divided by (their sum + eps) if
    RENORMALIZE, times scale."""
    wait_for_predecessor(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    row_mask = rows < T
    expert_mask = experts < E
    mask = row_mask[:, None] & expert_mask[None, :]
    if FROM_SPLITS:
        offsets = rows[:, None].to(tl.int64) * E + experts[None, :]
        logits = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for split in range(splits):
            logits += tl.load(src_ptr + split * T * E + offsets, mask=mask, other=0.0)
        tl.store(logits_ptr + offsets, logits, mask=mask)
    else:
        logits = tl.load(src_ptr + rows[:, None].to(tl.int64) * stride_s + experts[None, :], mask=mask,
                         other=0.0).to(tl.float32)

    logits = tl.where(expert_mask[None, :], logits, float("-inf"))
    if SCORE == 0:
        numerators = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = numerators / tl.sum(numerators, axis=1)[:, None]
    elif SCORE == 1:
        scores = sqrt_softplus(logits, src_ptr.dtype.element_ty)
    else:  # sigmoid, rounded as torch rounds it in the logits' dtype
        scores = round_to(1.0 / (1.0 + tl.exp(-logits)), src_ptr.dtype.element_ty)
    keys = scores
    if HAS_BIAS:
        keys += tl.load(bias_ptr + experts, mask=expert_mask, other=0.0).to(tl.float32)[None, :]
    keys = tl.where(expert_mask[None, :], keys, float("-inf"))  # below every score: never chosen
    if GROUPS > 1:
        keys = _keep_top_groups(keys, BLOCK_T, BLOCK_E, GROUPS, TOPK_GROUP, GROUP_TOP)

    slots = tl.arange(0, BLOCK_S)
    top = tl.zeros((BLOCK_T, BLOCK_S), dtype=tl.float32)
    top_index = tl.zeros((BLOCK_T, BLOCK_S), dtype=tl.int32)
    if HASHED:
        ids = tl.load(ids_ptr + rows, mask=row_mask, other=0)
    for slot in tl.static_range(TOP_K):
        if HASHED:
            pick = tl.load(table_ptr + ids * TOP_K + slot, mask=row_mask, other=0).to(tl.int32)
        else:
            best = tl.max(keys, axis=1)
            pick = tl.min(tl.where(keys == best[:, None], experts[None, :], BLOCK_E), axis=1)
            keys = tl.where(experts[None, :] == pick[:, None], float("-inf"), keys)
        chosen = tl.sum(tl.where(experts[None, :] == pick[:, None], scores, 0.0), axis=1)
        top = tl.where(slots[None, :] == slot, chosen[:, None], top)
        top_index = tl.where(slots[None, :] == slot, pick[:, None], top_index)
    if RENORMALIZE:
        top = top / (tl.sum(top, axis=1)[:, None] + eps)  # the unused slots hold 0
    top = top * scale

    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    offsets = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    tl.store(weights_ptr + offsets, top.to(weights_ptr.dtype.element_ty), mask=out_mask)
    tl.store(index_ptr + offsets, top_index.to(tl.int64), mask=out_mask)


def _route(src: torch.Tensor, logits: torch.Tensor | None, splits: int, top_k: int, renormalize: bool,
           scale: float, out_dtype: torch.dtype, score: int = 0, eps: float = 0.0, bias: torch.Tensor | None = None,
           ids: torch.Tensor | None = None, table: torch.Tensor | None = None, groups: int = 1,
           topk_group: int = 1, group_top: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, experts = logits.shape if logits is not None else src.shape
    weights = torch.empty((tokens, top_k), dtype=out_dtype, device=src.device)
    index = torch.empty((tokens, top_k), dtype=torch.int64, device=src.device)
    torch.library.wrap_triton(_moe_routing_kernel)[(triton.cdiv(tokens, BLOCK_T),)](
        src, logits if logits is not None else src, weights, index, bias if bias is not None else src,
        ids if ids is not None else index, table if table is not None else index, tokens, experts, splits, scale,
        eps, src.stride(0), TOP_K=top_k, RENORMALIZE=renormalize, FROM_SPLITS=logits is not None, SCORE=score,
        HAS_BIAS=bias is not None, HASHED=table is not None, GROUPS=groups, TOPK_GROUP=topk_group,
        GROUP_TOP=group_top, BLOCK_T=BLOCK_T,
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_S=triton.next_power_of_2(top_k), num_warps=4,
        **launch_options(src),
    )
    return weights, index


@torch.library.triton_op("optiq::moe_route", mutates_args=())
def _moe_route_op(logits: torch.Tensor, top_k: int, renormalize: bool, scale: float, out_dtype: torch.dtype,
                  score: int, eps: float, bias: torch.Tensor | None, ids: torch.Tensor | None,
                  table: torch.Tensor | None, groups: int = 1, topk_group: int = 1, group_top: int = 2
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return _route(logits.contiguous(), None, 0, top_k, renormalize, scale, out_dtype, score, eps, bias,
                  ids.contiguous() if ids is not None else None, table.contiguous() if table is not None else None,
                  groups, topk_group, group_top)


@torch.library.triton_op("optiq::moe_route_gemm", mutates_args=())
def _moe_route_gemm_op(hidden: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, scale: float,
                       out_dtype: torch.dtype, score: int = 0, eps: float = 0.0, bias: torch.Tensor | None = None,
                       groups: int = 1, topk_group: int = 1, group_top: int = 2
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, weight = hidden.contiguous(), weight.contiguous()
    (tokens, hidden_size), experts = hidden.shape, weight.shape[0]
    splits = triton.cdiv(hidden_size, SPLIT_K)
    block_e = min(64, triton.next_power_of_2(experts))
    partial = torch.empty((splits, tokens, experts), dtype=torch.float32, device=hidden.device)
    torch.library.wrap_triton(_moe_router_gemm_kernel)[(triton.cdiv(tokens, BLOCK_T), splits,
                                                        triton.cdiv(experts, block_e))](
        hidden, weight, partial, tokens, experts, hidden_size, hidden.stride(0), weight.stride(0),
        BLOCK_T=BLOCK_T, BLOCK_E=block_e, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K,
        FP32_DOT=fp32_dot(hidden.dtype), num_warps=4, **launch_options(hidden),
    )
    logits = torch.empty((tokens, experts), dtype=torch.float32, device=hidden.device)
    weights, index = _route(partial, logits, splits, top_k, renormalize, scale, out_dtype, score, eps, bias,
                            groups=groups, topk_group=topk_group, group_top=group_top)
    return logits, weights, index


def _check(experts: int, top_k: int, score: str = "softmax", bias: torch.Tensor | None = None,
           groups: int = 1, topk_group: int = 1, group_top: int = 2) -> None:
    if not 0 < top_k <= experts or experts > 1024:
        raise ValueError(f"top-{top_k} of {experts} experts: need 0 < k <= experts <= 1024")
    if score not in SCORES:
        raise ValueError(f"score '{score}' is not one of {', '.join(SCORES)}")
    if bias is not None and bias.shape != (experts,):
        raise ValueError(f"bias {tuple(bias.shape)} is not [{experts}]")
    if groups > 1 and not (experts == triton.next_power_of_2(experts) and experts % groups == 0 and group_top in (1, 2)
                           and experts // groups >= group_top and 0 < topk_group <= groups):
        raise ValueError(f"{topk_group} of {groups} groups of {experts} experts: the groups must be equal powers of "
                         f"two of at least two experts")


def route(logits: torch.Tensor, top_k: int, renormalize: bool = False, scale: float = 1.0,
          out_dtype: torch.dtype | None = None, score: str = "softmax", eps: float = 0.0,
          bias: torch.Tensor | None = None, ids: torch.Tensor | None = None,
          table: torch.Tensor | None = None, groups: int = 1, topk_group: int = 1,
          group_top: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in ``out_dtype`` (default: the logits'), expert ids [T, k] int64): the top-k
    experts by ``score`` (softmax, sigmoid or sqrtsoftplus of the logits, in fp32 from values rounded as the model
    rounds them) plus ``bias`` [E] if given, among the ``topk_group`` best of ``groups`` groups (a group's score the
    sum of its ``group_top`` best), or those of row ``ids`` [T] of ``table`` [V, k] if given; their scores divided by (their
    sum + ``eps``) if ``renormalize``, times ``scale``."""
    _check(logits.shape[-1], top_k, score, bias, groups, topk_group, group_top)
    if (ids is None) != (table is None) or table is not None and (
            table.dim() != 2 or table.shape[1] != top_k or ids.shape != logits.shape[:1]):
        raise ValueError(f"ids and table go together, [{logits.shape[0]}] and [V, {top_k}]")
    return torch.ops.optiq.moe_route(logits, top_k, renormalize, scale, out_dtype or logits.dtype, SCORES[score],
                                     eps, bias, ids, table, groups, topk_group, group_top)


def route_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool = False,
                      scale: float = 1.0, out_dtype: torch.dtype = torch.float32, score: str = "softmax",
                      eps: float = 0.0, bias: torch.Tensor | None = None, groups: int = 1, topk_group: int = 1,
                      group_top: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [T, H], weight [E, H] (same dtype) -> (logits [T, E] fp32, weights [T, k], expert ids [T, k]): as
    ``route`` on hidden @ weight.T computed with fp32 accumulation."""
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1] or hidden.dtype != weight.dtype:
        raise ValueError(f"hidden {tuple(hidden.shape)} {hidden.dtype} and weight {tuple(weight.shape)} "
                         f"{weight.dtype} do not fit: need [T, H] and [E, H] of one dtype")
    _check(weight.shape[0], top_k, score, bias, groups, topk_group, group_top)
    return torch.ops.optiq.moe_route_gemm(hidden, weight, top_k, renormalize, scale, out_dtype, SCORES[score], eps,
                                          bias, groups, topk_group, group_top)


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool = False, scale: float = 1.0,
                    out_dtype: torch.dtype | None = None, score: str = "softmax", eps: float = 0.0,
                    bias: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                    table: torch.Tensor | None = None, groups: int = 1, topk_group: int = 1, group_top: int = 2
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """What HF's routers do, in torch ops (the benchmark's eager path and the tests' reference): softmax routers in
    fp32, sigmoid and DeepSeek-V4's sqrt(softplus) in the logits' dtype, DeepSeek-V2's and V3's group-limited
    choices."""
    if score == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif score == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = F.softplus(logits).sqrt()
    if table is not None:
        index = table[ids]
    else:
        keys = scores if bias is None else scores + bias
        if groups > 1:
            group_scores = keys.view(len(keys), groups, -1).topk(group_top, dim=-1).values.sum(dim=-1)
            kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
                1, group_scores.topk(topk_group, dim=-1).indices, True)
            keys = keys.masked_fill(~kept.repeat_interleave(keys.shape[-1] // groups, dim=-1), float("-inf"))
        index = torch.topk(keys, top_k, dim=-1).indices
    top = scores.gather(1, index)
    if renormalize:
        top = top / (top.sum(dim=-1, keepdim=True) + eps)
    return (top * scale).to(out_dtype or logits.dtype), index


def benchmark_case(rows: int, dtype: torch.dtype, device) -> dict:
    """Two cases at ``rows`` decode tokens: Qwen3-30B-A3B's router from its bf16 logits (128 experts, top 8,
    renormalised) and DeepSeek-V2-Lite's from the hidden states (64 experts, top 6), whose eager path is HF's fp32
    GEMM on cast operands."""
    gen = torch.Generator(device=device).manual_seed(rows)
    logits = torch.randn(rows, 128, generator=gen, device=device).to(dtype)
    hidden = torch.randn(rows, 2048, generator=gen, device=device).to(dtype)
    weight = (torch.randn(64, 2048, generator=gen, device=device) / 2048**0.5).to(dtype)

    def hf_fp32_router():
        logits32 = F.linear(hidden.float(), weight.float())
        return (logits32, *route_reference(logits32, 6, out_dtype=torch.float32))

    return {
        "moe_router": {
            "fused": lambda: route(logits, 8, renormalize=True),
            "eager": lambda: route_reference(logits, 8, renormalize=True),
            "bytes": logits.numel() * dtype.itemsize + rows * 8 * (dtype.itemsize + 8),
            "flops": 0,
        },
        "precision_flip": {
            "fused": lambda: route_from_hidden(hidden, weight, 6),
            "eager": hf_fp32_router,
            "bytes": (hidden.numel() + weight.numel()) * dtype.itemsize + rows * (64 * 4 + 6 * 12),
            "flops": 2 * rows * 64 * 2048,
        },
    }
