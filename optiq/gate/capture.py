"""The real inputs of every patched site, recorded during one decode step of the unpatched model."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import Cache

from optiq.engine import DecodeEngine
from optiq.gate.plan import GatePlan
from optiq.patching import Patches
from optiq.patching.changes import Site


def _copy_cache(cache: Cache, dtype: torch.dtype | None) -> Cache:
    """A copy of a KV cache that owns its small state (the fill counters, which each call advances) and shares the
    keys and values, converted to ``dtype`` if given. Sharing is safe because a decode call writes its own token's
    position before it reads it, and a copy per call of every layer's keys and values would not fit (each decoder
    layer's call would hold the whole cache)."""
    copied = copy.copy(cache)
    copied.layers = []
    for layer in cache.layers:
        mine = copy.copy(layer)
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                shared = name in ("keys", "values")
                setattr(mine, name, value.clone() if not shared else value if dtype is None else value.to(dtype))
        copied.layers.append(mine)
    return copied


def fresh(value: Any, dtype: torch.dtype | None = None) -> Any:
    """A private copy of captured call arguments: tensors cloned (floating ones cast to ``dtype``), caches copied
    (_copy_cache); modules, configs and functions shared."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value.clone()
    if isinstance(value, Cache):
        return _copy_cache(value, dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(fresh(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: fresh(v, dtype) for k, v in value.items()}
    return value


def tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a call's output, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    return []


def prompt(model: torch.nn.Module, batch: int, length: int, seed: int) -> torch.Tensor:
    """The gate's random prompt: the first ``batch`` sequences are the same for every batch of the same seed."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def capture_inputs(patches: Patches, plan: GatePlan) -> dict[str, list[tuple[Site, list]]]:
    """Inputs of every site of every applied recipe during one decode step of the unpatched model, at the largest
    concurrency: {recipe: [(site, [(args, kwargs) per call])]}."""
    model, batch = patches.model, max(plan.concurrencies)
    with patches.suspended():
        engine = DecodeEngine(model, batch, plan.capture_cache_len)
        engine.prefill(prompt(model, batch, plan.prompt_len, plan.seed))
        captured, changes = {}, []
        for name, applied in patches.applied.items():
            captured[name] = [(site, []) for site in applied.sites]
            changes += [site.bind(applied.kind.recorder(site.original, calls, fresh))
                        for site, calls in captured[name]]
        for change in changes:
            change.redo()
        try:
            engine.step()
        finally:
            for change in reversed(changes):
                change.undo()
    return captured
