"""The MoE experts of the gate's fp32 reference on a GPU: in a decode step every expert runs on every token in two
batched GEMMs and the routing weights (zero for an expert a token did not pick) sum them, instead of transformers'
loop over the experts hit.

That loop sizes itself on the host (``nonzero``), and transformers' grouped-GEMM path copies offsets from the host in
fp32, so the reference's decode step could not be captured in a CUDA graph and ran eager, each step also casting
every layer's experts to fp32: most of a MoE model's gate (BENCHMARKS.md has the figures). At a serving batch a
step's picks hit nearly every expert anyway, so computing all of them adds little work and needs no host. The weights
stay bf16 and the products come from bf16 parts of the fp32 activations (``split_matmul``), a few millionths from the
exact ones. A prompt (more than DENSE_TOKENS tokens) loops over the experts it hits, with the same products. The
gate's float64 run of a module that holds experts (moe_experts, a decoder layer) runs them so too, on float64
copies: transformers' loop synchronises with the host several times per expert hit.
"""

from __future__ import annotations

import torch

from optiq.gate.references import split_matmul
from optiq.patching.structure import experts_gate

DENSE_TOKENS = 256  # a decode step has one token per sequence; prompts have thousands


def _from_parts(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.is_cuda and x.dtype == torch.float32


def _product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` in x's dtype: from bf16 parts on the tensor cores for a bf16 CUDA weight, else cast."""
    if _from_parts(x, weight):
        return split_matmul.matmul(x, weight)
    return x @ weight.to(x.dtype).transpose(-1, -2)


def experts_forward(experts: torch.nn.Module):
    """The call of a SwiGLU experts module (gate_up_proj [E, 2I, H], down_proj [E, H, I]): tokens [T, H], top-k
    expert ids and routing weights [T, k] -> [T, H], computed in the tokens' dtype with the weights as they lie.
    Ids equal to E pick no expert (transformers' convention for an expert that is not on this rank)."""

    gate = experts_gate(experts)  # DeepSeek-V4's clamps included

    def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return _product(gate(_product(x, gate_up)), down)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, count = hidden_states.shape[0], experts.gate_up_proj.shape[0]
        routing = hidden_states.new_zeros(tokens, count + 1).scatter_add_(
            1, top_k_index, top_k_weights.to(hidden_states.dtype))[:, :count]  # [T, E]
        # every expert at once, unless that casts every expert's weights (a float64 run of bf16 experts)
        uncast = experts.gate_up_proj.dtype == hidden_states.dtype or _from_parts(hidden_states, experts.gate_up_proj)
        if tokens <= DENSE_TOKENS and uncast:
            every = swiglu(hidden_states, experts.gate_up_proj, experts.down_proj)  # [E, T, H]
            return (every * routing.t().unsqueeze(-1)).sum(0)
        # A prompt, or weights to cast: the (token, pick) pairs sorted by expert, then one GEMM pair per expert hit
        # (one host sync), casting that expert's weights only.
        out = torch.zeros_like(hidden_states)
        ids = top_k_index.flatten()
        order = ids.argsort(stable=True)
        counts = torch.bincount(ids, minlength=count + 1)[:count].tolist()
        start = 0
        for expert, n in enumerate(counts):
            if n:
                pairs = order[start:start + n]
                rows = pairs // top_k_index.shape[1]
                y = swiglu(hidden_states[rows], experts.gate_up_proj[expert], experts.down_proj[expert])
                out.index_add_(0, rows, y * routing[rows, expert, None])
            start += n
        return out

    return forward
