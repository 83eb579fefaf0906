"""The real inputs of every patched site, recorded during one decode step of the unpatched model."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import Cache

from optiq.decode_caches import StaticDecodeCache
from optiq.engine import DecodeEngine
from optiq.gate.plan import GatePlan
from optiq.patching import Patches
from optiq.patching.changes import Site

CACHES = (Cache, StaticDecodeCache)  # the caches a captured call's copies copy


def _copy_cache(cache: Cache, dtype: torch.dtype | None, scale: float | None = None,
                layers: set[int] | None = None) -> Cache:
    """A copy of a KV cache that owns its small state (the fill counters, which each call advances) and shares the
    keys and values, converted to ``dtype`` or scaled by ``scale`` if given: those of ``layers`` only, when the call
    reads no other (every layer's in float64 is four times the cache: 100 GB for Phi-3-mini's at C = 64). Sharing is
    safe because a decode call writes its own token's position before it reads it, and a copy per call of every
    layer's keys and values would not fit (each decoder layer's call would hold the whole cache)."""
    copied = copy.copy(cache)
    copied.layers = []
    for index, layer in enumerate(cache.layers):
        mine = copy.copy(layer)
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                if not (name in ("keys", "values") or value.is_floating_point() and value.dim() >= 3):
                    value = value.clone()  # the fill counters; what else a layer caches (an indexer's keys) is data
                elif layers is None or index in layers:
                    value = value * scale if scale is not None else value.to(dtype) if dtype is not None else value
                setattr(mine, name, value)
        copied.layers.append(mine)
    return copied


def scaled_copy(value: Any, factor: float) -> Any:
    """A captured activation times ``factor``: a floating tensor, or a cache (its keys and values copied); anything
    else as it is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value * factor
    if isinstance(value, Cache):
        return _copy_cache(value, None, factor)
    if isinstance(value, StaticDecodeCache):
        return value.converted(scale=factor)
    return value


def fresh(value: Any, dtype: torch.dtype | None = None, layers: set[int] | None = None) -> Any:
    """A private copy of captured call arguments: tensors cloned (floating ones cast to ``dtype``), caches copied
    (_copy_cache, or a family's static cache converted, converting ``layers`` only when given); modules, configs
    and functions shared."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value.clone()
    if isinstance(value, Cache):
        return _copy_cache(value, dtype, layers=layers)
    if isinstance(value, StaticDecodeCache):
        return value.converted(dtype, layers=layers)
    if isinstance(value, (tuple, list)):
        return type(value)(fresh(v, dtype, layers) for v in value)
    if isinstance(value, dict):
        return {k: fresh(v, dtype, layers) for k, v in value.items()}
    return value


def layers_read(callee: Any, args: tuple, kwargs: dict) -> set[int] | None:
    """The cache layers a call may read: every int ``*layer_idx``/``*layer_index`` attribute (its own, and a layer
    it shares keys with) of the called module and the modules among its arguments, and of their submodules; None
    when none says, which means every layer."""
    modules = [m for m in (getattr(callee, "__self__", None), *args, *kwargs.values()) if isinstance(m, torch.nn.Module)]
    return {value for module in modules for sub in module.modules() for name, value in vars(sub).items()
            if name.endswith(("layer_idx", "layer_index")) and type(value) is int} or None


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


def _fill_to(engine: DecodeEngine, prompt: torch.Tensor, length: int) -> None:
    """Prefill ``prompt`` and bring the cache to ``length`` positions of real keys and values. A static cache's
    positions [P, length) are filled with copies of the prompt's own keys and values (a prefill that long would
    cost a long prompt's forward per concurrency); a cache the model makes itself, or a family's static cache
    (whose compressed entries are pooled from the positions before them), cannot be written so, and is prefilled
    with the prompt's tokens repeated to ``length``."""
    prompt_len = prompt.shape[1]
    if not engine.static or engine.family:
        engine.prefill(prompt.repeat(1, -(-length // prompt_len))[:, :length])
        return
    engine.prefill(prompt)
    for layer in engine.cache.layers:
        for cached in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if cached is None:  # a layer that stores nothing of its own
                continue
            end = min(length, cached.shape[2])
            for start in range(prompt_len, end, prompt_len):
                width = min(prompt_len, end - start)
                cached[:, :, start:start + width].copy_(cached[:, :, :width])
    engine.seek(length)


def capture_inputs(patches: Patches, plan: GatePlan, batch: int, context: int) -> dict[str, list[tuple[Site, list]]]:
    """Inputs of every site of every applied recipe during one decode step of the unpatched model at ``batch``
    sequences, the step's token at position ``context - 1`` of a cache of the plan's longest context: {recipe:
    [(site, [(args, kwargs) per call])]}."""
    model = patches.model
    with patches.suspended():
        engine = DecodeEngine(model, batch, plan.capture_cache_len)
        _fill_to(engine, prompt(model, batch, plan.prompt_len, plan.seed), context - 1)
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
