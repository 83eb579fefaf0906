"""MoE top-k routers (transformers 5: the router returns logits, top-k weights and top-k expert ids) through a fused
routing kernel, with the logits as the model computes them or, for routers HF runs in fp32, from a bf16 GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _routing(router: torch.nn.Module) -> tuple[bool, bool, float]:
    """(logits in fp32, renormalise, scale) of a softmax top-k router; ValueError for routing this does not do."""
    method = getattr(router, "topk_method", "greedy")
    if method != "greedy":
        raise ValueError(f"{type(router).__name__} routes by '{method}', not a plain top-k")
    if not {"weight"} == {n for n, _ in router.named_parameters()}:
        raise ValueError(f"{type(router).__name__} has parameters besides its weight (a bias or correction term)")
    fp32_logits = hasattr(router, "routed_scaling_factor")  # DeepSeek's routers cast both operands to fp32
    return fp32_logits, bool(getattr(router, "norm_topk_prob", False)), float(getattr(router, "routed_scaling_factor",
                                                                                      1.0))


def router_forward(router: torch.nn.Module, fusion):
    """The router's own logits GEMM, then softmax, top-k, renormalisation and scaling in one kernel."""
    fp32_logits, renormalize, scale = _routing(router)

    def forward(hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        if fp32_logits:
            logits = F.linear(hidden.float(), router.weight.float())
        else:
            logits = F.linear(hidden, router.weight)
        weights, index = fusion(logits, router.top_k, renormalize, scale, torch.float32 if fp32_logits else None)
        return logits, weights, index

    return forward


def router_bf16_forward(router: torch.nn.Module, fusion):
    """Precision flip: the logits of a router HF computes in fp32 from a bf16 GEMM with fp32 accumulation, fused with
    the routing. bf16 weights are read as they lie; fp32 ones are rounded to bf16 here, once."""
    fp32_logits, renormalize, scale = _routing(router)
    if not fp32_logits:
        raise ValueError(f"{type(router).__name__} computes its logits in the model's dtype: nothing to flip")
    weight = router.weight if router.weight.dtype == torch.bfloat16 else router.weight.detach().to(torch.bfloat16)

    def forward(hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, router.hidden_dim).to(torch.bfloat16)
        return fusion(hidden, weight, router.top_k, renormalize, scale)

    return forward
