"""MoE top-k routers (transformers 5: the router returns logits, top-k weights and top-k expert ids) through a fused
routing kernel, with the logits as the model computes them or, for routers HF runs in fp32, from a bf16 GEMM.

What a router computes is found by running it (``structure.topk_router``): softmax, sigmoid or sqrt(softplus) scores;
experts chosen on the scores plus a selection bias buffer (DeepSeek-V3's and V4's correction term), within the best
groups (V2's and V3's group-limited choice), or read from a token -> experts table (V4's hash routing, whose forward
also takes the input ids); renormalised or not; scaled."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from optiq.patching.structure import RouterSite, fp32_topk_router, topk_router

RENORMALIZE_EPS = 1e-20  # what DeepSeek-V3's and V4's routers add to the sum of the chosen scores (none of softmax's)


def _site(router: torch.nn.Module, structure=topk_router) -> RouterSite:
    site = structure(router)
    if site is None:
        raise ValueError(f"{type(router).__name__} does not route as the routing kernel does (softmax, sigmoid or "
                         f"sqrt(softplus) top-k, a selection bias, groups or a hash table; fp32 logits to flip)")
    return site


def _routing_options(router: torch.nn.Module, site: RouterSite) -> dict:
    """The kernel's keyword arguments beyond a plain softmax top-k, with the router's buffers as they are now."""
    options = {"renormalize": site.renormalize, "scale": site.scale}
    if site.score != "softmax":
        options.update(score=site.score, eps=RENORMALIZE_EPS)
    if site.bias is not None:
        options["bias"] = getattr(router, site.bias)
    groups, kept, top = site.groups
    if groups > 1:
        options.update(groups=groups, topk_group=kept, group_top=top)
    return options


def router_forward(router: torch.nn.Module, fusion):
    """The router's own logits GEMM (on fp32 operands where it casts them), then the scores, top-k (or the hash table's
    experts), renormalisation and scaling in one kernel."""
    site = _site(router)

    def forward(hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None):
        hidden = hidden_states.reshape(-1, router.weight.shape[1])
        if site.logits == "fp32":
            logits = F.linear(hidden.float(), router.weight.float())
        else:
            logits = F.linear(hidden, router.weight)
            logits = logits.float() if site.logits == "cast" else logits
        hashed = {} if site.table is None else {"ids": input_ids.reshape(-1), "table": getattr(router, site.table)}
        weights, index = fusion(logits, site.top_k, out_dtype=torch.float32 if site.fp32_weights else logits.dtype,
                                **_routing_options(router, site), **hashed)
        return logits, weights, index

    return forward


def router_bf16_forward(router: torch.nn.Module, fusion):
    """Precision flip: the logits of a router HF computes in fp32 from a bf16 GEMM with fp32 accumulation, fused with
    the routing. bf16 weights are read as they lie; fp32 ones are rounded to bf16 here, once."""
    site = _site(router, fp32_topk_router)
    weight = router.weight if router.weight.dtype == torch.bfloat16 else router.weight.detach().to(torch.bfloat16)

    def forward(hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, weight.shape[1]).to(torch.bfloat16)
        return fusion(hidden, weight, site.top_k, out_dtype=torch.float32, **_routing_options(router, site))

    return forward
