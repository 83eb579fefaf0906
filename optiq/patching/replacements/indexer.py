"""Lightning-indexer scorers (``structure.indexer_scorer``, DeepSeek-V4's CSA) through a fused scoring kernel that
multiplies on bf16 tensor cores what HF multiplies in fp32: a precision flip."""

from __future__ import annotations

import torch

from optiq.patching.structure import indexer_scorer


def indexer_scores_forward(module: torch.nn.Module, fusion):
    """A decode step's scores (one query position) from the module's own head-weight projection (looked up at call
    time, so a linear recipe applies underneath) and the fusion, which takes the projection's output in its dtype
    and the two scales as one. A prefill's many positions go to the module's own forward: the kernel takes one query
    position a sequence, and the gate checks the calls of decode steps only."""
    site = indexer_scorer(module)
    if site is None:
        raise ValueError(f"{type(module).__name__} does not compute a lightning indexer's scores")
    own_forward = type(module).forward.__get__(module)

    def forward(q: torch.Tensor, compressed_kv: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if q.shape[1] != 1:
            return own_forward(q, compressed_kv, hidden_states)
        weights = getattr(module, site.projection)(hidden_states[:, 0])  # [B, H]
        return fusion(q[:, 0], compressed_kv, weights, site.scale).unsqueeze(1)

    return forward
