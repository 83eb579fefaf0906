"""apply_rotary_pos_emb through a fused rotary kernel."""

from __future__ import annotations

import torch


def rope_function(original, fusion):
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``; other layouts go to ``original``.

    The fusion rotates q and k in place: HF's callers never read q or k again before their rotation's result."""

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1):
        if unsqueeze_dim != 1:
            return original(q, k, cos, sin, unsqueeze_dim)
        return fusion(q, k, cos, sin)

    return apply_rotary_pos_emb
