"""apply_rotary_pos_emb through a fused rotary kernel."""

from __future__ import annotations

import inspect

import torch

HF_SIGNATURE = ("q", "k", "cos", "sin")  # the llama family's apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)


def rope_function(original, fusion):
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (rotate-half layout); other layouts go to
    ``original``. With partial rotary (cos narrower than a head: GPT-NeoX, GLM, Phi) the kernel rotates the leading
    dims in place and the rest pass, as HF's split and concatenation do; the gate catches a layout it does not know
    (interleaved pairs).

    The fusion rotates q and k in place: HF's callers never read q or k again before their rotation's result."""
    params = tuple(inspect.signature(original).parameters)
    if params[:4] != HF_SIGNATURE:
        raise ValueError(f"{original.__module__}.{original.__name__} takes ({', '.join(params)}), not "
                         f"({', '.join(HF_SIGNATURE)}, ...)")

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args,
                             **kwargs):
        unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        if unsqueeze_dim != 1 or len(args) > 1 or set(kwargs) - {"unsqueeze_dim"} or q.shape[-1] != k.shape[-1]:
            return original(q, k, cos, sin, *args, **kwargs)
        rotated = cos.shape[-1]
        if rotated == q.shape[-1]:
            return fusion(q, k, cos, sin)
        fusion(q[..., :rotated], k[..., :rotated], cos, sin)
        return q, k

    return apply_rotary_pos_emb
