"""Static decode caches of the model families whose layers transformers' StaticCache cannot hold: each keeps a
family's decode state in device buffers of fixed shape, so the engine's steps capture in a CUDA graph and ``seek``
rewinds them, while the prefill stays the model's own (on its own cache, converted afterwards).

A family's cache is a ``StaticDecodeCache``, built as ``cache(model, batch, max_len, dtype, device)`` (allocating
everything).
"""

from __future__ import annotations

from typing import Callable

import torch

from optiq.decode_caches import deepseek_v4
from optiq.decode_caches.base import StaticDecodeCache

__all__ = ["FAMILIES", "StaticDecodeCache", "family_cache"]

FAMILIES: dict[str, tuple[type[StaticDecodeCache], Callable[[torch.nn.Module], str]]] = {
    "deepseek_v4": (deepseek_v4.StaticDeepseekV4Cache, deepseek_v4.problem),
}


def family_cache(model: torch.nn.Module) -> tuple[type[StaticDecodeCache] | None, str]:
    """The static decode cache of the model's family (None when it has none) and why it cannot decode this model
    ("" when it can)."""
    config = model.config.get_text_config(decoder=True)
    if config.model_type not in FAMILIES:
        return None, ""
    cache, problem = FAMILIES[config.model_type]
    return cache, problem(model)
