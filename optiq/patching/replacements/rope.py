"""apply_rotary_pos_emb through a fused rotary kernel."""

from __future__ import annotations

import inspect

import torch

from optiq.patching.structure import rotary_layout, takes_first

HF_SIGNATURE = ("q", "k", "cos", "sin")  # the llama family's apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
ONE_TENSOR_SIGNATURE = ("x", "cos", "sin")  # DeepSeek-V4's apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)


def _takes(original, signature: tuple[str, ...]) -> None:
    """Refuse a function whose leading parameters are not ``signature``: another rotation (a user recipe may name
    the function without its parameters)."""
    if not takes_first(original, signature):
        params = tuple(inspect.signature(original).parameters)
        raise ValueError(f"{original.__module__}.{original.__name__} takes ({', '.join(params)}), not "
                         f"({', '.join(signature)}, ...)")


def rope_function(original, fusion):
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` through the fused rotary kernel, in the layout
    the function turns heads of each (head width, cos width, dtype) in (``structure.rotary_layout``, found on the
    CPU at its first call: Llama's rotate_half, Cohere's and GLM's interleaved pairs, GPT-OSS's half-width cos, a
    partial rotary's leading channels, ...); a shape whose layout rope does not know, and calls of another form, go
    to ``original``.

    The fusion rotates q and k in place: HF's callers never read q or k again before their rotation's result."""
    _takes(original, HF_SIGNATURE)

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args,
                             **kwargs):
        unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        if (unsqueeze_dim != 1 or len(args) > 1 or set(kwargs) - {"unsqueeze_dim"} or q.shape[-1] != k.shape[-1]
                or q.ndim != 4 or cos.ndim != 3):
            return original(q, k, cos, sin, *args, **kwargs)
        layout = rotary_layout(original, q.shape[-1], cos.shape[-1], q.dtype)
        if layout is None:
            return original(q, k, cos, sin, *args, **kwargs)
        if layout.rotated == q.shape[-1]:
            return fusion(q, k, cos, sin, **layout.switches())
        fusion(q[..., :layout.rotated], k[..., :layout.rotated], cos, sin, **layout.switches())
        return q, k

    apply_rotary_pos_emb.__wrapped__ = original  # what rotary_layout probes, where another recipe looks it up
    return apply_rotary_pos_emb


def trailing_rope_function(original, fusion):
    """DeepSeek-V4's ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)``: one tensor [B, H, S, D], its last
    2 * cos.shape[-1] channels rotated as interleaved pairs with one cos / sin entry a pair, out of place. Calls of
    another form go to ``original``; a function of this signature with another layout is the gate's to catch."""
    _takes(original, ONE_TENSOR_SIGNATURE)

    def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args, **kwargs):
        unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        half = cos.shape[-1]
        if (unsqueeze_dim != 1 or len(args) > 1 or set(kwargs) - {"unsqueeze_dim"} or x.ndim != 4 or cos.ndim != 3
                or sin.shape != cos.shape or 2 * half > x.shape[-1] or half & (half - 1) or x.stride(-1) != 1):
            return original(x, cos, sin, *args, **kwargs)
        return fusion(x, cos.contiguous(), sin.contiguous())

    return apply_rotary_pos_emb
