"""The decode engine's greedy pick through a fused argmax."""

from __future__ import annotations

import torch


def greedy_sample_function(original, fusion):
    """``optiq.engine.sample_greedy``: logits [batch, vocab] -> token ids [batch, 1] (int64)."""

    def sample(logits: torch.Tensor) -> torch.Tensor:
        return fusion(logits).unsqueeze(-1)

    return sample
