"""MoE top-k routers (transformers 5: the router returns logits, top-k weights and top-k expert ids) through a fused
routing kernel, with the logits as the model computes them or, for routers HF runs in fp32, from a bf16 GEMM.

Softmax routers (Qwen3-MoE, DeepSeek-V2) and DeepSeek-V4's: scores from a ``score_fn`` that computes sqrt(softplus),
experts chosen on the scores plus the ``e_score_correction_bias`` buffer, or read from the ``tid2eid`` table for the
token (hash routing, whose forward also takes the input ids), always renormalised with 1e-20 added to the sum."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

V4_EPS = 1e-20  # what DeepSeek-V4's routers add to the sum of the chosen scores before dividing by it


@dataclass
class Routing:
    """How one router routes, as the fused kernel takes it."""
    fp32_logits: bool  # the logits GEMM runs on fp32 operands (DeepSeek-V2 casts both)
    renormalize: bool
    scale: float
    score: str = "softmax"
    eps: float = 0.0
    bias: torch.Tensor | None = None  # added to the scores to choose, not to weigh
    table: torch.Tensor | None = None  # token id -> experts

    def extras(self, input_ids: torch.Tensor | None) -> dict:
        """The kernel's keyword arguments beyond a softmax router's."""
        if self.score == "softmax":
            return {}
        hashed = {"ids": input_ids.reshape(-1), "table": self.table} if self.table is not None else {}
        return {"score": self.score, "eps": self.eps, "bias": self.bias, **hashed}


def _scores_by(router: torch.nn.Module) -> str:
    """'softmax' for a router without a score function, 'sqrtsoftplus' for one whose score function computes
    sqrt(softplus(x)) (probed on values across softplus's range); ValueError for any other."""
    score_fn = getattr(router, "score_fn", None)
    if score_fn is None:
        return "softmax"
    probe = torch.linspace(-30, 30, 121, device=router.weight.device, dtype=router.weight.dtype)
    if torch.equal(score_fn(probe), F.softplus(probe).sqrt()):
        return "sqrtsoftplus"
    raise ValueError(f"{type(router).__name__} scores its logits by {type(score_fn).__name__}, not softmax or "
                     f"sqrt(softplus)")


def _routing(router: torch.nn.Module) -> Routing:
    """How ``router`` routes; ValueError for routing this does not do."""
    method = getattr(router, "topk_method", "greedy")
    if method != "greedy":
        raise ValueError(f"{type(router).__name__} routes by '{method}', not a plain top-k")
    if not {"weight"} == {n for n, _ in router.named_parameters()}:
        raise ValueError(f"{type(router).__name__} has parameters besides its weight (a bias or correction term)")
    scale = float(getattr(router, "routed_scaling_factor", 1.0))
    score = _scores_by(router)
    if score == "softmax":
        fp32_logits = hasattr(router, "routed_scaling_factor")  # DeepSeek-V2's router casts both operands to fp32
        return Routing(fp32_logits, bool(getattr(router, "norm_topk_prob", False)), scale)
    return Routing(False, True, scale, score, V4_EPS, getattr(router, "e_score_correction_bias", None),
                   getattr(router, "tid2eid", None))


def router_forward(router: torch.nn.Module, fusion):
    """The router's own logits GEMM, then the scores, top-k (or the hash table's experts), renormalisation and
    scaling in one kernel."""
    routing = _routing(router)

    def forward(hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None):
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        if routing.fp32_logits:
            logits = F.linear(hidden.float(), router.weight.float())
        else:
            logits = F.linear(hidden, router.weight)
        weights, index = fusion(logits, router.top_k, routing.renormalize, routing.scale,
                                torch.float32 if routing.fp32_logits else None, **routing.extras(input_ids))
        return logits, weights, index

    return forward


def router_bf16_forward(router: torch.nn.Module, fusion):
    """Precision flip: the logits of a router HF computes in fp32 from a bf16 GEMM with fp32 accumulation, fused with
    the routing. bf16 weights are read as they lie; fp32 ones are rounded to bf16 here, once."""
    routing = _routing(router)
    if not routing.fp32_logits:
        raise ValueError(f"{type(router).__name__} computes its logits in the model's dtype: nothing to flip")
    weight = router.weight if router.weight.dtype == torch.bfloat16 else router.weight.detach().to(torch.bfloat16)

    def forward(hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, router.hidden_dim).to(torch.bfloat16)
        return fusion(hidden, weight, router.top_k, routing.renormalize, routing.scale)

    return forward
