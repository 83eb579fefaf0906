"""The float64 run of a patched site's original path, which both the original and the fused path are measured
against."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable

import torch

from optiq.gate.references import experts as reference_experts
from optiq.patching.structure import swiglu_experts

SHARED_EXPERTS_BYTES = 2**31  # a layer's experts in float64 past this are not copied (qwen3-30b-a3b's: 4.8 GB)


@contextmanager
def float64_path(original: Callable):
    """``original`` in float64: a module's forward runs on a float64 copy of the module (SwiGLU MoE experts through
    ``references.experts``, other experts through transformers' eager loop: grouped GEMMs have no float64 kernel).
    SwiGLU experts whose float64 copy would pass SHARED_EXPERTS_BYTES keep their weights, shared and in their own
    dtype, which ``references.experts`` casts one expert at a time: a float64 copy of DeepSeek-V4-Flash's 256
    experts would be 52 GB a layer (smaller ones are copied: every expert at once is faster than a loop over the
    experts hit). On exit the experts' forwards are dropped: each holds its module, a cycle that would keep every
    site's float64 copy alive until a garbage collection."""
    owner = getattr(original, "__self__", None)
    if not isinstance(owner, torch.nn.Module):
        yield original
        return
    experts = {name: m for name, m in owner.named_modules() if swiglu_experts(m) is not None}
    weights = [p for m in experts.values() for p in m.parameters(recurse=False)]
    share = sum(8 * p.numel() for p in weights) > SHARED_EXPERTS_BYTES
    double = copy.deepcopy(owner, {id(p): p for p in weights} if share else {})
    for name, module in double.named_modules():
        if not (share and name in experts):
            module._apply(lambda t: t.to(torch.float64) if t.is_floating_point() else t, recurse=False)
        if name in experts:
            module.forward = reference_experts.experts_forward(module)
        elif hasattr(getattr(module, "config", None), "_experts_implementation"):
            module.config._experts_implementation = "eager"
    try:
        yield double.forward if "forward" in vars(double) and original.__name__ == "forward" else \
            original.__func__.__get__(double)
    finally:
        for module in double.modules():
            vars(module).pop("forward", None)
