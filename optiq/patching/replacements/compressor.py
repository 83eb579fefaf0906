"""DeepSeek-V4's compressed entries (``optiq.decode_caches.deepseek_v4.pool_position``, called by optiq's static
cache of the family at every decode step) through a fused softmax-weighted pooling that reads the window's slots
from the cache's per-position buffers itself."""

from __future__ import annotations

import torch


def pool_position_function(original, fusion):
    """``pool_position(kv, gate, positions, rate, overlap, rows, offsets)`` -> [batch, width - overlap] in kv's
    dtype. Calls the fusion does not take (float64, as in the gate's reference) go to ``original``."""

    def pool_position(kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, rate: int, overlap: int,
                      rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if torch.float64 in (kv.dtype, gate.dtype):
            return original(kv, gate, positions, rate, overlap, rows, offsets)
        return fusion(kv, gate, positions, rate, overlap)

    return pool_position
