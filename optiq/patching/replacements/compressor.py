"""DeepSeek-V4's compressed entries (``optiq.decode_caches.deepseek_v4.pool_window``, called by optiq's static
cache of the family at every decode step) through a fused softmax-weighted pooling."""

from __future__ import annotations

import torch


def pool_window_function(original, fusion):
    """``pool_window(window_kv, window_gate)``: [batch, slots, head_dim] each -> [batch, head_dim] in kv's dtype.
    Calls the fusion does not take (other ranks or shapes, float64 as in the gate's reference) go to ``original``."""

    def pool_window(window_kv: torch.Tensor, window_gate: torch.Tensor) -> torch.Tensor:
        if (window_kv.ndim != 3 or window_gate.shape != window_kv.shape or torch.float64 in
                (window_kv.dtype, window_gate.dtype)):
            return original(window_kv, window_gate)
        return fusion(window_kv.contiguous(), window_gate.contiguous())

    return pool_window
