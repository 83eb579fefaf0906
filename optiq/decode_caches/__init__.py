"""Static decode caches of the model families whose layers transformers' StaticCache cannot hold: each keeps a
family's decode state in device buffers of fixed shape, so the engine's steps capture in a CUDA graph and ``seek``
rewinds them, while the prefill stays the model's own (on its own cache, converted afterwards).

A family's cache class is built as ``cache(model, batch, max_len, dtype, device)`` (allocating everything) and has
``prefill_cache(model)`` (the cache the prefill runs on), ``absorb(model, prefill_cache, length)``, ``seek(length)``
(raising OptiqError for a length it cannot rewind to) and ``step_kwargs`` (what a decode step's call adds).
"""

from __future__ import annotations

from typing import Callable

import torch

from optiq.decode_caches import deepseek_v4

FAMILIES: dict[str, tuple[type, Callable[[torch.nn.Module], str]]] = {
    "deepseek_v4": (deepseek_v4.StaticDeepseekV4Cache, deepseek_v4.problem),
}


def family_cache(model: torch.nn.Module) -> tuple[type | None, str]:
    """The static decode cache of the model's family (None when it has none) and why it cannot decode this model
    ("" when it can)."""
    config = model.config.get_text_config(decoder=True)
    if config.model_type not in FAMILIES:
        return None, ""
    cache, problem = FAMILIES[config.model_type]
    return cache, problem(model)
